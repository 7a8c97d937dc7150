"""Causal grouped-query attention, the model's and the decode kernel's reference.

A floor below `jaxrl_lp.kernels` (it imports only `numerics`): the flash-decoding
kernel (`kernels.decode_attention`) is checked against it, and the models call it.
Rounding as in `models.layers` (`policy.round` where a value leaves a region).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_lp.numerics import invariant
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

    Inside `numerics.invariant.invariant_forms` the two products take the
    invariant form (each query row's bits independent of how many queries are
    computed with it; its gradient the plain form's), so a decode step's
    attention over its cache and a parallel forward's over the same slots agree.
    """
    if invariant.active():
        return _invariant_attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS,
                                    policy)
    return _attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy, False)


def _attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy: Policy,
               invariant_products: bool) -> jax.Array:
    """`attention`'s computation, its two products plain or invariant."""
    b, t, h, dh = q_BxTxHxDh.shape
    kh = k_BxKxSxDh.shape[1]
    q = q_BxTxHxDh.reshape(b, t, kh, h // kh, dh)
    if invariant_products:  # query rows (t, g) as the columns of each (b, k) product
        q_rows = jnp.moveaxis(q, 1, 3).reshape(b, kh, h // kh * t, dh)
        s = invariant.attention_scores(q_rows, k_BxKxSxDh.astype(q.dtype))
        s = s.reshape(b, kh, h // kh, t, -1)
    else:
        s = product("btkgd,bksd->bkgts", q, k_BxKxSxDh.astype(q.dtype), policy)
    scale = dh**-0.5
    mask = (k_pos_BxS[:, None, :] >= 0) & (k_pos_BxS[:, None, :] <= q_pos_BxT[:, :, None])
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
    if policy.has("softmax") and not invariant.active():
        s = jnp.where(mask, s * scale, MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1)
        p = policy.round(p)
    elif policy.has("softmax"):  # the same softmax, its sum a fixed tree (`invariant.total`)
        s = jnp.where(mask, s * scale, MASK_VALUE)
        e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = policy.round(e / invariant.total(e))
    else:
        s = jnp.where(mask, policy.round(policy.round(s) * scale), MASK_VALUE)
        e = policy.round(jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)))
        p = policy.round(e / policy.round(invariant.total(e)))
    if invariant_products:
        o = invariant.attention_values(p.reshape(b, kh, h // kh * t, -1),
                                       v_BxKxSxDh.astype(p.dtype)).reshape(b, kh, h // kh, t, dh)
    else:
        o = product("bkgts,bksd->bkgtd", p, v_BxKxSxDh.astype(p.dtype), policy)
    # Heads to the back after the matmul (free when T == 1): asking the dot for
    # a [B, T, K, G, Dh] result makes XLA on CPU fall back to a slow kernel.
    return policy.round(jnp.moveaxis(o, 3, 1)).reshape(b, t, h * dh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _invariant_attention(q, k, v, q_pos, k_pos, policy):
    return _attention(q, k, v, q_pos, k_pos, policy, True)


def _invariant_fwd(q, k, v, q_pos, k_pos, policy):
    return _attention(q, k, v, q_pos, k_pos, policy, True), (q, k, v, q_pos, k_pos)


def _invariant_bwd(policy, res, g):
    """The plain form's VJP at the same inputs: only the value has to be the decode's."""
    q, k, v, q_pos, k_pos = res
    _, pullback = jax.vjp(lambda q, k, v: _attention(q, k, v, q_pos, k_pos, policy, False),
                          q, k, v)
    return (*pullback(g), None, None)


_invariant_attention.defvjp(_invariant_fwd, _invariant_bwd)
