"""Tests of weight export and sync: exporters, Fair Cast, the seven checks, diagnostics."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_lp.models import get_preset, param_shapes
from jaxrl_lp.numerics import Policy, QArray, ulp
from jaxrl_lp.numerics import quantize as quantize_array
from jaxrl_lp.rl.logprobs import replay_logprobs
from jaxrl_lp.rollout import generate
from jaxrl_lp.sync import (
    ROUNDINGS,
    SamplerState,
    cast,
    chain,
    check_requantize_fixed_point,
    check_scales,
    expected_layout,
    hash_served,
    kl_from_logits,
    kl_from_logprobs,
    progress_init,
    progress_update,
    quantize,
    run_sync_checks,
    served_params_for_forward,
    served_ulp,
    staleness_init,
    staleness_update,
    straight_through_served,
    ternary,
    ulp_distance,
)

CFG = get_preset("tiny-qwen3")
BF16 = jnp.bfloat16
BF16_POLICY = Policy.parse("bf16")
VERSION = 5
PROBE = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 8))


@pytest.fixture(scope="module")
def master():
    """tiny-qwen3 master weights (numpy draws: no per-shape PRNG compiles), norms near 1."""
    rng = np.random.default_rng(0)

    def draw(path, shape):
        name = str(path[-1].key)
        if "norm" in name:
            return jnp.asarray(1 + rng.normal(0, 0.05, shape), jnp.float32)
        return jnp.asarray(rng.normal(0, CFG.init_std, shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(CFG),
                                            is_leaf=lambda x: isinstance(x, tuple))


# One instance (and one compiled apply) per exporter configuration for the whole module.
EXPORTERS = {
    **{f"bf16_{r}": cast("bf16", r, seed=1) for r in ROUNDINGS},
    **{f: quantize(f, include_lm_head=True) for f in
       ("fp8", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4", "ternary", "binary")},
    # The three ternary export paths are swept in tests/test_ternary_export.py.
    "ternary_direct_codes": ternary("direct_codes"),
    "ef_then_mxfp8": chain(cast("bf16", "error_feedback"), quantize("mxfp8")),
}
_APPLY = {name: jax.jit(ex.apply) for name, ex in EXPORTERS.items()}


def _export(name, params, times=1):
    state = EXPORTERS[name].init(params)
    for v in range(times):
        served, state = _APPLY[name](params, state, v)
    return served, state


def _transfer(tree):
    """What the sampler receives: a host round trip of every array."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)


def _checks(written, held, master, *, version=VERSION, cache_version=VERSION,
            sampler_policy=BF16_POLICY, expected=None, **kwargs):
    sampler = SamplerState(held, version, cache_version, sampler_policy)
    return run_sync_checks(written, hash_served(written), sampler,
                           expected or expected_layout(EXPORTERS["mxfp8"], master), VERSION,
                           master=master, cfg=CFG, probe_tokens=PROBE, learner_policy=BF16_POLICY,
                           **kwargs)


# ----------------------------------------------------------------------------- exporters
def test_cast_dtypes_state_and_chain(master):
    for r in ROUNDINGS:
        served, state = _export(f"bf16_{r}", master, times=2)
        assert all(x.dtype == BF16 for x in jax.tree.leaves(served))
        assert int(state.count) == 2
    served, (s1, s2) = _export("ef_then_mxfp8", master)
    assert isinstance(served["layers"]["q_proj"], QArray) and served["final_norm"].dtype == BF16
    assert jax.tree.leaves(s1.residual)[0].dtype == jnp.float32 and s2 == ()


def test_quantize_keeps_high_precision_tensors(master):
    served, _ = _export("fp8", master)
    q = served["layers"]["q_proj"]
    assert isinstance(q, QArray) and q.axis == 1 and q.scales.shape == (CFG.num_layers, 1, 1)
    for kept in ("embed", "final_norm"):
        assert served[kept].tobytes() == master[kept].tobytes()
    for kept in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        assert served["layers"][kept].tobytes() == master["layers"][kept].tobytes()
    assert served["lm_head"].axis == 0  # include_lm_head: [D, V] along D
    served, _ = _export("mxfp4", master)
    assert served["lm_head"].scales.shape == (CFG.hidden_size // 32, CFG.vocab_size)
    assert served["layers"]["q_proj"].scales.dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
    served, _ = _export("ternary_direct_codes", master)
    assert not isinstance(served["lm_head"], QArray)  # not asked for


def test_block_size_error_names_tensor(master):
    bad = jax.tree.map(lambda x: x, master)
    bad["layers"]["o_proj"] = jnp.zeros((2, 48, 64))
    with pytest.raises(ValueError, match=r"'layers/o_proj' of shape \(2, 48, 64\).*block size 32"):
        quantize("mxfp8").apply(bad, ())


def test_mismatched_tree_errors_name_tensor(master):
    missing = {**master, "layers": {k: v for k, v in master["layers"].items() if k != "k_proj"}}
    with pytest.raises(ValueError, match="'layers/k_proj' is missing"):
        quantize("nvfp4").apply(missing, ())
    flat = {**master, "layers": {**master["layers"], "up_proj": jnp.zeros((64, 128))}}
    with pytest.raises(ValueError, match=r"'layers/up_proj' has shape \(64, 128\)"):
        ternary("direct_codes").apply(flat, ())
    ex = cast("bf16", "error_feedback")
    with pytest.raises(ValueError, match="layers/k_proj"):
        ex.apply(missing, ex.init(master))
    with pytest.raises(ValueError, match="none of the matmul weights"):
        quantize("fp8").apply({"w": jnp.ones((32, 32))}, ())


def test_stochastic_cast_unbiased_over_exports():
    x = {"w": jnp.asarray(np.random.default_rng(1).normal(0, 0.02, 512), jnp.float32)}
    ex, n = cast("bf16", "stochastic", seed=3), 2000
    counts = ex.init(x)._replace(count=jnp.arange(n, dtype=jnp.int32))
    served = jax.jit(jax.vmap(lambda s: ex.apply(x, s)[0]["w"]))(counts)
    mean = np.asarray(served, np.float64).mean(0)
    sigma = np.asarray(ulp(x["w"], BF16)) / (2 * np.sqrt(n))  # bound on the std of the mean
    assert np.all(np.abs(mean - np.asarray(x["w"])) <= 5 * sigma)
    assert len(np.unique(np.asarray(served[:, 0], np.float32))) == 2  # a fresh key per export


def test_error_feedback_served_mean_converges():
    x = {"w": jnp.asarray(np.random.default_rng(2).normal(0, 0.02, 512), jnp.float32)}
    ex = cast("bf16", "error_feedback")

    def step(state, _):
        served, state = ex.apply(x, state)
        return state, served["w"]

    for n in (10, 400):
        _, served = jax.jit(lambda s, n=n: jax.lax.scan(step, s, length=n))(ex.init(x))
        err = np.abs(np.asarray(served, np.float64).mean(0) - np.asarray(x["w"]))
        # |mean - master| = |e_N| / N <= ulp / (2N), plus f32 rounding of master + e.
        assert np.all(err <= np.asarray(ulp(x["w"], BF16)) / (2 * n) * 1.01 + 1e-9)


def test_fair_cast_toy_rl_from_bf16_checkpoint():
    """Master on the bf16 grid, 50 Adam-like steps at lr 1e-6, an export after each.

    The core claim of the Fair Cast study: round-to-nearest freezes the served copy
    (each element waits until its master has drifted half a bf16 ulp), stochastic
    rounding moves it by the master's displacement from the first step, error
    feedback catches up within a few steps.
    """
    rng = np.random.default_rng(0)
    w0 = {"layers": {"q_proj": jnp.asarray(rng.normal(0, 0.02, (2, 64, 128)), jnp.float32)},
          "final_norm": jnp.asarray(1 + rng.normal(0, 0.05, 64), jnp.float32)}
    w0 = jax.tree.map(lambda x: x.astype(BF16).astype(jnp.float32), w0)
    # Adam-like: a unit-size step per element in a mostly consistent direction.
    grad = jax.tree.map(lambda x: rng.normal(size=x.shape), w0)
    steps = jax.tree.map(lambda g: jnp.asarray(
        -1e-6 * np.sign(g + 0.5 * rng.normal(size=(50, *g.shape))), jnp.float32), grad)
    out = {}
    for r in ROUNDINGS:
        ex = cast("bf16", r, seed=0)

        def step(carry, delta, ex=ex):
            m, st, prog, stale = carry
            m = jax.tree.map(jnp.add, m, delta)
            s, st = ex.apply(m, st)
            stale, met = staleness_update(stale, s)
            prog, p = progress_update(prog, s, m)
            return (m, st, prog, stale), (p, met["retention"])

        s0, st = ex.apply(w0, ex.init(w0))
        carry = (w0, st, progress_init(s0, w0), staleness_init(s0))
        (_, _, prog, _), (p, ret) = jax.jit(lambda c, x: jax.lax.scan(step, c, x))(carry, steps)
        out[r] = dict(p10=float(p[9]), p50=float(p[-1]), lag=int(prog.lag), ret=float(ret.mean()))
    print(out)
    near, sto, ef = out["nearest"], out["stochastic"], out["error_feedback"]
    assert near["ret"] < 0.10 and near["p10"] < 0.25 and (near["lag"] == -1 or near["lag"] >= 20)
    assert sto["p50"] >= 0.8 and 0 < sto["lag"] <= 2
    assert ef["p50"] >= 0.6 and 0 < ef["lag"] <= 10


def test_straight_through_served_value_and_gradient():
    m = {"w": jnp.asarray([0.3, -1e-6, 7.0, 0.1], jnp.float32)}
    # 0.016 with its two low mantissa bits set: more than 2x from its master, so
    # `m + (s - m)` rounds in `s - m` and misses s; the library's form does not.
    s_last = (np.float32(0.016).view(np.uint32) | 3).view(np.float32)
    s = {"w": jnp.asarray([0.25, 0.0, 6.0, s_last], jnp.float32)}
    used = straight_through_served(m, s)
    assert np.asarray(used["w"]).tobytes() == np.asarray(s["w"]).tobytes()
    naive = np.asarray(m["w"]) + (np.asarray(s["w"]) - np.asarray(m["w"]))
    assert naive[3] != s_last
    g = jax.grad(lambda m: jnp.sum(straight_through_served(m, s)["w"] * jnp.arange(4.0)))(m)
    np.testing.assert_array_equal(g["w"], np.arange(4.0))


# ----------------------------------------------------------------------------- checks
@pytest.mark.parametrize("name", list(EXPORTERS))
def test_clean_export_passes_every_check(master, name):
    served, _ = _export(name, master, times=2)
    report = _checks(served, _transfer(served), master,
                     expected=expected_layout(EXPORTERS[name], master))
    assert report.passed, str(report)


def _map_leaf(tree, path, fn):
    tree = jax.tree.map(lambda x: x, tree, is_leaf=lambda x: isinstance(x, QArray))
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = fn(node[path[-1]])
    return tree


def _flip_bit(q):
    codes = np.asarray(q.codes).copy()
    codes.reshape(-1).view(np.uint8)[7] ^= 0x04
    return dataclasses.replace(q, codes=jnp.asarray(codes))


def _scale(q, factor):
    """Same values, non-canonical encoding: scales x factor, codes / factor."""
    s = (q.scales.astype(jnp.float32) * factor).astype(q.scales.dtype)
    c = (q.codes.astype(jnp.float32) / factor).astype(q.codes.dtype)
    return dataclasses.replace(q, codes=c, scales=s)


def _set_scale(q, value, dtype=None):
    s = np.asarray(q.scales.astype(jnp.float32)).copy()
    s.reshape(-1)[3] = value
    return dataclasses.replace(q, scales=jnp.asarray(s.astype(dtype or q.scales.dtype)))


def _transpose_scales(q):
    """The scales' last two axes swapped (a consumer's row-major read of a column-major
    write): valid E8M0 powers of two, in the wrong places. q_proj's [L, D/32, H*hd] scales
    are not square, so their shape shows it; a square tensor's would hash apart (check 2)."""
    return dataclasses.replace(q, scales=jnp.swapaxes(q.scales, -1, -2))


def _block16_scales(q):
    """Scales laid out for blocks of 16 (NVFP4's) on MXFP8 codes: each scale twice."""
    return dataclasses.replace(q, scales=jnp.repeat(q.scales, 2, axis=q.axis))


def _requantize_on_axis(q, axis):
    """The same tensor quantized with its blocks along another axis (not the reduction's)."""
    return quantize_array(q.dequantize(), q.format, axis)


def _one_ulp(x):
    return x.at[3].set(jnp.nextafter(x[3], jnp.float32(2)))


# (fault on the held copy, fault on the written copy, sampler kwargs, check that must fail)
FAULTS = {
    "drop_tensor": (lambda t: {**t, "layers": {k: v for k, v in t["layers"].items()
                                               if k != "k_proj"}}, None, {}, "layout"),
    "flip_payload_bit": (lambda t: _map_leaf(t, ("layers", "q_proj"), _flip_bit), None, {},
                         "hashes"),
    "nan_scale": (lambda t: _map_leaf(t, ("layers", "up_proj"),
                                      lambda q: _set_scale(q, np.nan)), None, {}, "scales"),
    "non_pow2_scale": (lambda t: _map_leaf(t, ("layers", "down_proj"),
                                           lambda q: _set_scale(q, 3.0, np.float32)),
                       None, {}, "scales"),
    # A mis-laid scale tensor also fails the layout (check 1: the expected scale shapes) and
    # the hashes (2); check 3 must name it on its own, from the codes' shape alone.
    "transposed_scales": (lambda t: _map_leaf(t, ("layers", "q_proj"), _transpose_scales),
                          None, {}, "scales"),
    "misshaped_scales": (lambda t: _map_leaf(t, ("layers", "gate_proj"), _block16_scales),
                         None, {}, "scales"),
    "scales_off_their_axis": (lambda t: _map_leaf(t, ("layers", "o_proj"),
                                                  lambda q: _requantize_on_axis(q, 2)),
                              None, {}, "scales"),
    "stale_version": (None, None, {"version": VERSION - 1, "cache_version": VERSION - 1},
                      "version"),
    "stale_cache": (None, None, {"cache_version": VERSION - 1}, "version"),
    "norm_one_ulp": (lambda t: _map_leaf(t, ("final_norm",), _one_ulp), None, {},
                     "unquantized_exact"),
    "norm_one_ulp_at_export": (None, lambda t: _map_leaf(t, ("final_norm",), _one_ulp), {},
                               "unquantized_exact"),
    "codes_not_fixed_point": (None, lambda t: _map_leaf(t, ("layers", "q_proj"),
                                                        lambda q: _scale(q, 4.0)), {},
                              "requantize_fixed_point"),
    "sampler_policy": (None, None, {"sampler_policy": Policy.parse("bf16-engine")}, "probe_logprobs"),
}


@pytest.fixture(scope="module")
def clean(master):
    return _export("mxfp8", master)[0]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_injection_is_caught(master, clean, fault):
    held_fault, written_fault, kwargs, check = FAULTS[fault]
    written = written_fault(clean) if written_fault else clean
    held = _transfer(written)
    if held_fault:
        held = held_fault(held)
    report = _checks(written, held, master, **kwargs)
    failed = [r.name for r in report.failures]
    assert check in failed, str(report)
    if written_fault:  # the exporter wrote it (hashes agree): only the targeted check sees it
        assert failed == [check], str(report)
    assert f"[FAIL] {check}" in str(report)
    if fault in SCALE_FAULT_DETAILS:  # check 3 says what is wrong
        detail = SCALE_FAULT_DETAILS[fault](clean)
        assert detail in report.failures[failed.index(check)].details, str(report)
        if fault != "scales_off_their_axis":  # a shape is wrong against the codes alone;
            alone = check_scales(held)  # an axis only against the expected layout's
            assert not alone.passed and detail in alone.details, alone


def _scale_shape_detail(name, scales_shape):
    return lambda t: (f"layers/{name}: scales shape {scales_shape(t['layers'][name])}, "
                      f"expected {tuple(t['layers'][name].scales.shape)}")


SCALE_FAULT_DETAILS = {
    "transposed_scales": _scale_shape_detail(
        "q_proj", lambda q: tuple(np.swapaxes(np.empty(q.scales.shape), -1, -2).shape)),
    "misshaped_scales": _scale_shape_detail(
        "gate_proj", lambda q: tuple(np.repeat(np.empty(q.scales.shape), 2, q.axis).shape)),
    "scales_off_their_axis": lambda t: "layers/o_proj: scales on axis 2, expected the reduction "
                                       f"axis {t['layers']['o_proj'].axis}",
}


def test_requantize_allows_only_the_mx_renormalization():
    x = jnp.asarray(np.random.default_rng(0).normal(0, 0.02, (64, 32)), jnp.float32)
    q = quantize_array(x, "mxfp4", 0)  # (mxfp8 has such blocks too, fewer: see the sweep)
    req = quantize_array(q.dequantize(), "mxfp4", 0)
    # Blocks whose largest code is max/2 = 3 re-quantize one binade down: codes differ,
    # values do not.
    assert np.any(np.asarray(req.codes, np.float32) != np.asarray(q.codes, np.float32))
    np.testing.assert_array_equal(req.dequantize(), q.dequantize())
    assert check_requantize_fixed_point({"w": q}).passed
    assert not check_requantize_fixed_point({"w": _scale(q, 4.0)}).passed


def test_probe_tolerance_for_unmatched_policies(master, clean):
    held = _transfer(clean)
    report = _checks(clean, held, master, sampler_policy=Policy.parse("bf16-engine"), matched=False)
    assert report.passed, str(report)  # differs, but within PROBE_ATOL
    report = _checks(clean, held, master, sampler_policy=Policy.parse("bf16-engine"), matched=False, atol=0.0)
    assert [r.name for r in report.failures] == ["probe_logprobs"], str(report)


# ----------------------------------------------------------------------------- replay
def test_replay_logprobs_equal_sampler_after_export(master):
    """Matched policies, loss on the served copy: learner replay == sampler, bit for bit."""
    served, _ = _export("bf16_stochastic", master)
    held = served_params_for_forward(_transfer(served))
    policy = Policy.parse("bf16")
    ro = generate(held, CFG, [[1, 2, 3], [4, 5]], policy=policy, max_new_tokens=6,
                  weights_version=VERSION)
    used = straight_through_served(master, served_params_for_forward(served))
    replay = replay_logprobs  # the sampler's program, tokens forced
    lp = replay(used, CFG, policy, ro)
    mask = np.asarray(ro.completion_mask) > 0
    assert np.asarray(lp)[mask].tobytes() == np.asarray(ro.logprobs)[mask].tobytes()
    # The master itself (rounded by nearest in the forward) is not what was served.
    lp_master = replay(master, CFG, policy, ro)
    assert np.abs(np.asarray(lp_master - ro.logprobs)[mask]).max() > 0


# ----------------------------------------------------------------------------- diagnostics
def test_ulp_distance_and_served_ulp(master):
    dist = jax.jit(ulp_distance)
    served, _ = _export("bf16_nearest", master)
    assert float(dist(master, served)["max"]) <= 0.5
    served, _ = _export("bf16_stochastic", master)
    assert 0.25 < float(dist(master, served)["mean"]) < 1.0
    served, _ = _export("mxfp8", master)
    q = served["layers"]["gate_proj"]
    err = np.abs(np.asarray(q.dequantize() - master["layers"]["gate_proj"]))
    assert np.all(err <= np.asarray(jax.jit(served_ulp)(q)) / 2)  # RNE on the element grid
    assert float(dist(master, served)["max"]) <= 0.5


def test_kl_and_staleness():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 11)), jnp.float32)
    kl = jax.jit(kl_from_logits)
    assert abs(float(kl(logits, logits))) < 1e-7 and float(kl(logits, 0.5 * logits)) > 0
    lp = jax.nn.log_softmax(logits)[..., 0]
    est = jax.jit(kl_from_logprobs)(lp, lp - 0.1)
    np.testing.assert_allclose(float(est["k1"]), 0.1, rtol=1e-5)
    assert float(est["k3"]) > 0
    update = jax.jit(staleness_update)
    state = staleness_init({"w": jnp.zeros(4)})
    state, m = update(state, {"w": jnp.asarray([0.0, 1.0, 0.0, 0.0])})
    state, m = update(state, {"w": jnp.asarray([0.0, 1.0, 2.0, 0.0])})
    np.testing.assert_array_equal(state.age[0], [2, 1, 0, 2])
    assert float(m["retention"]) == 0.25 and int(m["staleness_max"]) == 2


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("name", ["bf16_nearest", "fp8", "mxfp8", "mxfp4", "nvfp4", "ternary",
                                  "binary", "ef_then_mxfp8"])
def test_a_non_finite_master_fails_check_3_whatever_the_served_format(master, name, bad):
    """A diverged master (one NaN or inf in a matmul weight and in a norm) is never served as
    finite numbers: the served copy's values there are NaN and check 3 names both tensors."""
    q = master["layers"]["q_proj"]
    diverged = {**master, "layers": {**master["layers"], "q_proj": q.at[0, 5, 7].set(bad)},
                "final_norm": master["final_norm"].at[2].set(bad)}
    served, _ = _export(name, diverged)
    forward = served_params_for_forward(served)
    assert np.isnan(np.asarray(forward["layers"]["q_proj"][0, 5, 7])) or name.startswith("bf16")
    assert not np.isfinite(np.asarray(forward["final_norm"][2]))
    report = check_scales(_transfer(served))
    assert not report.passed
    assert "q_proj" in str(report) and "final_norm" in str(report), str(report)
    # The clean master's served copy passes.
    assert check_scales(_transfer(_export(name, master)[0])).passed
