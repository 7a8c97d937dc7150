"""The GRPO step (`make_grpo_step`) end to end: its loss is the hand computation, its update
does not depend on the micro-batch split.

Tiny models (one layer, hidden 32): `dense` (Qwen3, the packed dense forward) and `looped`
(Ouro, R=2, deferred mode, the recorded exit schedule applied). One rollout of 8 rows with
ragged completions (so the aggregations weigh rows apart), written by hand: the step reads its
tokens, mask, schedule and recorded (sampler) log-probs `S`; no sampler runs. The step is given
old learner log-probs `O` != `S` and, as the hybrid's value, the current learner's log-probs
`L` (`replay_BxN`, what the training program passes under `grpo.replay=auto`), so the loss's
value is known exactly from `L`, `O`, `S` and the advantages while its gradient is the real
dense one. The three are distinct, so a step that swapped any two would compute another loss.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import grpo_loss_reference

from jaxrl_lp.bench.exactness import EXIT_RULE
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl import LossConfig, make_grpo_step
from jaxrl_lp.rl.logprobs import learner_logprobs, packed_rows_of
from jaxrl_lp.rollout import LoopSpec
from jaxrl_lp.rollout.generate import Rollout

B, P, N = 8, 4, 6
PROMPT_LENGTHS = (4, 2, 3, 1, 4, 2, 1, 3)
LENGTHS = (6, 2, 5, 1, 6, 3, 4, 6)  # completion tokens per row
POLICY = Policy.parse("fp32")
OPT = optax.sgd(1.0)  # the update is minus the gradient: parameters compare gradients
SMALL = dict(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)


@functools.cache
def model(kind):
    """(cfg, params, loop) of a random tiny `dense` or `looped` model."""
    if kind == "dense":
        cfg, loop = get_preset("tiny-qwen3").replace(**SMALL), LoopSpec()
    else:
        cfg = get_preset("tiny-ouro").replace(**SMALL, loop_steps=2)
        loop = LoopSpec(EXIT_RULE, "deferred")
    return cfg, init_params(cfg, jax.random.PRNGKey(0)), loop.resolve(cfg)


@functools.cache
def batch(kind):
    """(rollout, advantages, O, L): the hand-written rollout's sampler log-probs are `S`."""
    cfg, _, loop = model(kind)
    rng = np.random.default_rng(3)
    prompts = np.zeros((B, P), np.int32)
    for i, n in enumerate(PROMPT_LENGTHS):  # left-padded, as `generate` writes them
        prompts[i, P - n:] = rng.integers(4, cfg.vocab_size, n)
    mask = (np.arange(N)[None] < np.array(LENGTHS)[:, None]).astype(np.float32)
    tokens = np.where(mask > 0, rng.integers(4, cfg.vocab_size, (B, N)), 0).astype(np.int32)
    sampler = -rng.uniform(0.5, 3.0, (B, N))
    old = sampler + 0.45 * rng.standard_normal((B, N))
    learner = old + 0.25 * rng.standard_normal((B, N))
    exits = rng.integers(0, cfg.loop_steps, (B, N)) if cfg.is_looped else np.zeros((B, N))
    f32 = lambda x: jnp.asarray(np.where(mask > 0, x, 0.0), jnp.float32)
    ro = Rollout(prompt_tokens=jnp.asarray(prompts),
                 prompt_lengths=jnp.asarray(PROMPT_LENGTHS, jnp.int32),
                 completion_tokens=jnp.asarray(tokens), completion_mask=jnp.asarray(mask),
                 logprobs=f32(sampler), exit_steps=jnp.asarray(exits * mask, jnp.int32),
                 loop_evals=jnp.int32(0), weights_version=jnp.int32(0), policy=POLICY,
                 loop=loop, temperature=1.0)
    adv = jnp.asarray(rng.standard_normal(B), jnp.float32)
    return ro, adv, f32(old), f32(learner)


@functools.cache
def step(kind, loss_cfg, micro_batches):
    cfg, _, loop = model(kind)
    return make_grpo_step(cfg, POLICY, loss_cfg, OPT, loop=loop, micro_batches=micro_batches)


@functools.cache
def update(kind, loss_cfg, micro_batches):
    """(new params, metrics as floats) of one step on `batch(kind)`."""
    _, params, _ = model(kind)
    ro, adv, old, learner = batch(kind)
    new, _, metrics = step(kind, loss_cfg, micro_batches)(
        jax.tree.map(jnp.copy, params), OPT.init(params), ro, adv, old, None, None, learner)
    return new, {k: float(v) for k, v in metrics.items()}


def loss_config(anchor, correction, aggregation):
    return LossConfig(epsilon=0.2, epsilon_high=0.28, aggregation=aggregation,
                      correction=correction, correction_cap=1.3, ratio_anchor=anchor)


# ---------------------------------------------------------------- the loss is the hand computation
# By default the two cases whose m=1 runs the default split tests compare against: each
# anchor and each correction once; more under `slow`.
DEFAULT_CASES = (("dense", "learner", "mis", "seq_mean_token_mean"),
                 ("looped", "sampler", "tis", "seq_mean_token_sum_norm"))
HAND_CASES = [*DEFAULT_CASES,
              *(pytest.param(*c, marks=pytest.mark.slow) for c in (
                  ("dense", "sampler", "none", "token_mean"),
                  ("dense", "sampler", "tis", "seq_mean_token_mean"),
                  ("looped", "learner", "tis", "seq_mean_token_sum_norm"),
                  ("looped", "sampler", "none", "token_mean"),
                  ("looped", "learner", "seq_mis", "seq_mean_token_mean"),
                  ("dense", "learner", "seq_tis", "token_mean")))]


@pytest.mark.parametrize("kind,anchor,correction,aggregation", HAND_CASES)
def test_step_loss_and_metrics_equal_the_hand_computation(kind, anchor, correction, aggregation):
    cfg = loss_config(anchor, correction, aggregation)
    ro, adv, old, learner = batch(kind)
    assert float(jnp.max(jnp.abs(old - ro.logprobs))) > 0.1  # O != S, and L != O
    assert float(jnp.max(jnp.abs(learner - old))) > 0.1
    want = grpo_loss_reference(learner, old, ro.logprobs, adv, ro.completion_mask, cfg)
    swapped = dataclasses.replace(cfg, ratio_anchor="sampler" if anchor == "learner" else "learner")
    other = grpo_loss_reference(learner, old, ro.logprobs, adv, ro.completion_mask, swapped)
    assert abs(other["loss"] - want["loss"]) > 1e-3  # the case tells the anchors apart
    assert want["frac_masked"] > 0 if correction.endswith("mis") else want["frac_masked"] == 0
    assert want["frac_truncated"] > 0 if correction.endswith("tis") else want["frac_truncated"] == 0
    _, got = update(kind, cfg, 1)
    assert got["skipped"] == 0.0 and got["grad_norm"] > 0.0
    # f32 sums of ~30 O(1) terms against f64.
    for name in ("loss", "pg_loss", "ratio_mean", "clip_frac_low", "clip_frac_high",
                 "is_weight_mean", "frac_truncated", "frac_masked", "mismatch_k1", "mismatch_k3",
                 "mismatch_max_abs_dlogp", "mismatch_prob_err"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# The step's update against the hand gradient pulled back, per parameter leaf: max |difference|
# over the leaf's largest entry. Measured on XLA:CPU: 1.6e-7 (f32 loss arithmetic against f64).
GRAD_TOL = 6e-7


# In the default suite (one more compilation, 6-11 s on 2 cores): the loss tests above see the
# step's value and metrics, not its gradient; test_loss checks d loss / d L by hand.
def test_step_gradient_is_the_hand_gradient_through_the_dense_log_probs():
    """d loss / d params = (d loss / d L) . (d L_dense / d params): the hand gradient in the
    log-probs, with MIS weights and the sequence-mean denominators in it, pulled back through
    the dense (packed) forward."""
    cfg = loss_config("learner", "mis", "seq_mean_token_mean")
    model_cfg, params, loop = model("dense")
    ro, adv, old, learner = batch("dense")
    want = grpo_loss_reference(learner, old, ro.logprobs, adv, ro.completion_mask, cfg)

    rows = packed_rows_of(ro)  # the step's packed forward, so only the loss's rounding differs

    @jax.jit
    def pullback(params, cotangent):
        logp = lambda p: learner_logprobs(p, model_cfg, POLICY, ro, "dense", loop=loop,
                                          packed_rows=rows)[0]
        return jax.vjp(logp, params)[1](cotangent)[0]

    expected = pullback(params, jnp.asarray(want["grad"], jnp.float32))
    new, _ = update("dense", cfg, 1)
    worst = 0.0  # max |step - hand| over a leaf, relative to the leaf's largest entry
    for g, p, p_new in zip(jax.tree.leaves(expected), jax.tree.leaves(params),
                           jax.tree.leaves(new), strict=True):
        g, p, p_new = (np.asarray(x, np.float64) for x in (g, p, p_new))
        assert np.abs(g).max() > 0
        # The update `p - g` is rounded to the parameter's f32 spacing (a norm scale of 1 holds
        # g to 1.2e-7), which is taken off before comparing.
        off = np.maximum(np.abs(p - p_new - g) - np.spacing(np.abs(p_new).astype(np.float32)), 0)
        worst = max(worst, float(off.max() / np.abs(g).max()))
    print(f"step gradient vs hand gradient: max relative (to the leaf) difference {worst:.2g}")
    assert worst < GRAD_TOL


# ---------------------------------------------------------------- the update does not depend on the split
# Split against whole, measured on XLA:CPU over the 24 cells below: metrics differ by at most
# 2.8e-6 relative (those that are 0 are 0 in both), parameters (entries up to ~2 after the SGD
# step) by at most 2.4e-7 absolute. The tolerances are ~4x those.
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-7
PARAM_ATOL = 1e-6


def _split_cases():
    """(kind, anchor, correction, aggregation, micro_batches): the default cases at m=4 (dense)
    and m=2 (looped), the product of models, corrections, aggregations and m under `slow`."""
    default = {(*DEFAULT_CASES[0], 4), (*DEFAULT_CASES[1], 2)}
    yield from sorted(default)
    for kind in ("dense", "looped"):
        for correction in ("mis", "tis"):
            for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
                for m in (2, 4):
                    case = (kind, "learner", correction, aggregation, m)
                    if case not in default:
                        yield pytest.param(*case, marks=pytest.mark.slow)


@pytest.mark.parametrize("kind,anchor,correction,aggregation,micro_batches", list(_split_cases()))
def test_step_is_micro_batch_split_invariant(kind, anchor, correction, aggregation,
                                             micro_batches):
    cfg = loss_config(anchor, correction, aggregation)
    whole_params, whole = update(kind, cfg, 1)
    split_params, split = update(kind, cfg, micro_batches)
    if correction == "mis":  # the case drops tokens, so the minibatch-wide counts matter
        assert whole["frac_masked"] > 0
    assert set(split) == set(whole)
    print(f"m={micro_batches} vs m=1: metrics max relative difference", max(
        abs(split[k] - v) / abs(v) for k, v in whole.items() if v != 0))
    for name, value in whole.items():
        np.testing.assert_allclose(split[name], value, rtol=METRIC_RTOL, atol=METRIC_ATOL,
                                   err_msg=name)
    _, params, _ = model(kind)
    moved = worst = 0.0
    for a, b, p in zip(jax.tree.leaves(split_params), jax.tree.leaves(whole_params),
                       jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=PARAM_ATOL)
        moved = max(moved, float(np.max(np.abs(np.asarray(b) - np.asarray(p)))))
        worst = max(worst, float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
    print(f"m={micro_batches} vs m=1: parameters max absolute difference {worst:.2g}")
    assert moved > 1e-4  # a real update

