"""Token sampling: greedy, temperature, top-k and top-p, and the sampled tokens' log-probs."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_lp.numerics import invariant
from jaxrl_lp.rollout.noise import gumbel

__all__ = ["DRAWS", "SamplingConfig", "choose_tokens", "draw_categorical", "first_argmax",
           "gumbel_max", "sample_tokens", "token_logprobs"]

# How a token is drawn from the filtered, tempered distribution (`draw_categorical`).
DRAWS = ("gumbel", "inverse_cdf")


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
      draw: how a token is drawn from the filtered, tempered distribution:
        `gumbel` (`jax.random.categorical`, Gumbel-max over the vocabulary) or
        `inverse_cdf` (one uniform per row against the cumulative
        probabilities; faster, the same distribution, other tokens per key).
        See `draw_categorical`.
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    draw: Literal["gumbel", "inverse_cdf"] = "gumbel"

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
        if self.draw not in DRAWS:
            raise ValueError(f"SamplingConfig.draw must be one of {', '.join(DRAWS)}; "
                             f"got {self.draw!r}")


def token_logprobs(logits_BxV: jax.Array, tokens_B: jax.Array, temperature: float) -> jax.Array:
    """log_softmax(logits / temperature)[token], in f32 (unfiltered by top-k/top-p).

    The sampler and the learner both call this function, so their log-probs of
    the same logits are the same bits. Inside `numerics.invariant.invariant_forms`
    the scaled logits and the log of the sum are kept apart from the sums that read
    them (`invariant.apart`) and the sum is a fixed tree (`invariant.total`), so any
    program that computes it computes it alike.
    """
    s = logits_BxV.astype(jnp.float32) / temperature
    if invariant.active():
        s = invariant.apart(s)
        shifted = s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        lse = invariant.apart(jnp.log(invariant.total(jnp.exp(shifted))))
        lp = shifted - lse
    else:
        lp = jax.nn.log_softmax(s, axis=-1)
    return jnp.take_along_axis(lp, tokens_B[..., None], axis=-1)[..., 0]


def first_argmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """`jnp.argmax(x, axis)` as int32: on CPU as two plain reductions, elsewhere itself.

    The same index bit for bit, on every platform: the first position of the
    maximum, a NaN counting as the maximum (its first position then), index 0
    where every entry is -inf (or False). `jnp.argmax` lowers to one reduce
    over (value, index) pairs, which XLA:CPU emits as a scalar loop, about
    twice the time of the noise, a max and a min of positions here
    (docs/design/exact_logprobs.md, "Argmax as two plain reductions"). GPU and
    TPU run that reduce in one pass over a [B, V] block, and the Gumbel noise
    and the logits it adds fuse into it (`gumbel_max`): the two reductions
    would read the noisy logits twice, written out once in between
    (docs/design/hot_path.md, "The decode step's kernels"). So the platform
    lowered for picks (`lax.platform_dependent`): the two reductions on CPU,
    `jnp.argmax` on GPU and TPU. Either is the same index: the draw's tokens
    do not depend on the platform's form.
    """
    x = jnp.asarray(x)
    axis = axis % x.ndim
    return jax.lax.platform_dependent(
        x, cpu=lambda x: _two_reductions(x, axis),
        default=lambda x: jnp.argmax(x, axis=axis).astype(jnp.int32))


def _two_reductions(x: jax.Array, axis: int) -> jax.Array:
    """`first_argmax` as a max and a min of the positions that reach it (XLA:CPU's form)."""
    hit = x == jnp.max(x, axis=axis, keepdims=True)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        hit = hit | jnp.isnan(x)
    positions = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(hit, positions, x.shape[axis]), axis=axis)


def gumbel_max(key: jax.Array, scaled_BxV: jax.Array) -> jax.Array:
    """[B] int32: `jax.random.categorical(key, scaled_BxV, axis=-1)`, token for token.

    The same Gumbel noise (`jax.random.gumbel` of the logits' shape and dtype,
    its bits from `rollout.noise.gumbel`), added to the logits, and
    `first_argmax` in place of `jnp.argmax`.
    """
    noise = gumbel(key, scaled_BxV.shape, scaled_BxV.dtype)
    return first_argmax(noise + scaled_BxV, axis=-1)


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


def _inverse_cdf(key: jax.Array, scaled_BxV: jax.Array) -> jax.Array:
    """[B] int32: the first token whose cumulative weight exceeds u * total, u ~ U[0, 1) per row."""
    v = scaled_BxV.shape[-1]
    # Unnormalized weights: the normalization is the threshold's factor instead (exact in
    # distribution, one division fewer per element). Filtered tokens (-inf) weigh 0.
    w_BxV = jnp.exp(scaled_BxV - jnp.max(scaled_BxV, axis=-1, keepdims=True))
    cdf_BxV = jnp.cumsum(w_BxV, axis=-1)
    u_B = jax.random.uniform(key, scaled_BxV.shape[:-1], jnp.float32)
    # u <= 1 - 2^-23, so u * total rounds to below total: some cdf entry exceeds it.
    t_B = u_B * cdf_BxV[..., -1]
    tok = first_argmax(cdf_BxV > t_B[..., None], axis=-1)
    # A weight-0 token can only be hit where the scan's rounding is not monotone (XLA may
    # sum a prefix in another order than its neighbour's): move to the next positive one.
    live_BxV = w_BxV > 0
    after = live_BxV & (jnp.arange(v) >= tok[..., None])
    last = v - 1 - first_argmax(live_BxV[..., ::-1], axis=-1)
    nxt = jnp.where(jnp.any(after, axis=-1), first_argmax(after, axis=-1), last)
    hit = jnp.take_along_axis(live_BxV, tok[..., None], axis=-1)[..., 0]
    return jnp.where(hit, tok, nxt).astype(jnp.int32)


def draw_categorical(key: jax.Array, scaled_BxV: jax.Array, draw: str = "gumbel") -> jax.Array:
    """[B] int32 tokens drawn from softmax(scaled_BxV) (-inf entries are never drawn).

    Both draws are exact samples of the same categorical distribution up to f32
    rounding, but map a key to different tokens:
    - `gumbel`: `jax.random.categorical`'s tokens (`gumbel_max`): argmax(scaled
      + Gumbel noise), one noise draw (two logs) per vocabulary entry.
    - `inverse_cdf`: w = exp(scaled - max), c = cumsum(w), the first token with
      c > u * c[-1] for one u ~ U[0, 1) per row: one exp per entry and B
      random numbers (cheaper than the noise on CPU: docs/bench,
      `benchmarks/sampler_draw.py`). Tokens of probability below
      about 2^-23 of the total mass are resolved at the uniform's 23-bit
      resolution.

    The log-probs are not computed here: `token_logprobs` scores the token, so
    a replay of either draw's tokens is the sampler's bits.
    """
    if draw == "gumbel":
        return gumbel_max(key, scaled_BxV)
    if draw == "inverse_cdf":
        return _inverse_cdf(key, scaled_BxV)
    raise ValueError(f"draw must be one of {', '.join(DRAWS)}; got {draw!r}")


def choose_tokens(logits_BxV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Chooses one token per row by `cfg` (greedy, or drawn after temperature, top-k, top-p):
    [B] int32."""
    logits = logits_BxV.astype(jnp.float32)
    if cfg.greedy:
        return first_argmax(logits, axis=-1)
    return draw_categorical(key, _filter(logits / cfg.temperature, cfg), cfg.draw)


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, cfg: SamplingConfig):
    """Chooses one token per row; returns (tokens [B] int32, log-probs [B] f32)."""
    tokens = choose_tokens(logits_BxV, key, cfg)
    return tokens, token_logprobs(logits_BxV, tokens, cfg.temperature)
