"""The GRPO-family policy loss: PPO-clip, GSPO, KL to a reference, aggregation.

Shapes: `B` sequences, `N` completion tokens; `mask_BxN` f32, 1 on the tokens
that enter the loss. All maths is f32; log-ratios are clipped to
`[-LOG_RATIO_CLIP, LOG_RATIO_CLIP]` before `exp`.

One minibatch step, split into micro-batches for gradient accumulation, is

    weights_BxN, keep_BxN, m = correction_weights(old_BxN, sampler_BxN, mask_BxN, cfg)
    denom_B = loss_denominator(keep_BxN, cfg, max_tokens)      # whole minibatch
    num_tokens = keep_BxN.sum()                                  # whole minibatch
    anchor_BxN = select_anchor(old_BxN, sampler_BxN, cfg)
    for rows in micro_batches:                                   # any split of rows
        (loss, m), g = value_and_grad(policy_loss, has_aux=True)(
            logp_BxN[rows], anchor_BxN[rows], adv_B[rows], keep_BxN[rows],
            weights_BxN[rows], denom_B[rows], cfg, ref_BxN[rows],
            num_tokens=num_tokens)
        total_loss += loss; total_grad += g; total_metrics += m

and `total_loss`, `total_grad` and `total_metrics` do not depend on the split:
every minibatch-wide quantity (token and sequence counts) is folded into the
per-row `denom_B` and the scalar `num_tokens` before the split, and everything
`policy_loss` computes from its inputs is per row.

The loss is `L = sum_i sum_t keep_it * l_it / denom_i` with the per-token loss

    l_it = -w_it * min(r_it A_i, clip(r_it, 1 - eps_lo, 1 + eps_hi) A_i)
           [ for A_i < 0 and dual clip c: -w_it * max(min(...), c A_i) ]
           + beta * kl_it

where `r_it` is the PPO ratio (token or GSPO sequence level), `w_it` the
training-inference correction weight (`corrections.py`) and `kl_it` a KL
estimate to the reference policy. The correction weight multiplies the policy
gradient term only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_lp.rl.metrics import LOG_RATIO_CLIP

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "RATIO_ANCHORS",
    "RATIO_LEVELS",
    "LossConfig",
    "kl_penalty",
    "loss_denominator",
    "policy_loss",
    "select_anchor",
]

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
RatioLevel = Literal["token", "sequence"]
KlEstimator = Literal["k1", "k2", "k3"]
Correction = Literal["none", "tis", "mis", "seq_tis", "seq_mis"]
RatioAnchor = Literal["sampler", "learner"]

AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "seq_tis", "seq_mis")
RATIO_ANCHORS: tuple[str, ...] = ("sampler", "learner")


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the policy loss; hashable, so a static jit argument.

    Attributes:
      epsilon: PPO clip range below 1 (and above, unless `epsilon_high`), in (0, 1).
      epsilon_high: clip-higher (DAPO): the range above 1, > 0; None = epsilon.
      dual_clip: `c > 1`; for negative advantages the objective is bounded
        below by `c * A` (Ye et al., 2020). None disables it.
      aggregation: how per-token losses are averaged (`loss_denominator`):
        `token_mean` (over all tokens of the minibatch), `seq_mean_token_mean`
        (over tokens of each sequence, then over sequences) or
        `seq_mean_token_sum_norm` (Dr. GRPO: per-sequence token sums divided by
        a constant `max_tokens`, then averaged over sequences).
      ratio_level: `token` (PPO/GRPO) or `sequence` (GSPO, see `policy_loss`).
      kl_beta: weight of the KL-to-reference term, >= 0; 0 disables it and the
        reference log-probs are not needed.
      kl_estimator: `k1`, `k2` or `k3` (see `kl_penalty`).
      reference: the frozen KL reference of the training program (`kl_beta > 0`):
        '' for the GRPO phase's starting weights, or a Hugging Face checkpoint
        directory of the same architecture and vocabulary.
      correction: training-inference mismatch correction (`correction_weights`):
        `none`, `tis`, `mis`, `seq_tis`, `seq_mis`.
      correction_cap: `C > 1`, the cap of TIS and the band `[1/C, C]` of MIS.
      ratio_anchor: the PPO ratio's denominator: `sampler` (the log-probs the
        sampler recorded) or `learner` (recomputed by the learner at the
        behaviour weights). With `sampler` the ratio already carries
        `pi_learner_old / pi_sampler`, so `tis`/`mis` would count the mismatch
        twice; the usual pairing is `learner` with a correction.
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    dual_clip: float | None = None
    aggregation: Aggregation = "token_mean"
    ratio_level: RatioLevel = "token"
    kl_beta: float = 0.0
    kl_estimator: KlEstimator = "k3"
    reference: str = ""
    correction: Correction = "none"
    correction_cap: float = 2.0
    ratio_anchor: RatioAnchor = "sampler"

    def __post_init__(self):
        if not (_is_number(self.epsilon) and 0 < self.epsilon < 1):
            raise ValueError(f"LossConfig.epsilon must be a number in (0, 1), got {self.epsilon!r}")
        if self.epsilon_high is not None and not (
            _is_number(self.epsilon_high) and self.epsilon_high > 0
        ):
            raise ValueError(
                f"LossConfig.epsilon_high must be None or a number > 0, got {self.epsilon_high!r}"
            )
        if self.dual_clip is not None and not (_is_number(self.dual_clip) and self.dual_clip > 1):
            raise ValueError(
                f"LossConfig.dual_clip must be None or a number > 1, got {self.dual_clip!r}"
            )
        for name, allowed in (
            ("aggregation", AGGREGATIONS),
            ("ratio_level", RATIO_LEVELS),
            ("kl_estimator", KL_ESTIMATORS),
            ("correction", CORRECTIONS),
            ("ratio_anchor", RATIO_ANCHORS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"LossConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        if not (_is_number(self.kl_beta) and self.kl_beta >= 0):
            raise ValueError(f"LossConfig.kl_beta must be a number >= 0, got {self.kl_beta!r}")
        if not isinstance(self.reference, str):
            raise ValueError(f"LossConfig.reference must be a checkpoint directory or '', got "
                             f"{self.reference!r}")
        if self.reference and self.kl_beta == 0:
            raise ValueError(f"LossConfig.reference={self.reference!r} is the KL reference and "
                             "kl_beta is 0, so it would be ignored; set kl_beta > 0 or drop it")
        if not (_is_number(self.correction_cap) and self.correction_cap > 1):
            raise ValueError(
                f"LossConfig.correction_cap must be a number > 1, got {self.correction_cap!r}"
            )

    @property
    def eps_low(self) -> float:
        return float(self.epsilon)

    @property
    def eps_high(self) -> float:
        return float(self.epsilon if self.epsilon_high is None else self.epsilon_high)


def select_anchor(
    learner_old_logp_BxN: jax.Array | None, sampler_logp_BxN: jax.Array, cfg: LossConfig
) -> jax.Array:
    """The PPO ratio's denominator log-probs chosen by `cfg.ratio_anchor`."""
    if cfg.ratio_anchor == "sampler":
        return sampler_logp_BxN
    if learner_old_logp_BxN is None:
        raise ValueError("LossConfig.ratio_anchor='learner' needs learner_old_logp_BxN")
    return learner_old_logp_BxN


def kl_penalty(logp_BxN: jax.Array, ref_logp_BxN: jax.Array, estimator: KlEstimator) -> jax.Array:
    """Per-token estimate of `KL(pi_theta || pi_ref)` from sampled tokens.

    With `x = log pi_ref - log pi_theta` per token (Schulman, 2020):
    `k1 = -x`, `k2 = x^2 / 2`, `k3 = exp(x) - 1 - x` (as `expm1(x) - x`; `x` clipped to
    `+-LOG_RATIO_CLIP` before `exp`). k1 is unbiased, k3 unbiased and >= 0,
    k2 biased but low-variance; its gradient is the true KL gradient
    on-policy.

    Args:
      logp_BxN: log-probs under the trained policy (with gradient).
      ref_logp_BxN: log-probs under the frozen reference (no gradient).
      estimator: `k1`, `k2` or `k3`.

    Returns:
      [B, N] f32 per-token estimates (unmasked).
    """
    # Upcast: the estimate is a difference of log-probs; compute it in f32.
    x_BxN = jax.lax.stop_gradient(ref_logp_BxN.astype(jnp.float32)) - logp_BxN.astype(
        jnp.float32
    )
    if estimator == "k1":
        return -x_BxN
    if estimator == "k2":
        return 0.5 * jnp.square(x_BxN)
    if estimator == "k3":
        x_BxN = jnp.clip(x_BxN, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        # expm1, not exp - 1: near the reference (|x| ~ 1e-4) exp(x) - 1 loses every digit of
        # the x^2 / 2 it should leave, to f32's 1e-7 at 1.
        return jnp.expm1(x_BxN) - x_BxN
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def loss_denominator(
    mask_BxN: jax.Array, cfg: LossConfig, max_tokens: int | None = None
) -> jax.Array:
    """Per-row loss denominators over a whole minibatch, for split-invariant sums.

    The minibatch loss is `sum_i sum_t mask_it l_it / denom_i`. With `T` the
    number of tokens in the minibatch, `len_i` the tokens of row `i` and `S`
    the number of sequences with at least one token (after MIS, a dropped
    sequence does not count):

    - `token_mean`:              `denom_i = T`
    - `seq_mean_token_mean`:     `denom_i = S * len_i`
    - `seq_mean_token_sum_norm`: `denom_i = S * max_tokens`

    `T` and `S` are clamped to >= 1 and `len_i` to >= 1 (an empty row adds 0
    to the loss whatever its denominator).

    Call this once on the minibatch's mask and slice `denom_B` by rows along
    with the other per-row inputs of `policy_loss`.

    Args:
      mask_BxN: f32 mask of the tokens in the loss, i.e. `keep_mask_BxN` from
        `correction_weights` (MIS-dropped tokens are removed from `T`,
        `len_i` and `S`).
      cfg: the loss config (its `aggregation`).
      max_tokens: Dr. GRPO's constant, the generation budget in tokens; None
        means `N`, the padded completion length.

    Returns:
      [B] f32 denominators. Jit-friendly with `cfg` and `max_tokens` static.
    """
    mask_BxN = mask_BxN.astype(jnp.float32)
    num_rows, num_cols = mask_BxN.shape
    len_B = jnp.sum(mask_BxN, axis=1)
    if cfg.aggregation == "token_mean":
        return jnp.full((num_rows,), jnp.maximum(jnp.sum(len_B), 1.0))
    num_seqs = jnp.maximum(jnp.sum((len_B > 0).astype(jnp.float32)), 1.0)
    if cfg.aggregation == "seq_mean_token_mean":
        return num_seqs * jnp.maximum(len_B, 1.0)
    max_tokens = num_cols if max_tokens is None else max_tokens
    if not max_tokens > 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens!r}")
    return jnp.full((num_rows,), num_seqs * float(max_tokens))


def policy_loss(
    logp_BxN: jax.Array,
    anchor_logp_BxN: jax.Array,
    advantages_B: jax.Array,
    mask_BxN: jax.Array,
    weights_BxN: jax.Array,
    denom_B: jax.Array,
    cfg: LossConfig,
    ref_logp_BxN: jax.Array | None = None,
    *,
    num_tokens: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's share of the minibatch loss, and additive metrics.

    Ratio. Token level: `r_it = exp(logp_it - anchor_it)`. Sequence level
    (GSPO, Zheng et al., 2025): `s_i = exp(mean_t (logp_it - anchor_it))`
    over the row's masked tokens, in the GSPO-token form

        r_it = sg(s_i) * exp(logp_it - sg(logp_it))

    whose value is `s_i` on every token (so clipping is decided per sequence)
    and whose gradient is `s_i * grad logp_it`. With `seq_mean_token_mean`
    aggregation this is exactly GSPO's objective and gradient,
    `-1/S sum_i min(s_i A_i, clip(s_i) A_i)`, since `grad s_i = s_i mean_t
    grad logp_it`; other aggregations weight GSPO's per-token terms
    differently (`token_mean` weights each sequence by its length). The
    GSPO paper's GSPO-token variant allows per-token advantages; with per-sequence
    ones it coincides with GSPO (per-token ones come from multi-turn episodes'
    turn credit, `rl.advantages.turn_advantages`).

    Then `l_it` as in the module docstring, and

        loss_sum = sum_{i, t} mask_it * l_it / denom_i

    Summing `loss_sum` (and its gradient) over any row split of a minibatch
    gives the minibatch loss, provided `denom_B` and `num_tokens` were computed
    on the whole minibatch.

    Jit with `cfg` static; everything else is an array (no recompiles when
    values change).

    Args:
      logp_BxN: the learner's log-probs of the sampled tokens (differentiated).
      anchor_logp_BxN: the ratio's denominator (`select_anchor`; no gradient).
      advantages_B: per-sequence advantages [B], or per-token ones [B, N] (no gradient).
      mask_BxN: f32 1 on tokens in the loss: `keep_mask_BxN` of
        `correction_weights` (no gradient).
      weights_BxN: correction weights of `correction_weights` (no gradient).
      denom_B: rows of `loss_denominator(keep_mask, ...)` of the minibatch.
      cfg: the loss config.
      ref_logp_BxN: the reference policy's log-probs; may be None when
        `cfg.kl_beta == 0`.
      num_tokens: tokens in the *minibatch* (`keep_mask_BxN.sum()`), used to
        normalise the metrics; None means this call is the whole minibatch.

    Returns:
      `(loss_sum, metrics)`: f32 scalars. Metrics are additive over
      micro-batches like the loss: `pg_loss` (the policy-gradient part of the
      loss), `clip_frac_low` (tokens with `A < 0` and `r < 1 - eps_lo`),
      `clip_frac_high` (`A > 0`, `r > 1 + eps_hi`), `clip_frac_dual` (`A < 0`,
      `r > c`), `ratio_mean` (token means over the minibatch), and with a
      reference `kl_loss` (the `beta`-scaled part of the loss) and `kl_ref`
      (the token mean of the estimate).
    """
    if cfg.kl_beta > 0 and ref_logp_BxN is None:
        raise ValueError("LossConfig.kl_beta > 0 needs ref_logp_BxN")
    sg = jax.lax.stop_gradient
    # Upcast: ratios, clipping and the loss are computed in f32.
    mask_BxN = sg(mask_BxN.astype(jnp.float32))
    live_BxN = mask_BxN > 0
    # Padding may hold anything (e.g. -inf); zero it so no nan reaches a gradient.
    logp_BxN = jnp.where(live_BxN, logp_BxN.astype(jnp.float32), 0.0)
    anchor_BxN = jnp.where(live_BxN, sg(anchor_logp_BxN.astype(jnp.float32)), 0.0)
    weights_BxN = jnp.where(live_BxN, sg(weights_BxN.astype(jnp.float32)), 0.0)
    adv = sg(advantages_B.astype(jnp.float32))  # per sequence [B] or per token [B, N]
    adv_BxN = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp_BxN.shape)
    denom_Bx1 = sg(denom_B.astype(jnp.float32))[:, None]
    if num_tokens is None:
        num_tokens = jnp.sum(mask_BxN)
    num_tokens = jnp.maximum(sg(jnp.asarray(num_tokens, jnp.float32)), 1.0)

    log_ratio_BxN = logp_BxN - anchor_BxN
    if cfg.ratio_level == "token":
        log_r_BxN = jnp.clip(log_ratio_BxN, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    else:
        len_Bx1 = jnp.maximum(jnp.sum(mask_BxN, axis=1, keepdims=True), 1.0)
        seq_log_r_Bx1 = jnp.sum(log_ratio_BxN * mask_BxN, axis=1, keepdims=True) / len_Bx1
        seq_log_r_Bx1 = jnp.clip(seq_log_r_Bx1, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        log_r_BxN = sg(seq_log_r_Bx1) + (logp_BxN - sg(logp_BxN))
    ratio_BxN = jnp.exp(log_r_BxN)

    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    objective_BxN = jnp.minimum(ratio_BxN * adv_BxN, jnp.clip(ratio_BxN, lo, hi) * adv_BxN)
    if cfg.dual_clip is not None:
        dual_BxN = jnp.maximum(objective_BxN, cfg.dual_clip * adv_BxN)
        objective_BxN = jnp.where(adv_BxN < 0, dual_BxN, objective_BxN)
    pg_BxN = -weights_BxN * objective_BxN

    scale_BxN = mask_BxN / denom_Bx1
    pg_loss = jnp.sum(pg_BxN * scale_BxN)
    loss = pg_loss

    r_BxN = sg(ratio_BxN)

    def token_frac(cond_BxN: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(cond_BxN, mask_BxN, 0.0)) / num_tokens

    metrics = {
        "pg_loss": sg(pg_loss),
        "clip_frac_low": token_frac((adv_BxN < 0) & (r_BxN < lo)),
        "clip_frac_high": token_frac((adv_BxN > 0) & (r_BxN > hi)),
        "clip_frac_dual": (
            token_frac((adv_BxN < 0) & (r_BxN > cfg.dual_clip))
            if cfg.dual_clip is not None
            else jnp.zeros((), jnp.float32)
        ),
        "ratio_mean": jnp.sum(r_BxN * mask_BxN) / num_tokens,
    }
    if ref_logp_BxN is not None:
        ref_BxN = jnp.where(live_BxN, ref_logp_BxN.astype(jnp.float32), 0.0)
        kl_BxN = kl_penalty(logp_BxN, ref_BxN, cfg.kl_estimator)
        kl_loss = cfg.kl_beta * jnp.sum(kl_BxN * scale_BxN)
        if cfg.kl_beta > 0:
            loss = loss + kl_loss
        metrics["kl_loss"] = sg(kl_loss)
        metrics["kl_ref"] = sg(jnp.sum(kl_BxN * mask_BxN)) / num_tokens
    return loss, metrics
