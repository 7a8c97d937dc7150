"""The dense decoder (Qwen3 family; Qwen2 with attention biases) as a pure function."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.models.blocks import attend, embed, lm_logits, mlp, project_qkv, residual_add
from jaxrl_lp.models.cache import write_positions
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.layers import attention, dot, rms_norm
from jaxrl_lp.numerics.policy import Policy

__all__ = ["dense_forward", "default_positions"]


def default_positions(tokens_BxT: jax.Array, cache_index=0) -> jax.Array:
    """Positions `cache_index + [0, T)` for every sequence."""
    b, t = tokens_BxT.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None] + cache_index, (b, t))


def dense_forward(
    params: dict,
    cfg: ModelConfig,
    policy: Policy,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array | None = None,
    cache: dict | None = None,
    cache_index: jax.Array | int = 0,
    *,
    remat: bool = False,
) -> tuple[jax.Array, dict | None]:
    """Logits of a dense decoder, reading and writing an optional KV cache.

    The same function serves the full forward (no cache), prefill and one-token
    decode (with a cache), so the sampler and the learner's replay run one
    computation. Layers are scanned (`lax.scan`), so compile time does not grow
    with depth.

    Args:
      params: the parameter pytree (docs/design.md).
      cfg: the architecture.
      policy: the numerics.
      tokens_BxT: int token ids.
      positions_BxT: int positions; -1 marks padding (never attended to).
        Default `cache_index + arange(T)`.
      cache: from `models.init_cache`, or None for a cache-free forward.
      cache_index: slot at which this chunk is written.
      remat: recompute each layer's activations in the backward pass.

    Returns:
      (logits [B, T, V] f32, the updated cache or None).
    """
    cache_index = jnp.asarray(cache_index, jnp.int32)
    if positions_BxT is None:
        positions_BxT = default_positions(tokens_BxT, cache_index)
    h = embed(params, tokens_BxT, policy)
    if cache is not None:
        cache = write_positions(cache, positions_BxT, cache_index)
    pos_slots = None if cache is None else cache["pos"]
    zero = jnp.zeros((), jnp.int32)

    def layer(carry, lp):
        h, ck, cv, l = carry
        x = rms_norm(h, lp["attn_norm"], cfg.rms_eps, policy)
        q, k, v = project_qkv(lp, x, positions_BxT, cfg, policy)
        if ck is None:
            a, _ = attend(lp, q, k, v, positions_BxT, None, cache_index, policy)
        else:
            # The whole [L, B, S, K, Dh] cache rides in the carry: this layer's chunk is
            # written in place and only this layer's slots are read, so no step
            # slices, restacks or copies the cache.
            at = (l, zero, cache_index, zero, zero)
            ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), at)
            cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), at)
            o = attention(q, ck[l], cv[l], positions_BxT, pos_slots, policy)
            a = policy.round(dot(o, lp["o_proj"], policy))  # as in `attend`
        h = residual_add(h, a, policy)
        h = residual_add(h, mlp(lp, rms_norm(h, lp["mlp_norm"], cfg.rms_eps, policy), policy),
                         policy)
        return (h, ck, cv, l + 1), None

    if remat:
        layer = jax.checkpoint(layer)
    ck = None if cache is None else cache["k"]
    cv = None if cache is None else cache["v"]
    (h, ck, cv, _), _ = jax.lax.scan(layer, (h, ck, cv, zero), params["layers"])
    if cache is not None:
        cache = {**cache, "k": ck, "v": cv}
    h = rms_norm(h, params["final_norm"], cfg.rms_eps, policy)
    return lm_logits(params, h, cfg, policy), cache
