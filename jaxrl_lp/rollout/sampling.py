"""Token sampling: greedy, temperature, top-k and top-p, and the sampled tokens' log-probs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SamplingConfig", "sample_tokens", "token_logprobs"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
      greedy: take the argmax (temperature, top-k and top-p are then ignored
        for the choice; log-probs still use `temperature`).
      temperature: logits are divided by it; must be > 0.
      top_k: keep the k most likely tokens (0 = off).
      top_p: keep the smallest set of most likely tokens whose probability
        reaches top_p (1.0 = off); must be in (0, 1].
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            hint = ("greedy decoding ignores it for the choice but records log-probs at it; "
                    "leave it at 1.0") if self.greedy else "use greedy=True for argmax decoding"
            raise ValueError(
                f"SamplingConfig.temperature must be > 0 (got {self.temperature}); {hint}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off); got {self.top_k}")


def token_logprobs(logits_BxV: jax.Array, tokens_B: jax.Array, temperature: float) -> jax.Array:
    """log_softmax(logits / temperature)[token], in f32 (unfiltered by top-k/top-p).

    The sampler and the learner both call this function, so their log-probs of
    the same logits are the same bits.
    """
    lp = jax.nn.log_softmax(logits_BxV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(lp, tokens_B[..., None], axis=-1)[..., 0]


def _filter(scaled_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Masks to -inf every token outside the top-k and top-p sets."""
    v = scaled_BxV.shape[-1]
    if cfg.top_k and cfg.top_k < v:
        kth = jax.lax.top_k(scaled_BxV, cfg.top_k)[0][..., -1:]
        scaled_BxV = jnp.where(scaled_BxV < kth, -jnp.inf, scaled_BxV)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-scaled_BxV, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled_BxV, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token when the mass strictly before it is below top_p (the first always stays).
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < cfg.top_p
        keep = jnp.zeros_like(keep_sorted).at[
            jnp.arange(scaled_BxV.shape[0])[:, None], order].set(keep_sorted)
        scaled_BxV = jnp.where(keep, scaled_BxV, -jnp.inf)
    return scaled_BxV


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, cfg: SamplingConfig):
    """Chooses one token per row; returns (tokens [B] int32, log-probs [B] f32)."""
    logits = logits_BxV.astype(jnp.float32)
    if cfg.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        scaled = _filter(logits / cfg.temperature, cfg)
        tokens = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return tokens, token_logprobs(logits, tokens, cfg.temperature)
