"""Training-inference mismatch corrections: truncated and masked importance sampling.

The sampler draws tokens from `pi_sampler` (low-precision kernels, another
engine), while the learner's policy at the same weights is `pi_learner`. With
per-token ratios `rho_it = pi_learner(y_it) / pi_sampler(y_it)` (the learner's
log-probs recomputed at the behaviour weights over the sampler's recorded
ones), the policy-gradient term of each token is reweighted by `w_it`:

- `none`:    `w_it = 1`.
- `tis`:     `w_it = min(rho_it, C)` (truncated IS, Yao et al., 2025).
- `mis`:     `w_it = rho_it` if `1/C <= rho_it <= C`, else the token is dropped:
             removed from the loss *and* from its denominator (masked IS).
- `seq_tis`: `w_it = min(rho_i, C)` for every token of sequence `i`, with the
             geometric mean `rho_i = exp(mean_t log rho_it)`.
- `seq_mis`: `w_it = rho_i` if `1/C <= rho_i <= C`, else the whole sequence is
             dropped (and no longer counts as a sequence in the denominator).

Sequence-level ratios use the geometric mean (length-normalised), not the
product, so long sequences are not dropped by accumulation alone. The weights
are computed once per minibatch, before any micro-batch split, and carry no
gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.rl.metrics import LOG_RATIO_CLIP, masked_mean, mismatch_metrics

__all__ = ["correction_weights"]


def correction_weights(
    learner_old_logp_BxN: jax.Array | None,
    sampler_logp_BxN: jax.Array,
    mask_BxN: jax.Array,
    cfg: LossConfig,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Per-token correction weights and the mask of tokens kept in the loss.

    Call once per minibatch (jit with `cfg` static); pass `keep_mask_BxN` to
    `loss_denominator` and, sliced by rows, with `weights_BxN` to
    `policy_loss`.

    Args:
      learner_old_logp_BxN: the learner's log-probs of the sampled tokens at
        the behaviour weights; may be None when `cfg.correction == "none"`
        (the mismatch metrics are then not computed).
      sampler_logp_BxN: the log-probs the sampler recorded.
      mask_BxN: f32, 1 on real completion tokens.
      cfg: the loss config (`correction`, `correction_cap`).

    Returns:
      `(weights_BxN, keep_mask_BxN, metrics)`: f32 weights (0 off the kept
      tokens), the f32 mask of kept tokens, and f32 scalar metrics:
      `is_weight_mean` (over kept tokens), `frac_truncated` (real tokens whose
      weight was capped at C), `frac_masked` (real tokens dropped), and the
      `mismatch_*` metrics of `mismatch_metrics` when learner log-probs are
      given.
    """
    sg = jax.lax.stop_gradient
    # Upcast: the mask may come as bool/int; all weights are f32.
    mask_BxN = sg(mask_BxN.astype(jnp.float32))
    if cfg.correction == "none":
        weights_BxN, keep_BxN, truncated_BxN = mask_BxN, mask_BxN, jnp.zeros_like(mask_BxN)
    else:
        if learner_old_logp_BxN is None:
            raise ValueError(
                f"LossConfig.correction={cfg.correction!r} needs learner_old_logp_BxN"
            )
        live_BxN = mask_BxN > 0
        # Padding may hold anything (e.g. -inf); zero it before the difference.
        log_rho_BxN = jnp.where(
            live_BxN,
            sg(learner_old_logp_BxN.astype(jnp.float32))
            - sg(sampler_logp_BxN.astype(jnp.float32)),
            0.0,
        )
        if cfg.correction in ("seq_tis", "seq_mis"):
            len_Bx1 = jnp.maximum(jnp.sum(mask_BxN, axis=1, keepdims=True), 1.0)
            log_rho_Bx1 = jnp.sum(log_rho_BxN, axis=1, keepdims=True) / len_Bx1
            log_rho_BxN = jnp.broadcast_to(log_rho_Bx1, mask_BxN.shape)
        log_rho_BxN = jnp.clip(log_rho_BxN, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        rho_BxN = jnp.exp(log_rho_BxN)
        cap = float(cfg.correction_cap)
        if cfg.correction in ("tis", "seq_tis"):
            keep_BxN = mask_BxN
            weights_BxN = jnp.minimum(rho_BxN, cap) * mask_BxN
            truncated_BxN = jnp.where(rho_BxN > cap, mask_BxN, 0.0)
        else:
            # Compare in log space: |log rho| <= log C is the band [1/C, C].
            inside_BxN = jnp.abs(log_rho_BxN) <= jnp.log(jnp.float32(cap))
            keep_BxN = jnp.where(inside_BxN, mask_BxN, 0.0)
            weights_BxN = rho_BxN * keep_BxN
            truncated_BxN = jnp.zeros_like(mask_BxN)
    num_real = jnp.maximum(jnp.sum(mask_BxN), 1.0)
    metrics = {
        "is_weight_mean": masked_mean(weights_BxN, keep_BxN),
        "frac_truncated": jnp.sum(truncated_BxN) / num_real,
        "frac_masked": (jnp.sum(mask_BxN) - jnp.sum(keep_BxN)) / num_real,
    }
    if learner_old_logp_BxN is not None:
        metrics.update(mismatch_metrics(learner_old_logp_BxN, sampler_logp_BxN, mask_BxN))
    return weights_BxN, keep_BxN, metrics
