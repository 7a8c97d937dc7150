"""The sampler's weight products given back to the learner (`grpo.reuse_products`).

- Recording changes nothing the sampler samples or records (bits), and the
  products are those of a parallel forward over the rollout's grid (rounding).
- The learner's forward over them has the sampler's values, and its gradient
  is the dense one (f32 rounding); its compiled program has none of the
  forward's weight products (counted in the optimized HLO).
- The GRPO step given them updates as the step without them does, at one
  micro-batch or two; misuse is refused with a message naming the fix.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_lp.bench.exactness import EOS_ID, TEMPERATURE, exactness_model
from jaxrl_lp.models.recorded import LAYER_PRODUCTS, take_product_rows
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl import LossConfig, make_grpo_step
from jaxrl_lp.rl.logprobs import (
    dense_logprobs,
    forward_products,
    prompt_positions,
    recorded_logprobs,
)
from jaxrl_lp.rollout import SamplingConfig, generate

PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (3, 3))
G, N = 2, 10
F32 = Policy.parse("fp32")


def _sample(params, cfg, record: bool):
    """The exactness bench's rollout (some rows end at EOS, others run to N)."""
    return generate(params, cfg, PROMPTS, policy=F32,
                    sampling=SamplingConfig(temperature=TEMPERATURE), max_new_tokens=N,
                    num_samples=G, eos_id=EOS_ID, key=jax.random.PRNGKey(1),
                    record_products=record)


@functools.cache
def _setup():
    cfg, params, _ = exactness_model("dense")
    return cfg, params, _sample(params, cfg, True)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint32) if x.dtype == np.float32 else x


def test_recording_keeps_the_samplers_bits_and_records_its_forward():
    cfg, params, ro = _setup()
    plain = _sample(params, cfg, False)
    assert plain.products is None
    for f in ("completion_tokens", "completion_mask", "logprobs", "prompt_tokens"):
        np.testing.assert_array_equal(_bits(getattr(ro, f)), _bits(getattr(plain, f)), err_msg=f)
    lengths = np.asarray(ro.completion_mask).sum(1)
    assert lengths.min() < N and lengths.max() == N  # rows that end early, and not
    b, p = ro.prompt_tokens.shape
    prods = ro.products
    widths = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
              "v_proj": cfg.num_kv_heads * cfg.head_dim, "o_proj": cfg.hidden_size,
              "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size,
              "down_proj": cfg.hidden_size}
    assert set(prods.layers) == set(LAYER_PRODUCTS)
    for k, w in widths.items():
        assert prods.layers[k].shape == (cfg.num_layers, b, p + N - 1, w), k
    assert prods.logits.shape == (b, N, cfg.vocab_size)
    # The same numbers as one parallel forward over the grid, up to matmul rounding: the
    # prefill's slots, every decode step's, and the logits each token was drawn from. (A
    # prompt's padding slots attend to nothing and average what their cache holds; no
    # token reads them, and their rows carry no gradient.)
    want = jax.jit(forward_products, static_argnums=(1, 2))(params, cfg, F32, ro)
    real = np.concatenate([np.asarray(prompt_positions(ro.prompt_tokens, ro.prompt_lengths))
                           >= 0, np.ones((b, N - 1), bool)], axis=1)
    assert 0 < real.sum() < real.size
    for k in LAYER_PRODUCTS:
        np.testing.assert_allclose(np.asarray(prods.layers[k])[:, real],
                                   np.asarray(want.layers[k])[:, real], rtol=1e-4, atol=1e-5,
                                   err_msg=k)
    mask = np.asarray(ro.completion_mask) > 0
    np.testing.assert_allclose(np.asarray(prods.logits)[mask], np.asarray(want.logits)[mask],
                               rtol=1e-4, atol=1e-5)
    # The recorded log-probs are the recorded logits' (the sampler's `token_logprobs`).
    lp = jax.nn.log_softmax(prods.logits / TEMPERATURE, axis=-1)
    lp = jnp.take_along_axis(lp, ro.completion_tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp)[mask], np.asarray(ro.logprobs)[mask], atol=2e-6)
    # A minibatch's rows take their products along.
    rows = np.array([1, 4])
    sub = take_product_rows(prods, rows)
    np.testing.assert_array_equal(sub.layers["up_proj"], prods.layers["up_proj"][:, rows])
    np.testing.assert_array_equal(sub.logits, prods.logits[rows])
    assert take_product_rows(prods, np.arange(b)) is prods  # one minibatch: no copy


def _dots(compiled_text: str) -> int:
    """Matmuls in an optimized HLO module: `dot(` instructions, wherever fused."""
    return len(re.findall(r"= \S+ dot\(", compiled_text))


def test_the_recorded_forward_has_the_samplers_values_and_the_dense_gradient():
    cfg, params, ro = _setup()
    plain = dataclasses.replace(ro, products=None)
    mask = ro.completion_mask
    adv = jnp.asarray(np.linspace(-1.0, 1.0, mask.shape[0]), jnp.float32)

    def loss(fn):
        def f(p):
            lp, ent = fn(p)
            return jnp.sum(adv[:, None] * lp * mask) + 0.1 * jnp.sum(ent * mask)
        return jax.jit(jax.value_and_grad(f))

    dense = loss(lambda p: dense_logprobs(p, cfg, F32, plain))
    recorded = loss(lambda p: recorded_logprobs(p, cfg, F32, plain, ro.products))
    (v_d, g_d), (v_r, g_r) = dense(params), recorded(params)
    np.testing.assert_allclose(v_r, v_d, rtol=1e-5)
    lp, _ = recorded_logprobs(params, cfg, F32, plain, ro.products)
    m = np.asarray(mask) > 0
    np.testing.assert_allclose(np.asarray(lp)[m], np.asarray(ro.logprobs)[m], atol=2e-6)
    flat = lambda t: jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(t)])
    diff = float(jnp.linalg.norm(flat(g_r) - flat(g_d)) / jnp.linalg.norm(flat(g_d)))
    assert diff < 1e-5, diff
    for name in ("embed", "lm_head", "final_norm"):  # every part of the model gets its share
        np.testing.assert_allclose(g_r[name], g_d[name], rtol=1e-3, atol=1e-6, err_msg=name)
    # The compiled program of the recorded forward: the backward's two products of each
    # weight (layers scanned: one body) and attention's, none of the forward's seven layer
    # products and the head's.
    text = lambda fn: fn.lower(params).compile().as_text()
    d, r = _dots(text(dense)), _dots(text(recorded))
    assert d - r == len(LAYER_PRODUCTS) + 1, (d, r)


@pytest.mark.slow
def test_the_grpo_step_given_products_updates_as_without_them():
    cfg, params, ro = _setup()
    plain = dataclasses.replace(ro, products=None)
    b = ro.prompt_tokens.shape[0]
    adv = jnp.asarray(np.linspace(-1.0, 1.0, b), jnp.float32)
    sgd = optax.sgd(1.0)  # the parameter change is the gradient
    copy = lambda t: jax.tree.map(jnp.copy, t)

    def delta(m, products):
        step = make_grpo_step(cfg, F32, LossConfig(), sgd, micro_batches=m)
        new, _, metrics = step(copy(params), sgd.init(params), plain, adv, ro.logprobs, None,
                               None, ro.logprobs, products)
        return jax.tree.map(jnp.subtract, new, params), metrics

    ref, m_ref = delta(1, None)
    flat = lambda t: jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(t)])
    for m in (1, 2):
        got, metrics = delta(m, ro.products)
        rel = float(jnp.linalg.norm(flat(got) - flat(ref)) / jnp.linalg.norm(flat(ref)))
        assert rel < 1e-5, (m, rel)
        assert metrics["ratio_mean"] == m_ref["ratio_mean"] == 1.0
        np.testing.assert_allclose(metrics["loss"], m_ref["loss"], rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(metrics["entropy"], m_ref["entropy"], rtol=1e-5)


def test_products_are_refused_where_they_do_not_stand_for_the_forward():
    cfg, params, ro = _setup()
    plain = dataclasses.replace(ro, products=None)
    adv = jnp.zeros((ro.prompt_tokens.shape[0],), jnp.float32)
    step = make_grpo_step(cfg, F32, LossConfig(), optax.sgd(1.0))
    with pytest.raises(ValueError, match="replay_BxN"):  # no promise that the weights match
        step(params, optax.sgd(1.0).init(params), plain, adv, ro.logprobs, None, None, None,
             ro.products)
    dense = make_grpo_step(cfg, F32, LossConfig(), optax.sgd(1.0), method="dense")
    with pytest.raises(ValueError, match="hybrid step"):
        dense(params, optax.sgd(1.0).init(params), plain, adv, ro.logprobs, None, None,
              ro.logprobs, ro.products)
    lcfg, lparams, loop = exactness_model("looped_dense", loop_steps=2)
    with pytest.raises(ValueError, match="record_products.*looped"):
        generate(lparams, lcfg, PROMPTS, max_new_tokens=2, loop=loop, record_products=True)


def test_the_program_refuses_products_it_could_never_read(tmp_path):
    from jaxrl_lp.train import apply_overrides, default_config
    from jaxrl_lp.train.validate import validate

    cfg = lambda *o: apply_overrides(default_config(), [f"run.out_dir={tmp_path / 'r'}", *o])
    dense = ["model.family=qwen3", "model.loop_steps=1", "grpo.reuse_products=true"]
    assert validate(cfg(*dense)).model.is_looped is False
    for extra, match in (
            (["model.family=ouro", "model.loop_steps=2"], "a dense model's .got a looped"),
            (["run.mesh=fsdp=2"], "one device's: set run.mesh=''"),
            (["grpo.max_staleness=1"], "set grpo.max_staleness=0"),
            (["grpo.learner_policy=bf16"], "grpo.learner_policy equal to grpo.sampler_policy"),
            (["sft.optimizer=error_diffusion:binary:k=4"], "plain weights'")):
        with pytest.raises(ValueError, match=rf"grpo.reuse_products=true: .*{match}.*"
                                             "or set grpo.reuse_products=false"):
            validate(cfg(*dense, *extra))
    with pytest.raises(ValueError, match="set grpo.logprobs=hybrid and grpo.replay=auto"):
        cfg(*dense, "grpo.replay=always")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_run_reading_the_samplers_products_trains_as_the_run_computing_them(tmp_path):
    """A dense model, a KL term to another model (a random checkpoint: its KL is not 0 at the
    first update, so every update moves the weights whatever the rewards), two minibatches:
    the first update of each step reads the products, the second replays; the runs agree to
    f32 rounding, step by step, and in their last weights."""
    import json

    from helpers import short_run

    from jaxrl_lp.models.hf_io import save_hf_checkpoint
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.train import apply_overrides, default_config, run_train
    from jaxrl_lp.train.checkpoint import Checkpointer
    from jaxrl_lp.train.validate import build_task, model_config

    base = [*short_run(sft_steps=2, grpo_steps=3, checkpoint_every=50), "model.family=qwen3",
            "model.loop_steps=1", "loss.kl_beta=0.05", "grpo.minibatches=2",
            "grpo.verify_every=2"]
    probe = apply_overrides(default_config(), base)
    mcfg = model_config(probe, build_task(probe))
    reference = tmp_path / "reference"
    save_hf_checkpoint(reference, mcfg, init_params(mcfg, jax.random.PRNGKey(9)))
    runs, params = {}, {}
    for reuse in ("false", "true"):
        out = tmp_path / reuse
        run_train(apply_overrides(default_config(), [
            *base, f"loss.reference={reference}", f"grpo.reuse_products={reuse}",
            f"run.out_dir={out}"]))
        lines = (out / "metrics.jsonl").read_text().splitlines()
        runs[reuse] = [r for r in map(json.loads, lines) if r["phase"] == "grpo"]
        ckpt = Checkpointer(out)
        params[reuse] = ckpt.manager.restore(ckpt.latest_step())["state"]["params"]
        ckpt.close()
    off, on = runs["false"], runs["true"]
    # The first update of each step reads the sampler's products; it moves the weights (the KL
    # to the other model has a gradient from the start), so the second replays.
    assert [r["replayed_updates"] for r in on] == [r["replayed_updates"] for r in off]
    assert [r["replayed_updates"] for r in on] == [1.0, 1.0, 1.0]
    assert all(r["kl_ref"] > 0.0 for r in on)
    assert all(r["reused_forward_updates"] + r["replayed_updates"] == 2.0 for r in on)
    assert all(r["reused_forward_updates"] == 0.0 for r in off)
    assert [r["replay_verified"] for r in on] == [1.0, 0.0, 1.0]  # the verification still runs
    assert all(r["grad_norm"] > 0 for r in off)
    for a, b in zip(off, on, strict=True):
        for k in ("loss", "grad_norm", "kl_ref", "entropy", "ratio_mean"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-7, err_msg=k)
        assert a["reward_mean"] == b["reward_mean"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 params["false"], params["true"])
