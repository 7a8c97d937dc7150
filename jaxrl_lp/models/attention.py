"""Causal grouped-query attention, the model's and the decode kernel's reference.

A floor below `jaxrl_lp.kernels` (it imports only `numerics`): the flash-decoding
kernel (`kernels.decode_attention`) is checked against it, and the models call it.
Rounding as in `models.layers` (`policy.round` where a value leaves a region).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.products import product

__all__ = ["MASK_VALUE", "attention"]

# Finite so that a fully masked row (a padding query) gives a uniform average, not NaN.
MASK_VALUE = -1e30


def attention(
    q_BxTxHxDh: jax.Array,
    k_BxKxSxDh: jax.Array,
    v_BxKxSxDh: jax.Array,
    q_pos_BxT: jax.Array,
    k_pos_BxS: jax.Array,
    policy: Policy,
) -> jax.Array:
    """Causal grouped-query attention by positions; returns [B, T, H*Dh] in compute precision.

    Keys and values are heads-first, `[B, K, S, Dh]`, the KV cache's layout
    (`models.cache`). A key slot is visible to a query when its position is
    >= 0 (written, not padding) and <= the query's position. With the
    `softmax` region the scores stay f32 accumulators through the softmax;
    without it the scores are rounded and the softmax runs in compute
    precision.
    """
    b, t, h, dh = q_BxTxHxDh.shape
    kh = k_BxKxSxDh.shape[1]
    q = q_BxTxHxDh.reshape(b, t, kh, h // kh, dh)
    s = product("btkgd,bksd->bkgts", q, k_BxKxSxDh.astype(q.dtype), policy)
    scale = dh**-0.5
    mask = (k_pos_BxS[:, None, :] >= 0) & (k_pos_BxS[:, None, :] <= q_pos_BxT[:, :, None])
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
    if policy.has("softmax"):
        s = jnp.where(mask, s * scale, MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1)
        p = policy.round(p)
    else:
        s = jnp.where(mask, policy.round(policy.round(s) * scale), MASK_VALUE)
        e = policy.round(jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)))
        p = policy.round(e / policy.round(jnp.sum(e, axis=-1, keepdims=True)))
    o = product("bkgts,bksd->bkgtd", p, v_BxKxSxDh.astype(p.dtype), policy)
    # Heads to the back after the matmul (free when T == 1): asking the dot for
    # a [B, T, K, G, Dh] result makes XLA on CPU fall back to a slow kernel.
    return policy.round(jnp.moveaxis(o, 3, 1)).reshape(b, t, h * dh)
