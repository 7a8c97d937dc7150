"""The attention and MLP blocks shared by the dense and looped decoders.

`lp` is one layer's slice of `params["layers"]` (see docs/design.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.layers import attention, dot, rms_norm, rope, swiglu
from jaxrl_lp.numerics.policy import Policy

__all__ = ["attend", "embed", "lm_logits", "mlp", "project_qkv", "residual_add"]


def embed(params: dict, tokens_BxT: jax.Array, policy: Policy) -> jax.Array:
    """Embedding lookup, rounded to compute precision (f32 when the residual is f32)."""
    x = policy.round_params(jnp.take(params["embed"], tokens_BxT, axis=0))
    return x.astype(jnp.float32) if policy.has("residual") else x


def residual_add(h: jax.Array, delta: jax.Array, policy: Policy) -> jax.Array:
    """h + delta: kept f32 with the `residual` region, else rounded to compute precision."""
    if policy.has("residual"):
        return h + delta.astype(jnp.float32)
    return policy.round(h + delta)


def project_qkv(lp: dict, x_BxTxD: jax.Array, positions_BxT: jax.Array,
                cfg: ModelConfig, policy: Policy):
    """Query, key and value of one layer: projections, optional bias and QK-norm, RoPE.

    Returns q [B,T,H,Dh], k and v [B,T,K,Dh], all in compute precision.
    """
    b, t, _ = x_BxTxD.shape
    hd = cfg.head_dim

    def proj(name, heads):
        acc = dot(x_BxTxD, lp[f"{name}_proj"], policy)
        if cfg.attention_bias:
            acc = acc + policy.round_params(lp[f"{name}_bias"]).astype(jnp.float32)
        return policy.round(acc).reshape(b, t, heads, hd)

    q = proj("q", cfg.num_heads)
    k = proj("k", cfg.num_kv_heads)
    v = proj("v", cfg.num_kv_heads)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_eps, policy)
        k = rms_norm(k, lp["k_norm"], cfg.rms_eps, policy)
    q = rope(q, positions_BxT, cfg.rope_theta, policy)
    k = rope(k, positions_BxT, cfg.rope_theta, policy)
    return q, k, v


def attend(lp: dict, q, k, v, positions_BxT, cache_l, cache_index, policy: Policy):
    """Attention output projected by o_proj (f32 accumulator rounded), and the updated cache.

    Without a cache the keys are this chunk's own tokens. With `cache_l` (a dict
    of `k`, `v` [B,S,K,Dh] and `pos` [B,S]) the chunk is written at slots
    `[cache_index, cache_index + T)` and the queries read every visible slot.
    """
    if cache_l is None:
        keys, values, k_pos = k, v, positions_BxT
        new_cache = None
    else:
        zero = jnp.zeros((), jnp.int32)
        idx = (zero, cache_index, zero, zero)
        keys = jax.lax.dynamic_update_slice(cache_l["k"], k.astype(cache_l["k"].dtype), idx)
        values = jax.lax.dynamic_update_slice(cache_l["v"], v.astype(cache_l["v"].dtype), idx)
        k_pos = cache_l["pos"]
        new_cache = {"k": keys, "v": values}
    o = attention(q, keys, values, positions_BxT, k_pos, policy)
    return policy.round(dot(o, lp["o_proj"], policy)), new_cache


def mlp(lp: dict, x_BxTxD: jax.Array, policy: Policy) -> jax.Array:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), output in compute precision."""
    hidden = swiglu(dot(x_BxTxD, lp["gate_proj"], policy), dot(x_BxTxD, lp["up_proj"], policy),
                    policy)
    return policy.round(dot(hidden, lp["down_proj"], policy))


def lm_logits(params: dict, h_xD: jax.Array, cfg: ModelConfig, policy: Policy) -> jax.Array:
    """Output logits from the final normed hidden state, f32 (rounded to `logits_dtype`)."""
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return policy.round_logits(dot(h_xD, w, policy))
