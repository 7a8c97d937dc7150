"""Model invariants: looped reference parity, cache == full forward, exits, causality, compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.models import (
    CausalLM,
    LoopSpec,
    exit_distribution,
    forward,
    get_preset,
    init_cache,
    init_params,
    param_shapes,
    unstack_cache,
    unstack_layers,
)
from jaxrl_lp.numerics.policy import Policy

TOL = 1e-5  # f32 parity tolerance promised by the spec (f32 against f32)
# Against the f64 numpy reference the f32 forward carries its own rounding error,
# about 1e-5 relative after 3 loops of 2 layers on O(1) logits.
REF_TOL = 5e-5


def _tokens(cfg, b=2, t=9, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, cfg.vocab_size, (b, t)), jnp.int32)


# ---------------------------------------------------------------- numpy reference (f64)
def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_rope(x, theta):  # x [T, H, Dh]
    t, _, dh = x.shape
    inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
    f = np.arange(t)[:, None] * inv
    emb = np.concatenate([f, f], -1)[:, None, :]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return x * np.cos(emb) + np.concatenate([-x2, x1], -1) * np.sin(emb)


def _np_attn(x, lp, i, cfg):
    t = x.shape[0]
    hd, H, K = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = (x @ lp["q_proj"][i]).reshape(t, H, hd)
    k = (x @ lp["k_proj"][i]).reshape(t, K, hd)
    v = (x @ lp["v_proj"][i]).reshape(t, K, hd)
    if cfg.qk_norm:
        q, k = _np_rms(q, lp["q_norm"][i], cfg.rms_eps), _np_rms(k, lp["k_norm"][i], cfg.rms_eps)
    q, k = _np_rope(q, cfg.rope_theta), _np_rope(k, cfg.rope_theta)
    k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).reshape(t, H * hd) @ lp["o_proj"][i]


def _np_mlp(x, lp, i):
    g, u = x @ lp["gate_proj"][i], x @ lp["up_proj"][i]
    return (g / (1 + np.exp(-g)) * u) @ lp["down_proj"][i]


def np_looped(params, cfg, tokens):
    """Per-token step hidden states, gate probabilities and step logits of one sequence."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    lp, eps = p["layers"], cfg.rms_eps
    h = p["embed"][np.asarray(tokens)]
    lams, logits = [], []
    for _ in range(cfg.loop_steps):
        for i in range(cfg.num_layers):
            h = h + _np_rms(_np_attn(_np_rms(h, lp["attn_norm_in"][i], eps), lp, i, cfg),
                            lp["attn_norm_out"][i], eps)
            h = h + _np_rms(_np_mlp(_np_rms(h, lp["mlp_norm_in"][i], eps), lp, i),
                            lp["mlp_norm_out"][i], eps)
        h = _np_rms(h, p["final_norm"], eps)
        g = h @ p["exit_gate"]["kernel"][:, 0] + p["exit_gate"]["bias"][0]
        lams.append(1 / (1 + np.exp(-g)))
        logits.append(h @ p["lm_head"])
    return np.stack(lams), np.stack(logits)  # [R, T], [R, T, V]


def _params(cfg, seed=0, gate_bias=0.0, scale=4.0):
    params = init_params(cfg, jax.random.PRNGKey(seed))
    params = jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params)  # livelier logits
    if cfg.is_looped:  # a spread of exit probabilities so every rule picks different steps
        params["exit_gate"]["kernel"] = params["exit_gate"]["kernel"] * 10
        params["exit_gate"]["bias"] = params["exit_gate"]["bias"] + gate_bias
    return params


# ---------------------------------------------------------------- looped model
@pytest.mark.parametrize("loops", [1, 3])
def test_looped_matches_reference_all_readouts(loops):
    cfg = get_preset("tiny-ouro").replace(loop_steps=loops)
    params = _params(cfg, seed=1)
    toks = _tokens(cfg, b=1, t=8)
    lams, step_logits = np_looped(params, cfg, toks[0])
    pdf = np.asarray(exit_distribution(jnp.asarray(lams[:, None, :])))[0]  # [T, R]
    # Exit distribution: non-negative and sums to one.
    assert (pdf >= 0).all()
    np.testing.assert_allclose(pdf.sum(-1), 1.0, atol=1e-6)
    # Hand-computed distribution from the gate probabilities.
    hand = np.zeros_like(pdf)
    rem = np.ones(lams.shape[1])
    for r in range(loops):
        hand[:, r] = rem if r == loops - 1 else lams[r] * rem
        rem = rem * (1 - lams[r])
    np.testing.assert_allclose(pdf, hand, atol=1e-6)

    fwd = jax.jit(forward, static_argnames=("cfg", "policy", "loop", "readout"))
    last, _, out = fwd(params, cfg, Policy.parse("fp32"), toks)
    np.testing.assert_allclose(last[0], step_logits[-1], atol=REF_TOL)
    np.testing.assert_allclose(out.exit_pdf[0], hand, atol=1e-5)
    expected, _, _ = fwd(params, cfg, Policy.parse("fp32"), toks, readout="expected")
    np.testing.assert_allclose(expected[0], np.einsum("rtv,tr->tv", step_logits, hand), atol=REF_TOL)
    for k in range(1, loops + 1):
        fixed, _, out = fwd(params, cfg, Policy.parse("fp32"), toks, loop=LoopSpec(f"fixed:{k}"))
        np.testing.assert_allclose(fixed[0], step_logits[k - 1], atol=REF_TOL)
        assert (np.asarray(out.exit_steps) == k - 1).all()
    thr, _, out = fwd(params, cfg, Policy.parse("fp32"), toks, loop=LoopSpec("threshold:0.5"))
    cum = np.cumsum(hand, -1)
    want = np.where((cum >= 0.5).any(-1), np.argmax(cum >= 0.5, -1), loops - 1)
    np.testing.assert_array_equal(out.exit_steps[0], want)
    np.testing.assert_allclose(thr[0], step_logits[want, np.arange(8)], atol=REF_TOL)
    if loops == 3:
        assert len(set(want.tolist())) > 1, "test should exercise several exit steps"


def test_looped_r1_is_sandwich_decoder_and_dense_has_no_loop_options():
    cfg = get_preset("tiny-ouro").replace(loop_steps=1)
    params = _params(cfg)
    toks = _tokens(cfg, b=1, t=6)
    _, step_logits = np_looped(params, cfg, toks[0])
    logits, _, out = forward(params, cfg, Policy.parse("fp32"), toks, readout="expected")
    np.testing.assert_allclose(logits[0], step_logits[0], atol=REF_TOL)
    np.testing.assert_allclose(out.exit_pdf, 1.0)
    dense = get_preset("tiny-qwen3")
    with pytest.raises(ValueError, match="looped models only"):
        forward(init_params(dense, jax.random.PRNGKey(0)), dense, Policy.parse("fp32"), toks,
                readout="expected")


DECODES = [
    ("tiny-qwen3", {}),
    ("tiny-ouro", {"loop": LoopSpec("full")}),
    ("tiny-ouro", {"loop": LoopSpec("fixed:2")}),
    ("tiny-ouro", {"loop": LoopSpec("threshold:0.5")}),
    ("tiny-ouro", {"loop": LoopSpec("threshold:0.5:2"), "readout": "exit"}),
    ("tiny-ouro", {"readout": "expected"}),
]


# Every loop option with stacked layers; unstacked layers (the sampler's layout) for the dense
# model and the full loop by default, the other options by hand (5-7 s each cold on 2 cores).
@pytest.mark.parametrize("layout,preset,kwargs", [
    pytest.param(layout, preset, kwargs, id=f"{layout}-{preset}-kwargs{i}",
                 marks=() if layout == "stacked" or i < 2 else pytest.mark.slow)
    for layout in ("stacked", "unstacked") for i, (preset, kwargs) in enumerate(DECODES)])
def test_incremental_decoding_equals_full_forward(layout, preset, kwargs):
    """One token at a time with the cache == the full forward; also with the decode layout."""
    cfg = get_preset(preset)
    if cfg.is_looped:
        cfg = cfg.replace(loop_steps=3)
    # Initialization scale: the f32 rounding differences between one-token and
    # whole-sequence matmuls stay ~1e-6, well inside the spec's 1e-5.
    params = _params(cfg, seed=2, scale=1.0)
    toks = _tokens(cfg, b=2, t=10, seed=3)
    full, _, full_out = forward(params, cfg, Policy.parse("fp32"), toks, **kwargs)

    step = jax.jit(
        lambda p, tk, c, i: forward(p, cfg, Policy.parse("fp32"), tk, None, c, i, **kwargs),
    )
    cache = init_cache(cfg, Policy.parse("fp32"), batch=2, max_len=16)
    if layout == "unstacked":  # what the sampler decodes with: per-layer weights and buffers
        params, cache = unstack_layers(params), unstack_cache(cache, cfg)
        assert isinstance(params["layers"], tuple) and isinstance(cache["k"], tuple)
    logits, cache, out = step(params, toks[:, :4], cache, 0)  # prefill 4 tokens
    got, exits = [logits], [None if out is None else out.exit_steps]
    for i in range(4, 10):
        logits, cache, out = step(params, toks[:, i:i + 1], cache, i)
        got.append(logits)
        exits.append(None if out is None else out.exit_steps)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, atol=TOL)
    if cfg.is_looped:
        np.testing.assert_array_equal(jnp.concatenate(exits, 1), full_out.exit_steps)
        assert step._cache_size() == 2  # one compile for prefill, one for every decode step


def test_causality_gradients_do_not_flow_from_the_future():
    for preset in ("tiny-qwen3", "tiny-ouro"):
        cfg = get_preset(preset)
        params = _params(cfg)
        # Positions 0..4 use ids < 64 and positions 5..9 ids >= 64: the gradient of the
        # loss at position 4 w.r.t. the embedding rows of ids >= 64 must be exactly zero.
        rs = np.random.RandomState(0)
        toks = jnp.asarray(np.concatenate([rs.randint(0, 64, (1, 5)), rs.randint(64, 128, (1, 5))],
                                          1), jnp.int32)
        kwargs = {"readout": "expected"} if cfg.is_looped else {}

        def loss(p, t, cfg=cfg, toks=toks, kwargs=kwargs):
            logits, _, _ = forward(p, cfg, Policy.parse("bf16"), toks, **kwargs)
            return jax.nn.log_softmax(logits[0, t])[3]

        grad = jax.jit(jax.grad(loss))
        g = grad(params, 4)["embed"]
        assert float(jnp.abs(g[64:]).max()) == 0.0
        assert float(jnp.abs(g[:64]).max()) > 0.0
        # And position 9 does depend on the future-of-4 rows.
        g9 = grad(params, 9)["embed"]
        assert float(jnp.abs(g9[64:]).max()) > 0.0


def test_no_recompile_on_second_call():
    cfg = get_preset("tiny-ouro")
    params = _params(cfg)
    fn = jax.jit(lambda p, t: forward(p, cfg, Policy.parse("bf16"), t)[0])
    fn(params, _tokens(cfg, seed=0)).block_until_ready()
    fn(params, _tokens(cfg, seed=1)).block_until_ready()
    assert fn._cache_size() == 1


def test_ouro_1p4b_parameter_count():
    cfg = get_preset("ouro-1.4b")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert n == cfg.param_count()
    # Published as 1.4B (untied 49152x2048 embeddings and head, 24 shared layers).
    assert 1.40e9 <= n <= 1.45e9, n
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        jax.eval_shape(lambda: init_params(get_preset("ouro-2.6b"), jax.random.PRNGKey(0))))
    ) == pytest.approx(2.67e9, rel=0.02)


def test_policy_regions_move_the_rounding():
    cfg = get_preset("tiny-qwen3")
    params = _params(cfg)
    # Norm scales away from 1, so that where they are applied matters.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.3 * jnp.sin(jnp.arange(x.size).reshape(x.shape))
        if "norm" in str(path[-1]) else x, params)
    toks = _tokens(cfg)
    run = lambda pol: np.asarray(forward(params, cfg, Policy.parse(pol), toks)[0])
    # Under f32 compute the regions change nothing: every rounding site is the identity.
    exact = run("fp32")
    np.testing.assert_array_equal(exact, run(Policy.parse("fp32").replace(f32_regions=frozenset())))
    bf16, engine = run("bf16"), run("bf16-engine")
    assert np.abs(bf16 - engine).max() > 0
    # Leaving out any single region changes the bf16 result.
    for region in ("rope", "swiglu", "norm", "residual", "softmax"):
        pol = Policy.parse("bf16")
        pol = pol.replace(f32_regions=pol.f32_regions - {region})
        assert np.abs(run(pol) - bf16).max() > 0, region
    # And bf16 is a faithful approximation of f32 (8-bit mantissas through a
    # 2-layer model with 4x-scaled weights: a few percent of the logit scale).
    assert np.abs(bf16 - exact).mean() < 0.05 * np.abs(exact).mean()


def test_model_module_and_bad_params():
    cfg = get_preset("tiny-qwen3")
    params = init_params(cfg, jax.random.PRNGKey(0))
    model = CausalLM(cfg, params)
    jax.tree.map(np.testing.assert_array_equal, model.params(), params)
    assert model(_tokens(cfg)).shape == (2, 9, cfg.vocab_size)
    bad = dict(params, final_norm=jnp.ones((cfg.hidden_size + 1,)))
    with pytest.raises(ValueError, match="final_norm.*shape"):
        CausalLM(cfg, bad)
    with pytest.raises(ValueError, match="missing.*lm_head"):
        CausalLM(cfg, {k: v for k, v in params.items() if k != "lm_head"})
    assert set(param_shapes(cfg)["layers"]) >= {"q_norm", "k_norm", "attn_norm", "mlp_norm"}


def test_exit_rules_loop_specs_and_their_hf_keys():
    from jaxrl_lp.models import ExitRule, ModelConfig
    from jaxrl_lp.models.loop import exit_rule_from_hf, exit_rule_to_hf

    # Strings round-trip; a threshold above 1 is a legal rule (f32 sums can exceed 1.0).
    for spec in ("full", "fixed:2", "threshold:0.5:1", "threshold:1.0:2", "threshold:1.5:1"):
        assert str(ExitRule.parse(spec)) == spec
    for bad in ("threshold:0", "threshold:nan", "fixed:0", "sometimes", "threshold:0.5:0"):
        with pytest.raises(ValueError):
            ExitRule.parse(bad)
    assert LoopSpec.parse("threshold:0.5:1/deferred") == LoopSpec("threshold:0.5", "deferred")
    assert str(LoopSpec()) == "model/dense"
    looped = get_preset("tiny-ouro").replace(exit_rule="fixed:3")
    assert LoopSpec().resolve(looped) == LoopSpec("fixed:3", "dense")
    assert LoopSpec("full", "deferred").resolve(get_preset("tiny-qwen3")) == LoopSpec("full", "dense")
    with pytest.raises(ValueError, match="exceeds the model's 4 loop steps"):
        LoopSpec("fixed:5").resolve(looped)
    with pytest.raises(ValueError, match="ModelConfig.exit_rule"):
        ModelConfig(family="ouro", loop_steps=2, qk_norm=False, exit_rule="fixed:3")
    with pytest.raises(ValueError, match="must be 'full' for the dense"):
        ModelConfig(exit_rule="threshold:0.5")
    # The Ouro config keys: written so the reference reads out by the rule, and read back.
    for rule in ("full", "fixed:1", "fixed:3", "threshold:0.5:1", "threshold:1.0:1"):
        keys = exit_rule_to_hf(rule, 4)
        assert exit_rule_from_hf(keys, 4) == rule
    assert exit_rule_to_hf("full", 4)["early_exit_step"] == 3  # the reference's last index
    assert exit_rule_from_hf({}, 4) == "threshold:1.0:1"  # OuroConfig's default
    assert exit_rule_from_hf({"early_exit_step": 9, "early_exit_threshold": 0.7}, 4) \
        == "threshold:0.7:1"  # an out-of-range step is ignored, as the reference does
    with pytest.raises(NotImplementedError, match="min_loops"):
        exit_rule_to_hf("threshold:0.5:2", 4)


@pytest.mark.parametrize("preset,policy", [
    ("tiny-qwen3", "fp32"), pytest.param("tiny-qwen3", "bf16", marks=pytest.mark.slow),
    pytest.param("tiny-ouro", "fp32", marks=pytest.mark.slow)])
def test_one_token_axis_in_the_matmuls_changes_no_value_and_no_dense_gradient(
        preset, policy, monkeypatch):
    # `layers.dot` flattens the token axes off a mesh (one [K, T] x [T, N] weight gradient,
    # which XLA:CPU computes without a transposing pass); under a mesh it keeps them apart.
    # The same log-probs bit for bit, and the same gradient: bit for bit for a dense model;
    # a looped one sums its loop steps' weight products in another order (rounding only).
    from jaxrl_lp.bench.learner import grpo_batch
    from jaxrl_lp.models import layers
    from jaxrl_lp.rl.logprobs import dense_logprobs, packed_rows_of

    cfg, pol = get_preset(preset), Policy.parse(policy)
    params = init_params(cfg, jax.random.PRNGKey(0))
    ro, adv = grpo_batch(cfg, pol, params, batch=4, prompt_len=8, seq_len=32, group=2, seed=0)
    rows = packed_rows_of(ro, buckets=16)

    def loss(p):
        lp, ent = dense_logprobs(p, cfg, pol, ro, packed_rows=rows)
        return jnp.sum(lp * adv[:, None] * ro.completion_mask) + 0.01 * jnp.sum(ent), lp

    # The norm weights' gradient also takes its form by the mesh (`scale_features`): one form
    # in both programs, so that only the matmuls' token axes differ.
    monkeypatch.setattr(layers, "scale_features", lambda y, w: y * w)
    (v_flat, lp_flat), g_flat = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    monkeypatch.setattr(layers, "current_mesh", lambda: "a mesh")  # the einsum over the axes
    (v_axes, lp_axes), g_axes = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    np.testing.assert_array_equal(lp_flat, lp_axes)
    assert float(v_flat) == float(v_axes)
    for a, b in zip(jax.tree.leaves(g_flat), jax.tree.leaves(g_axes), strict=True):
        if cfg.is_looped:
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(b))))
        else:
            np.testing.assert_array_equal(a, b)
