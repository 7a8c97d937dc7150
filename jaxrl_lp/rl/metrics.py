"""Masked reductions and the training-inference mismatch metrics.

Shapes: `B` sequences, `N` completion tokens; `mask_BxN` is f32, 1 on real
completion tokens and 0 on padding. Every function here is jit-friendly and
returns f32 scalars.

The mismatch is measured between the sampler's recorded log-probs `s` (the
policy the tokens were drawn from) and the learner's log-probs `l` of the same
tokens at the same (behaviour) weights, with `d = l - s` per token:

- `mismatch_k1 = mean(s - l)`: the k1 estimate of `KL(pi_sampler || pi_learner)`
  (tokens are samples of the sampler). Unbiased but can be negative.
- `mismatch_k3 = mean(exp(d) - 1 - d)`: the k3 estimate of the same KL
  (Schulman, 2020): unbiased, always >= 0, lower variance.
- `mismatch_max_abs_dlogp = max |d|`.
- `mismatch_prob_err = mean(exp(|d|))`: the token multiplicative probability
  error, >= 1, equal to 1 when the two agree.

Means are over real tokens of the whole batch given (token-weighted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "LOG_RATIO_CLIP",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "mismatch_metrics",
]

# Log-ratios are clipped to [-LOG_RATIO_CLIP, LOG_RATIO_CLIP] before exp, so a
# single wild token cannot overflow f32 (exp(20) ~ 4.9e8).
LOG_RATIO_CLIP = 20.0


def masked_sum(x_BxN: jax.Array, mask_BxN: jax.Array) -> jax.Array:
    """`sum(x * mask)` in f32; masked entries contribute 0 even if x is inf/nan."""
    # where, not multiply: padding may hold garbage (inf - inf) that 0 * x keeps.
    return jnp.sum(jnp.where(mask_BxN > 0, x_BxN.astype(jnp.float32) * mask_BxN, 0.0))


def masked_mean(x_BxN: jax.Array, mask_BxN: jax.Array) -> jax.Array:
    """`sum(x * mask) / max(sum(mask), 1)` in f32 (0 for an empty mask)."""
    return masked_sum(x_BxN, mask_BxN) / jnp.maximum(jnp.sum(mask_BxN), 1.0)


def masked_max(x_BxN: jax.Array, mask_BxN: jax.Array) -> jax.Array:
    """Max of `x` over masked-in entries (0 for an empty mask)."""
    x_BxN = x_BxN.astype(jnp.float32)
    big = jnp.where(mask_BxN > 0, x_BxN, -jnp.inf)
    return jnp.where(jnp.any(mask_BxN > 0), jnp.max(big), 0.0)


def mismatch_metrics(
    learner_logp_BxN: jax.Array, sampler_logp_BxN: jax.Array, mask_BxN: jax.Array
) -> dict[str, jax.Array]:
    """Sampler-vs-learner mismatch of the sampled tokens' log-probs.

    Args:
      learner_logp_BxN: the learner's log-probs of the sampled tokens, at the
        weights the sampler used.
      sampler_logp_BxN: the log-probs the sampler recorded.
      mask_BxN: f32, 1 on real completion tokens.

    Returns:
      f32 scalars `mismatch_k1`, `mismatch_k3`, `mismatch_max_abs_dlogp`,
      `mismatch_prob_err` (see the module docstring for the formulas).
    """
    # Upcast: log-prob differences are small; compute them in f32.
    mask_BxN = mask_BxN.astype(jnp.float32)
    d_BxN = learner_logp_BxN.astype(jnp.float32) - sampler_logp_BxN.astype(jnp.float32)
    d_clip_BxN = jnp.clip(d_BxN, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    abs_d_BxN = jnp.abs(d_BxN)
    return {
        "mismatch_k1": masked_mean(-d_BxN, mask_BxN),
        "mismatch_k3": masked_mean(jnp.exp(d_clip_BxN) - 1.0 - d_clip_BxN, mask_BxN),
        "mismatch_max_abs_dlogp": masked_max(abs_d_BxN, mask_BxN),
        "mismatch_prob_err": masked_mean(
            jnp.exp(jnp.minimum(abs_d_BxN, LOG_RATIO_CLIP)), mask_BxN
        ),
    }
