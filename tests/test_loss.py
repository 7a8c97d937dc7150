"""Tests of the policy loss, its aggregation, mismatch corrections and metrics."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import grpo_loss_reference

from jaxrl_lp.rl.corrections import correction_weights
from jaxrl_lp.rl.loss import LossConfig, kl_penalty, loss_denominator, policy_loss, select_anchor
from jaxrl_lp.rl.metrics import mismatch_metrics

TOL = 1e-6  # f32 sums of a few dozen O(1) terms


@functools.partial(jax.jit, static_argnames="cfg")
def _loss_and_grad(logp, anchor, adv, mask, weights, denom, cfg, ref=None, num_tokens=None):
    """Jitted (loss_sum, metrics) and d loss_sum / d logp."""

    def f(lp):
        return policy_loss(lp, anchor, adv, mask, weights, denom, cfg, ref, num_tokens=num_tokens)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return loss, metrics, grad


@functools.partial(jax.jit, static_argnames=("cfg", "max_tokens"))
def _full(logp, anchor, adv, mask, cfg, ref=None, max_tokens=None):
    """Loss of a batch treated as one whole minibatch, with no correction."""
    denom = loss_denominator(mask, cfg, max_tokens)
    return _loss_and_grad(logp, anchor, adv, mask, jnp.ones_like(mask), denom, cfg, ref)


_corrections = jax.jit(correction_weights, static_argnames="cfg")
_denominator = jax.jit(loss_denominator, static_argnames=("cfg", "max_tokens"))


def _column(values):
    """Rows of one token each: [B] Python floats -> [B, 1] f32."""
    return jnp.array(values, jnp.float32)[:, None]


# --------------------------------------------------------------------------- #
# PPO clip, written out by hand.


def test_ppo_clip_hand_example():
    cfg = LossConfig(epsilon=0.2, epsilon_high=0.3, dual_clip=3.0)
    ratios = [1.5, 0.5, 0.5, 5.0, 1.1]
    adv = [1.0, 1.0, -1.0, -1.0, -1.0]
    # Per-token objective min(r A, clip(r, 0.8, 1.3) A), dual clip max(., 3 A) for A < 0:
    #   r=1.5, A=+1: min(1.5, 1.3)  = 1.3  (high clip, gradient 0)
    #   r=0.5, A=+1: min(0.5, 0.8)  = 0.5  (unclipped, d/dlogp = r A = 0.5)
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8 (low clip, gradient 0)
    #   r=5.0, A=-1: min(-5, -1.3) = -5, max(-5, -3) = -3 (dual clip, gradient 0)
    #   r=1.1, A=-1: min(-1.1, -1.1) = -1.1 (inside, d/dlogp = r A = -1.1)
    objectives = [1.3, 0.5, -0.8, -3.0, -1.1]
    expected_loss = -sum(objectives) / 5  # token_mean over 5 tokens
    expected_grad = [0.0, -0.5 / 5, 0.0, 0.0, 1.1 / 5]

    logp = _column([math.log(r) - 1.0 for r in ratios])
    anchor = _column([-1.0] * 5)
    mask = jnp.ones((5, 1), jnp.float32)
    loss, m, grad = _full(logp, anchor, jnp.array(adv), mask, cfg)
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad[:, 0]), expected_grad, rtol=1e-5, atol=1e-6)
    for name in ("clip_frac_low", "clip_frac_high", "clip_frac_dual"):
        np.testing.assert_allclose(float(m[name]), 1 / 5, rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_mean"]), sum(ratios) / 5, rtol=1e-6)

    # Without dual clip the r=5, A=-1 token contributes -5 (unbounded).
    cfg_nodual = LossConfig(epsilon=0.2, epsilon_high=0.3)
    loss, m, _ = _full(logp, anchor, jnp.array(adv), mask, cfg_nodual)
    np.testing.assert_allclose(float(loss), -(1.3 + 0.5 - 0.8 - 5.0 - 1.1) / 5, rtol=1e-6)
    assert float(m["clip_frac_dual"]) == 0.0

    # Symmetric epsilon: the r=1.5 token clips at 1.2.
    loss, _, _ = _full(logp, anchor, jnp.array(adv), mask, LossConfig(epsilon=0.2))
    np.testing.assert_allclose(float(loss), -(1.2 + 0.5 - 0.8 - 5.0 - 1.1) / 5, rtol=1e-6)


def test_per_token_advantages():
    """Advantages [B, N] (multi-turn turn credit): each token's objective takes its own; a row
    of equal ones is the per-sequence advantage bit for bit."""
    logp, anchor, adv, mask = _batch(4, spread=0.2)
    cfg = LossConfig(epsilon=0.2)
    per_token = adv[:, None] * jnp.linspace(-1.0, 2.0, mask.shape[1])[None]
    loss, _, grad = _full(logp, anchor, per_token, mask, cfg)
    want = _per_token_loss_np(logp, anchor, per_token, mask).sum() / float(mask.sum())
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    row_loss, row_m, row_grad = _full(logp, anchor, adv, mask, cfg)
    wide_loss, wide_m, wide_grad = _full(logp, anchor, jnp.broadcast_to(adv[:, None], mask.shape),
                                         mask, cfg)
    assert float(wide_loss) == float(row_loss) and float(loss) != float(row_loss)
    np.testing.assert_array_equal(np.asarray(wide_grad), np.asarray(row_grad))
    assert {k: float(v) for k, v in wide_m.items()} == {k: float(v) for k, v in row_m.items()}


# --------------------------------------------------------------------------- #
# Aggregation.


def _batch(seed, num_rows=8, num_cols=6, spread=0.3):
    """Random log-probs, anchors, advantages and a ragged mask (row 3 empty), f32."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (num_rows, num_cols))
    anchor = logp + spread * rng.standard_normal(logp.shape)
    adv = rng.standard_normal(num_rows)
    lengths = rng.integers(1, num_cols + 1, num_rows)
    lengths[3] = 0
    mask = (np.arange(num_cols)[None, :] < lengths[:, None]).astype(np.float32)
    # Padding holds garbage that must not reach the loss or its gradient.
    logp = np.where(mask > 0, logp, -np.inf)
    anchor = np.where(mask > 0, anchor, np.nan)
    return tuple(jnp.asarray(x, jnp.float32) for x in (logp, anchor, adv, mask))


def _per_token_loss_np(logp, anchor, adv, mask, eps=0.2):
    """numpy reference of -min(r A, clip(r) A) per token (0 on padding)."""
    logp, anchor, mask = (np.asarray(x, np.float64) for x in (logp, anchor, mask))
    live = mask > 0
    r = np.exp(np.where(live, logp - np.where(live, anchor, 0), 0))
    a = np.asarray(adv, np.float64)
    a = a[:, None] if a.ndim == 1 else a  # per sequence or per token
    return np.where(live, -np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a), 0.0)


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_aggregation_against_hand_formula(aggregation):
    logp, anchor, adv, mask = _batch(0)
    cfg = LossConfig(aggregation=aggregation)
    loss, _, grad = _full(logp, anchor, adv, mask, cfg, max_tokens=10)
    l_BxN = _per_token_loss_np(logp, anchor, adv, mask)
    m = np.asarray(mask)
    nonempty = m.sum(1) > 0
    if aggregation == "token_mean":
        expected = l_BxN.sum() / m.sum()
    elif aggregation == "seq_mean_token_mean":
        expected = np.mean(l_BxN.sum(1)[nonempty] / m.sum(1)[nonempty])
    else:  # Dr. GRPO: per-sequence sums over a constant, mean over sequences
        expected = np.mean(l_BxN.sum(1)[nonempty] / 10.0)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=TOL)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[m == 0] == 0.0)


def test_sum_norm_defaults_to_padded_length():
    mask = jnp.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], jnp.float32)
    cfg = LossConfig(aggregation="seq_mean_token_sum_norm")
    # Two non-empty sequences, max_tokens defaults to N = 4.
    np.testing.assert_array_equal(np.asarray(_denominator(mask, cfg)), [8.0, 8.0, 8.0])
    cfg = LossConfig(aggregation="seq_mean_token_mean")
    np.testing.assert_array_equal(np.asarray(_denominator(mask, cfg)), [4.0, 2.0, 2.0])


# --------------------------------------------------------------------------- #
# Micro-batch split invariance.


@functools.partial(jax.jit, static_argnames=("cfg", "splits"))
def _minibatch_steps(logp, old, sampler, adv, mask, ref, cfg, splits):
    """The train step's use of the API: corrections once, then each row split.

    For each entry `k` of `splits`, the rows are cut into `k` consecutive
    micro-batches that `lax.map` evaluates one after another (each call sees
    only its own rows); losses, metrics and gradients are summed / stitched
    back. Returns one (loss, metrics, grad_BxN) per split, and the keep mask.
    """
    weights, keep, _ = correction_weights(old, sampler, mask, cfg)
    denom = loss_denominator(keep, cfg, max_tokens=8)
    num_tokens = jnp.sum(keep)
    anchor = select_anchor(old, sampler, cfg)
    per_row = (logp, anchor, adv, keep, weights, denom, ref)
    results = []
    for k in splits:
        micro = jax.tree.map(lambda x, k=k: x.reshape(k, x.shape[0] // k, *x.shape[1:]), per_row)

        def one(mb):
            lp, an, a, kp, w, d, rf = mb
            return _loss_and_grad(lp, an, a, kp, w, d, cfg, rf, num_tokens)

        loss_k, metrics_k, grad_k = jax.vmap(one)(micro)
        results.append(
            (
                jnp.sum(loss_k),
                jax.tree.map(lambda v: jnp.sum(v, 0), metrics_k),
                grad_k.reshape(logp.shape),
            )
        )
    return results, keep


# Every aggregation with token MIS; GSPO with sequence MIS and TIS; token TIS.
SPLIT_CASES = [
    ("token_mean", "mis", "token"),
    ("seq_mean_token_mean", "mis", "token"),
    ("seq_mean_token_sum_norm", "mis", "token"),
    ("seq_mean_token_mean", "seq_mis", "sequence"),
    ("seq_mean_token_sum_norm", "seq_tis", "sequence"),
    ("token_mean", "tis", "token"),
]


@pytest.mark.parametrize("aggregation,correction,ratio_level", SPLIT_CASES)
def test_micro_batch_split_invariance(aggregation, correction, ratio_level):
    logp, anchor, adv, mask = _batch(1, spread=0.2)
    noise = np.random.default_rng(2).standard_normal(anchor.shape).astype(np.float32)
    sampler = anchor + 0.5 * noise  # mismatch: MIS drops some tokens
    ref = anchor - 0.1
    cfg = LossConfig(
        epsilon_high=0.28,
        dual_clip=3.0,
        aggregation=aggregation,
        ratio_level=ratio_level,
        kl_beta=0.05,
        correction=correction,
        correction_cap=1.5,
        ratio_anchor="learner",
    )
    (full, *splits), keep = _minibatch_steps(logp, anchor, sampler, adv, mask, ref, cfg, (1, 2, 4))
    if correction in ("mis", "seq_mis"):
        assert 0 < float(jnp.sum(keep)) < float(jnp.sum(mask))  # the case drops something
    for split in splits:
        np.testing.assert_allclose(float(split[0]), float(full[0]), rtol=TOL, atol=TOL)
        np.testing.assert_allclose(np.asarray(split[2]), np.asarray(full[2]), rtol=TOL, atol=TOL)
        for k in full[1]:
            np.testing.assert_allclose(float(split[1][k]), float(full[1][k]), rtol=TOL, atol=TOL)
    assert np.all(np.isfinite(np.asarray(full[2])))


# --------------------------------------------------------------------------- #
# Mismatch corrections.


def test_mis_drops_tokens_from_loss_and_denominator():
    cfg = LossConfig(correction="mis", correction_cap=2.0)
    # One row of 4 real tokens and one pad; token 2 has rho = 3 > C, token 3 rho = 1/3 < 1/C.
    rho = [1.0, 1.5, 3.0, 1 / 3, 1.0]
    mask = jnp.array([[1, 1, 1, 1, 0]], jnp.float32)
    sampler = jnp.full((1, 5), -1.0)
    old = sampler + jnp.log(jnp.array([rho]))
    weights, keep, m = _corrections(old, sampler, mask, cfg)
    np.testing.assert_array_equal(np.asarray(keep), [[1, 1, 0, 0, 0]])
    np.testing.assert_allclose(np.asarray(weights), [[1.0, 1.5, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(float(m["frac_masked"]), 0.5, rtol=1e-6)
    denom = _denominator(keep, cfg)
    np.testing.assert_allclose(np.asarray(denom), [2.0])  # 2 kept tokens, not 4
    # Ratio 1 (logp == anchor), A = 1: per-token objective w * 1, mean over 2 kept tokens.
    loss, _, _ = _loss_and_grad(old, old, jnp.ones(1), keep, weights, denom, cfg)
    np.testing.assert_allclose(float(loss), -(1.0 + 1.5) / 2, rtol=1e-6)


def test_tis_caps_weights():
    cfg = LossConfig(correction="tis", correction_cap=2.0)
    sampler = jnp.full((1, 5), -2.0)
    old = sampler + jnp.log(jnp.array([[0.5, 1.5, 3.0, 10.0, 1.0]]))
    mask = jnp.array([[1, 1, 1, 1, 0]], jnp.float32)
    weights, keep, m = _corrections(old, sampler, mask, cfg)
    np.testing.assert_allclose(np.asarray(weights), [[0.5, 1.5, 2.0, 2.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(mask))
    np.testing.assert_allclose(float(m["frac_truncated"]), 0.5, rtol=1e-6)
    assert float(m["frac_masked"]) == 0.0


def test_sequence_level_corrections():
    sampler = jnp.full((2, 3), -1.0)
    # Row 0: token ratios 4 and 1 -> geometric mean 2; its pad holds a wild value.
    # Row 1: token ratios 2 and 1/2 -> geometric mean 1.
    log_rho = jnp.log(jnp.array([[4.0, 1.0, 1e6], [2.0, 0.5, 1.0]]))
    old = sampler + log_rho
    mask = jnp.array([[1, 1, 0], [1, 1, 0]], jnp.float32)

    cfg = LossConfig(correction="seq_tis", correction_cap=1.5)
    weights, keep, m = _corrections(old, sampler, mask, cfg)
    np.testing.assert_allclose(np.asarray(weights), [[1.5, 1.5, 0], [1.0, 1.0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(mask))
    np.testing.assert_allclose(float(m["frac_truncated"]), 0.5, rtol=1e-6)

    cfg = LossConfig(correction="seq_mis", correction_cap=1.5, aggregation="seq_mean_token_mean")
    weights, keep, m = _corrections(old, sampler, mask, cfg)
    np.testing.assert_array_equal(np.asarray(keep), [[0, 0, 0], [1, 1, 0]])
    np.testing.assert_allclose(np.asarray(weights), [[0, 0, 0], [1.0, 1.0, 0]], rtol=1e-6)
    np.testing.assert_allclose(float(m["frac_masked"]), 0.5, rtol=1e-6)
    # The dropped sequence no longer counts: S = 1, len = 2.
    np.testing.assert_allclose(np.asarray(_denominator(keep, cfg)), [1.0, 2.0])


def test_mismatch_metrics_hand_values():
    learner = jnp.array([[-1.0, -2.0, -jnp.inf]])
    sampler = jnp.array([[-1.5, -1.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    m = jax.jit(mismatch_metrics)(learner, sampler, mask)
    # d = learner - sampler = [0.5, -1.0]
    np.testing.assert_allclose(float(m["mismatch_k1"]), (-0.5 + 1.0) / 2, rtol=1e-6)
    k3 = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-1.0) - 1 + 1.0)) / 2
    np.testing.assert_allclose(float(m["mismatch_k3"]), k3, rtol=1e-6)
    np.testing.assert_allclose(float(m["mismatch_max_abs_dlogp"]), 1.0, rtol=1e-6)
    prob_err = (math.exp(0.5) + math.exp(1.0)) / 2
    np.testing.assert_allclose(float(m["mismatch_prob_err"]), prob_err, rtol=1e-6)
    # correction_weights reports the same metrics.
    _, _, cm = _corrections(learner, sampler, mask, LossConfig(correction="tis"))
    np.testing.assert_allclose(float(cm["mismatch_k3"]), k3, rtol=1e-6)


# --------------------------------------------------------------------------- #
# The ratio's anchor and the corrections with sampler != learner log-probs.


def _three_logprobs(seed=11, num_rows=6, num_cols=5):
    """Distinct learner (current), learner-old and sampler log-probs, advantages, a ragged mask.

    Rows of 5, 3, 1, 0, 4 and 5 tokens. The sampler is off the old learner by ~0.45 nats and
    the current learner off the old by ~0.25, so MIS drops, TIS truncates and PPO clips some
    tokens whichever anchor is used. Padding holds garbage.
    """
    rng = np.random.default_rng(seed)
    sampler = -rng.uniform(0.5, 3.0, (num_rows, num_cols))
    old = sampler + 0.45 * rng.standard_normal(sampler.shape)
    learner = old + 0.25 * rng.standard_normal(sampler.shape)
    adv = rng.standard_normal(num_rows)
    mask = (np.arange(num_cols)[None] < np.array([5, 3, 1, 0, 4, 5])[:, None]).astype(np.float32)
    learner, old = np.where(mask > 0, learner, -np.inf), np.where(mask > 0, old, np.nan)
    return tuple(jnp.asarray(x, jnp.float32) for x in (learner, old, sampler, adv, mask))


@functools.partial(jax.jit, static_argnames="cfg")
def _step_loss(learner, old, sampler, adv, mask, cfg):
    """What `make_grpo_step` does with one micro-batch: corrections, anchor, denominators, loss."""
    weights, keep, cmetrics = correction_weights(old, sampler, mask, cfg)
    anchor = select_anchor(old, sampler, cfg)
    denom = loss_denominator(keep, cfg)
    loss, metrics, grad = _loss_and_grad(learner, anchor, adv, keep, weights, denom, cfg)
    return loss, {**metrics, **cmetrics}, grad, keep


ANCHOR_CASES = [  # every anchor with every correction; the aggregations take turns
    ("sampler", "none", "token_mean"), ("learner", "none", "seq_mean_token_mean"),
    ("sampler", "tis", "seq_mean_token_sum_norm"), ("learner", "tis", "token_mean"),
    ("sampler", "mis", "seq_mean_token_mean"), ("learner", "mis", "seq_mean_token_sum_norm"),
    ("sampler", "seq_tis", "token_mean"), ("learner", "seq_tis", "seq_mean_token_mean"),
    ("sampler", "seq_mis", "seq_mean_token_sum_norm"), ("learner", "seq_mis", "token_mean"),
]


@pytest.mark.parametrize("anchor,correction,aggregation", ANCHOR_CASES)
def test_ratio_anchor_and_correction_against_numpy(anchor, correction, aggregation):
    learner, old, sampler, adv, mask = _three_logprobs()
    cfg = LossConfig(epsilon=0.2, epsilon_high=0.28, aggregation=aggregation,
                     correction=correction, correction_cap=1.3, ratio_anchor=anchor)
    loss, metrics, grad, keep = _step_loss(learner, old, sampler, adv, mask, cfg)
    want = grpo_loss_reference(learner, old, sampler, adv, mask, cfg)
    # The case can tell the anchors apart, and the correction's direction (old / sampler).
    other = dataclasses.replace(cfg, ratio_anchor={"sampler": "learner", "learner": "sampler"}[anchor])
    assert abs(grpo_loss_reference(learner, old, sampler, adv, mask, other)["loss"]
               - want["loss"]) > 1e-3
    if correction != "none":
        assert abs(grpo_loss_reference(learner, sampler, old, adv, mask, cfg)["loss"]
                   - want["loss"]) > 1e-3
    if correction.endswith("mis"):
        assert 0 < want["keep"].sum() < float(mask.sum())  # something is dropped
    if correction.endswith("tis"):
        assert want["frac_truncated"] > 0
    assert want["clip_frac_low"] + want["clip_frac_high"] > 0

    np.testing.assert_array_equal(np.asarray(keep), want["keep"])
    # f32 against f64: sums of ~20 O(1) terms.
    np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-5, atol=TOL)
    np.testing.assert_allclose(np.asarray(grad), want["grad"], rtol=1e-5, atol=TOL)
    for name, value in want.items():
        if name not in ("loss", "grad", "keep"):
            np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, atol=TOL,
                                       err_msg=name)


def test_select_anchor_picks_by_name_and_needs_the_learners():
    old, sampler = jnp.full((1, 2), -1.0), jnp.full((1, 2), -2.0)
    assert select_anchor(old, sampler, LossConfig(ratio_anchor="sampler")) is sampler
    assert select_anchor(old, sampler, LossConfig(ratio_anchor="learner")) is old
    with pytest.raises(ValueError, match="ratio_anchor='learner' needs learner_old_logp"):
        select_anchor(None, sampler, LossConfig(ratio_anchor="learner"))


# --------------------------------------------------------------------------- #
# GSPO, KL, policy gradient at ratio 1.


def test_gspo_ratio_is_exp_mean_log_ratio():
    logp, anchor, adv, mask = _batch(3, spread=0.05)
    cfg = LossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean", epsilon=0.1)
    loss, m, grad = _full(logp, anchor, adv, mask, cfg)

    m_np = np.asarray(mask)
    lr = np.where(m_np > 0, np.asarray(logp, np.float64) - np.where(m_np > 0, anchor, 0), 0)
    lengths = m_np.sum(1)
    live = lengths > 0
    s = np.exp(lr.sum(1)[live] / lengths[live])
    # Every token of sequence i carries ratio s_i: the token mean weights s_i by length.
    ratio_mean = (s * lengths[live]).sum() / m_np.sum()
    np.testing.assert_allclose(float(m["ratio_mean"]), ratio_mean, rtol=1e-5)

    # Value and gradient equal GSPO written directly on the sequence ratio.
    def gspo(lp):
        lp = jnp.where(mask > 0, lp, 0.0)
        len_B = jnp.maximum(mask.sum(1), 1.0)
        s_B = jnp.exp(jnp.sum((lp - jnp.where(mask > 0, anchor, 0.0)) * mask, 1) / len_B)
        obj_B = jnp.minimum(s_B * adv, jnp.clip(s_B, 0.9, 1.1) * adv)
        return -jnp.sum(jnp.where(mask.sum(1) > 0, obj_B, 0.0)) / jnp.sum(mask.sum(1) > 0)

    ref_loss, ref_grad = jax.jit(jax.value_and_grad(gspo))(logp)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6, atol=TOL)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-5, atol=TOL)


def test_kl_estimators_hand_values():
    logp, ref = jnp.array([[-1.0]]), jnp.array([[-1.5]])
    x = -0.5  # log pi_ref - log pi_theta
    expected = {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}
    kl = jax.jit(kl_penalty, static_argnames="estimator")
    for est, value in expected.items():
        np.testing.assert_allclose(float(kl(logp, ref, estimator=est)[0, 0]), value, rtol=1e-6)
    # Through the loss: A = 0, so the loss is beta * kl (one token).
    cfg = LossConfig(kl_beta=0.1, kl_estimator="k3")
    loss, m, grad = _full(logp, logp, jnp.zeros(1), jnp.ones((1, 1)), cfg, ref)
    np.testing.assert_allclose(float(loss), 0.1 * expected["k3"], rtol=1e-6)
    np.testing.assert_allclose(float(m["kl_ref"]), expected["k3"], rtol=1e-6)
    np.testing.assert_allclose(float(m["kl_loss"]), 0.1 * expected["k3"], rtol=1e-6)
    # d k3 / d logp = 1 - exp(x) (x = ref - logp).
    np.testing.assert_allclose(float(grad[0, 0]), 0.1 * (1 - math.exp(x)), rtol=1e-6)


def test_k3_keeps_its_digits_near_the_reference():
    """Near the reference k3 is about x^2 / 2; f32 exp(x) - 1 - x gets it wrong by its own
    size there (f32 resolves 1e-7 at 1), expm1(x) - x to about ulp(x) / k3."""
    x = np.array([1e-4, -3e-4, 1e-3, -2e-5], np.float64)
    logp = jnp.zeros((1, 4), jnp.float32)
    ref = jnp.asarray(x[None], jnp.float32)
    exact = np.expm1(np.asarray(ref, np.float64)) - np.asarray(ref, np.float64)  # the f32 x's
    got = np.asarray(kl_penalty(logp, ref, "k3"), np.float64)
    np.testing.assert_allclose(got, exact, rtol=2e-2)
    naive = np.asarray(jnp.exp(ref) - 1.0 - ref, np.float64)
    assert np.max(np.abs(naive - exact) / exact) > 0.1  # what the naive form gives


def test_kl_beta_zero_accepts_no_reference():
    logp, anchor, adv, mask = _batch(4)
    loss, m, _ = _full(logp, anchor, adv, mask, LossConfig(kl_beta=0.0), None)
    assert np.isfinite(float(loss)) and "kl_ref" not in m
    with pytest.raises(ValueError, match="ref_logp"):
        _full(logp, anchor, adv, mask, LossConfig(kl_beta=0.1), None)


@pytest.mark.parametrize(
    "ratio_level,aggregation", [("token", "token_mean"), ("sequence", "seq_mean_token_mean")]
)
def test_ratio_one_gives_policy_gradient(ratio_level, aggregation):
    logp, _, adv, mask = _batch(5)
    cfg = LossConfig(ratio_level=ratio_level, aggregation=aggregation, dual_clip=2.0)
    denom = _denominator(mask, cfg)
    u = np.random.default_rng(6).uniform(size=mask.shape).astype(np.float32)
    weights = jnp.where(mask > 0, 0.5 + u, 0.0)
    loss, m, grad = _loss_and_grad(logp, logp, adv, mask, weights, denom, cfg)
    # grad_logp of -sum w A r / denom at r = 1 is -w A / denom: the policy gradient.
    expected = -weights * adv[:, None] * mask / denom[:, None]
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-6, atol=TOL)
    np.testing.assert_allclose(float(loss), float(jnp.sum(expected)), rtol=1e-5, atol=TOL)
    for name in ("clip_frac_low", "clip_frac_high", "clip_frac_dual"):
        assert float(m[name]) == 0.0
    np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, rtol=1e-6)


# --------------------------------------------------------------------------- #
# Dtypes, recompiles, configs.


def test_low_precision_inputs_give_f32_and_no_recompile():
    logp, anchor, adv, mask = _batch(7)
    cfg = LossConfig()
    denom = loss_denominator(mask, cfg)
    fn = jax.jit(policy_loss, static_argnames="cfg")
    args = (logp.astype(jnp.bfloat16), anchor.astype(jnp.bfloat16), adv, mask, mask, denom)
    loss, m = fn(*args, cfg=cfg)
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in m.values())
    fn(args[0] - 0.01, *args[1:], cfg=cfg)
    assert fn._cache_size() == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("epsilon", 0.0),
        ("epsilon", 1.5),
        ("epsilon_high", -0.1),
        ("dual_clip", 1.0),
        ("aggregation", "seq_mean"),
        ("ratio_level", "segment"),
        ("kl_beta", -1.0),
        ("kl_estimator", "k4"),
        ("correction", "icepop"),
        ("correction_cap", 1.0),
        ("ratio_anchor", "reference"),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
        LossConfig(**{field: value})
