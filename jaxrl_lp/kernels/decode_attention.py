"""Decode attention over the KV cache (flash-decoding) as a Pallas kernel.

The jnp reference is `jaxrl_lp.models.layers.attention` (same arguments, same
masks). Shape letters: B batch, T query tokens (1 when decoding; small T
works), H query heads, K kv heads, G = H // K, M = T * G query rows per kv
head, S cache slots, C chunks of `chunk` slots, Dh head width.

Algorithm (flash-decoding: the cache length is split, not the queries).
Pass 1, one grid step per (sequence b, kv head, chunk c), all M query rows of
the kv head's G query heads at once (GQA):

    s   = q_MxDh @ k_chunk^T * Dh^-0.5          (f32 accumulator)
    s   = MASK_VALUE where the slot is not visible: position -1 (empty or
          padding) or after the query's position (causal by position)
    s   = -inf past S (a ragged last chunk's padding: those slots do not exist)
    m_c = max s;  e = exp(s - m_c);  l_c = sum e;  o_c = e @ v_chunk

Pass 2 (jnp; C values per row): `w_c = exp(m_c - max_c m_c)`,
`out = sum_c w_c o_c / sum_c w_c l_c`, rounded once to compute precision.
A query that sees no slot (a padding query, position -1) gets the uniform
average over the S slots, as in the reference (MASK_VALUE is finite).

Numerics and rounding sites (policy): q, k and v arrive in compute precision;
scores, maxima, sums and both passes accumulate in f32. With the `softmax`
f32 region the unnormalized weights `e` are rounded to compute precision
before the `e @ v` product (the reference rounds the normalized weights
there); without it the scores are rounded as the reference rounds them
(`round(round(s) * scale)`) and so is `e`. So in `fp32` the kernel equals the
reference to f32 summation order (tests: 1e-6 absolute), and in bf16 it is
close but not bit-equal (tests state the tolerance); the sampler and the
learner's replay both run this kernel under a matched policy, and they agree
bit for bit.

Gradients: none. The kernel serves the sampler and the replay, which carries
no gradient (the hybrid learner differentiates the dense forward); a custom
VJP whose backward raises makes differentiation an explicit error rather than
a silent wrong gradient (forward-mode differentiation is refused by JAX).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrl_lp.kernels import dispatch
from jaxrl_lp.models.layers import MASK_VALUE, attention
from jaxrl_lp.numerics.policy import Policy

__all__ = ["MAX_CHUNK", "MIN_CHUNK", "TARGET_CHUNKS", "chunk_slots", "decode_attention"]

# Chunking rule: about TARGET_CHUNKS chunks per sequence and kv head (enough grid steps
# to fill a device when B * K is small), a power of two between MIN_CHUNK and MAX_CHUNK.
TARGET_CHUNKS = 8
MIN_CHUNK = 16
MAX_CHUNK = 512
_HIGHEST = jax.lax.Precision.HIGHEST


def chunk_slots(num_slots: int) -> int:
    """The chunk length for a cache of `num_slots` slots (module constants' rule)."""
    want = max(1, -(-num_slots // TARGET_CHUNKS))
    return min(MAX_CHUNK, max(MIN_CHUNK, 1 << (want - 1).bit_length()))


def decode_attention(q_BxTxHxDh: jax.Array, k_BxKxSxDh: jax.Array, v_BxKxSxDh: jax.Array,
                     q_pos_BxT: jax.Array, k_pos_BxS: jax.Array, policy: Policy | str, *,
                     chunk: int | None = None) -> jax.Array:
    """`models.layers.attention` over a KV cache, by flash-decoding where the policy picks the kernel.

    Args:
      q_BxTxHxDh: queries in compute precision (T = 1 when decoding).
      k_BxKxSxDh, v_BxKxSxDh: one layer's (and loop step's) cache slots, heads first.
      q_pos_BxT: the queries' positions.
      k_pos_BxS: each slot's position, -1 for an empty or padding slot.
      policy: precision policy; `policy.kernels` picks kernel or reference
        (`kernels.dispatch.choose`, name `decode_attention`).
      chunk: slots per chunk (default `chunk_slots(S)`); need not divide S.
        Compiled (GPU), the head width and the chunk must be powers of two
        >= 16; other shapes run the reference under `kernels=auto`
        (`dispatch.within_limits`).

    Returns:
      [B, T, H*Dh] in compute precision (the reference's contract).

    Raises:
      KernelUnavailableError: `kernels=on` on a backend without Pallas.
      NotImplementedError: when differentiated (the kernel has no gradient).

    Example:
      >>> o = decode_attention(q, ck, cv, pos, cache["pos"], "fp32,k=interpret")
    """
    policy = Policy.parse(policy)
    choice = dispatch.choose(policy, "decode_attention")
    if choice == "reference":
        return attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy)
    b, t, h, dh = q_BxTxHxDh.shape
    kh, s = k_BxKxSxDh.shape[1], k_BxKxSxDh.shape[2]
    if h % kh or k_BxKxSxDh.shape != (b, kh, s, dh) or v_BxKxSxDh.shape != k_BxKxSxDh.shape:
        raise ValueError(f"decode_attention: q {q_BxTxHxDh.shape} needs k and v [B, K, S, Dh] with "
                         f"K dividing H; got k {k_BxKxSxDh.shape}, v {v_BxKxSxDh.shape}")
    chunk = chunk_slots(s) if chunk is None else int(chunk)
    if chunk < 1:
        raise ValueError(f"decode_attention: chunk must be >= 1; got {chunk}")
    choice = dispatch.within_limits(choice, policy, "decode_attention",
                                    dispatch.pow2_misfit(head_dim=dh, chunk=chunk))
    if choice == "reference":
        return attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy)
    return _decode(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy, chunk,
                   choice == "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _decode(q, k, v, q_pos, k_pos, policy, chunk, interpret):
    return _flash_decode(q, k, v, q_pos, k_pos, policy, chunk, interpret)


def _decode_fwd(q, k, v, q_pos, k_pos, policy, chunk, interpret):
    return _flash_decode(q, k, v, q_pos, k_pos, policy, chunk, interpret), None


def _decode_bwd(policy, chunk, interpret, res, g):
    raise NotImplementedError(
        "decode_attention (the Pallas flash-decoding kernel) has no gradient: it serves the "
        "sampler and the learner's replay, which carry none. Differentiate the dense forward "
        "(cache-free attention), or run this path with kernels=off")


_decode.defvjp(_decode_fwd, _decode_bwd)


def _flash_decode(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy, chunk,
                  interpret):
    """Both passes (module docstring); returns [B, T, H*Dh] in compute precision."""
    b, t, h, dh = q_BxTxHxDh.shape
    kh, s = k_BxKxSxDh.shape[1], k_BxKxSxDh.shape[2]
    g, c = h // kh, pl.cdiv(s, chunk)
    m = t * g
    # Query rows grouped by kv head, row index t * G + g (tiny: B * H * Dh values).
    q_BxKxMxDh = q_BxTxHxDh.reshape(b, t, kh, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, kh, m, dh)
    qpos_BxMx1 = jnp.repeat(q_pos_BxT.astype(jnp.int32), g, axis=1)[..., None]
    # Rows padded to a power of two >= 16 (a Triton dot's smallest operand) at position -1:
    # they see no slot, compute a uniform average and are dropped below.
    mp = max(16, 1 << (m - 1).bit_length())
    q_BxKxMxDh = jnp.pad(q_BxKxMxDh, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
    qpos_BxMx1 = jnp.pad(qpos_BxMx1, ((0, 0), (0, mp - m), (0, 0)), constant_values=-1)
    kpos_Bx1xS = k_pos_BxS.astype(jnp.int32)[:, None, :]
    kernel = functools.partial(_chunk_kernel, chunk=chunk, slots=s, scale=dh**-0.5,
                               compute=policy.compute_dtype, softmax_f32=policy.has("softmax"))
    per_chunk = lambda rows, cols: pl.BlockSpec((None, None, None, rows, cols),
                                                lambda i, j, k: (i, j, k, 0, 0))
    o_c, m_c, l_c = pl.pallas_call(
        kernel,
        grid=(b, kh, c),
        in_specs=[
            pl.BlockSpec((None, None, mp, dh), lambda i, j, k: (i, j, 0, 0)),
            pl.BlockSpec((None, None, chunk, dh), lambda i, j, k: (i, j, k, 0)),
            pl.BlockSpec((None, None, chunk, dh), lambda i, j, k: (i, j, k, 0)),
            pl.BlockSpec((None, mp, 1), lambda i, j, k: (i, 0, 0)),
            pl.BlockSpec((None, 1, chunk), lambda i, j, k: (i, 0, k)),
        ],
        out_specs=(per_chunk(mp, dh), per_chunk(mp, 1), per_chunk(mp, 1)),
        out_shape=(jax.ShapeDtypeStruct((b, kh, c, mp, dh), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, c, mp, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, c, mp, 1), jnp.float32)),
        interpret=interpret,
        name="decode_attention",
    )(q_BxKxMxDh, k_BxKxSxDh, v_BxKxSxDh, qpos_BxMx1, kpos_Bx1xS)
    # Pass 2: rescale every chunk to the row's global max and combine (f32).
    w = jnp.exp(m_c - jnp.max(m_c, axis=2, keepdims=True))
    o_BxKxMxDh = (jnp.sum(w * o_c, axis=2) / jnp.sum(w * l_c, axis=2))[:, :, :m]
    o = o_BxKxMxDh.reshape(b, kh, t, g, dh).transpose(0, 2, 1, 3, 4)
    # Rounding site: the attention output, once, to compute precision (as the reference).
    return policy.round(o).reshape(b, t, h * dh)


def _chunk_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, o_ref, m_ref, l_ref, *, chunk, slots,
                  scale, compute, softmax_f32):
    """Pass 1 on one (b, kv head, chunk): partial max, sum and weighted values of its M rows."""
    rnd = lambda x: x if compute == jnp.float32 else x.astype(compute).astype(jnp.float32)
    first = pl.program_id(2) * chunk
    # Upcast: q, k, v hold compute-precision values; products and sums are f32.
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    exists_1xC = first + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1) < slots
    exists_Cx1 = first + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < slots
    kpos = kpos_ref[...]
    visible = (kpos >= 0) & (kpos <= qpos_ref[...])  # [M, chunk]
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                            preferred_element_type=jnp.float32)
    # Rounding sites as the reference's: f32 scores in the softmax region, else rounded twice.
    s = s * scale if softmax_f32 else rnd(rnd(s) * scale)
    s = jnp.where(exists_1xC, jnp.where(visible, s, MASK_VALUE), -jnp.inf)
    m = jnp.max(s, axis=1, keepdims=True)  # finite: every chunk holds a slot < S
    e = jnp.exp(s - m)
    if not softmax_f32:
        e = rnd(e)
    # Padding past S may hold NaN (a ragged tile): zero it, as its weight 0 would not.
    v = jnp.where(exists_Cx1, v, 0.0)
    # Rounding site: the weights enter the e @ v product in compute precision.
    o_ref[...] = jax.lax.dot_general(rnd(e), v, (((1,), (0,)), ((), ())), precision=_HIGHEST,
                                     preferred_element_type=jnp.float32)
    m_ref[...] = m
    l_ref[...] = jnp.sum(e, axis=1, keepdims=True)
