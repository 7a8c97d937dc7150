"""Decode attention over the KV cache (flash-decoding) as a Pallas kernel, for GPU and TPU.

The jnp reference is `jaxrl_lp.models.attention.attention` (same arguments, same
masks); what runs is `kernels.dispatch.by_platform("decode_attention", ...)`'s
choice for the platform the program is lowered for. Shape letters: B batch,
T query tokens (1 when decoding; small T works), H query heads, K kv heads,
G = H // K, M = T * G query rows per kv head (padded to Mp, a power of two
>= 16), S cache slots, C chunks of `chunk` slots, Dh head width.

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

Numerics and rounding sites (policy): q, k and v arrive in compute precision
(bf16 arrays under native low precision); the kernel upcasts them to f32
before its dots, and scores, maxima, sums and both passes accumulate in f32.
With the `softmax` f32 region the unnormalized weights `e` are rounded to
compute precision before the `e @ v` product (the reference rounds the
normalized weights there); without it the scores are rounded as the
reference rounds them (`round(round(s) * scale)`) and so is `e`. So in `fp32`
the kernel equals the reference to f32 summation order (tests: 1e-6
absolute), and in bf16 it is close but not bit-equal (tests state the
tolerance); the sampler and the learner's replay both run this kernel under a
matched policy on the same platform, and they agree bit for bit.

Versions (one kernel body; the chunk and the compiler params per platform):

- cuda (Triton): 4 warps, 1 stage (the kernel has no loop to pipeline). Dh and
  the chunk are powers of two >= 16; the default chunk is the largest power of
  two <= `chunk_slots(S)` whose shared memory fits the target.
- tpu (Mosaic): grid (batch, kv head, chunk) all `parallel`. The chunk is a
  multiple of 128 or the whole S (the `[1, chunk]` block of slot positions,
  Mosaic's last-two-dims rule); the default is `chunk_slots(S)` raised to 128,
  or S where that covers S.

Shared memory (cuda, `_cuda_smem`): Triton stages dot operands in shared
memory; counted are both dots' operand tiles in the f32 they see, q [Mp, Dh],
k [chunk, Dh], the weights [Mp, chunk] and v [chunk, Dh], times the pipeline
stages (1): 144 KiB at Mp 16, chunk 128, Dh 128, of H100's 227 KiB. VMEM
(tpu, `_tpu_vmem`): every block double-buffered and padded to Mosaic's tiles,
plus f32 copies of q, k, v and eight [Mp, chunk] f32 temporaries: 408 KiB at
the same tile in bf16, of v5's 16 MiB. A `chunk` the caller passes that does
not fit is replaced by the platform's default under `kernels=auto`;
interpreted, any chunk runs. The chunk changes the summation order (and in
bf16 where `e` is rounded), so cuda and tpu may differ in the last bits; on
one platform every program takes the same chunk.

Gradients: the kernel's backward (`jax.custom_vjp`) is the VJP of the
reference `attention` at the same inputs, recomputed: differentiating any
mode gives the reference's gradient. Every branch of the platform dispatch is
traced, so a program lowered for cpu (where the reference runs) still traces
the kernels' backward; this keeps it a real gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxrl_lp.kernels import dispatch
from jaxrl_lp.kernels.targets import budget_misfit
from jaxrl_lp.models.attention import MASK_VALUE, attention
from jaxrl_lp.numerics.policy import Policy, require

__all__ = ["MAX_CHUNK", "MIN_CHUNK", "TARGET_CHUNKS", "chunk_slots", "decode_attention",
           "plan_chunk"]

# Chunking rule: about TARGET_CHUNKS chunks per sequence and kv head (enough grid steps
# to fill a device when B * K is small), a power of two between MIN_CHUNK and MAX_CHUNK.
TARGET_CHUNKS = 8
MIN_CHUNK = 16
MAX_CHUNK = 512
_LANES = 128
_HIGHEST = jax.lax.Precision.HIGHEST
_TRITON = pltriton.CompilerParams(num_warps=4, num_stages=1)


def chunk_slots(num_slots: int) -> int:
    """The chunk length for a cache of `num_slots` slots (module constants' rule)."""
    want = max(1, -(-num_slots // TARGET_CHUNKS))
    return min(MAX_CHUNK, max(MIN_CHUNK, 1 << (want - 1).bit_length()))


def decode_attention(q_BxTxHxDh: jax.Array, k_BxKxSxDh: jax.Array, v_BxKxSxDh: jax.Array,
                     q_pos_BxT: jax.Array, k_pos_BxS: jax.Array, policy: Policy, *,
                     chunk: int | None = None) -> jax.Array:
    """`models.attention.attention` over a KV cache, by the platform's flash-decoding kernel.

    Not jitted itself; every platform's version is traced (`dispatch.by_platform`).

    Args:
      q_BxTxHxDh: queries in compute precision (T = 1 when decoding).
      k_BxKxSxDh, v_BxKxSxDh: one layer's (and loop step's) cache slots, heads first.
      q_pos_BxT: the queries' positions.
      k_pos_BxS: each slot's position, -1 for an empty or padding slot.
      policy: precision policy; `policy.kernels` picks kernel or reference.
      chunk: slots per chunk for both versions (default each platform's plan,
        `plan_chunk`); need not divide S.

    Returns:
      [B, T, H*Dh] in compute precision (the reference's contract).
      Differentiable: the gradient is the reference's (module docstring).

    Raises:
      KernelUnavailableError: `kernels=on` lowered for cpu, or for a platform
        whose kernel cannot take the shape (cuda: a head width or chunk that is
        not a power of two >= 16, a chunk over the shared memory; tpu: a chunk
        breaking Mosaic's block rule or over the VMEM), at lowering.
      ValueError: mismatched shapes, or a chunk < 1.

    Examples:
      >>> o = decode_attention(q, ck, cv, pos, cache["pos"], FP32.replace(kernels="interpret"))
    """
    policy = require(policy, "decode_attention")
    if policy.kernels == "off":
        return attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy)
    return dispatch.once_per_shape(_dispatch, q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT,
                                   k_pos_BxS, policy=policy, chunk=chunk)


def _dispatch(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, *, policy: Policy,
              chunk: int | None):
    """`decode_attention`'s dispatch, traced once per shape (`dispatch.once_per_shape`)."""
    args = (q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS)
    reference = lambda: attention(*args, policy)
    b, t, h, dh = q_BxTxHxDh.shape
    kh, s = k_BxKxSxDh.shape[1], k_BxKxSxDh.shape[2]
    if h % kh or k_BxKxSxDh.shape != (b, kh, s, dh) or v_BxKxSxDh.shape != k_BxKxSxDh.shape:
        raise ValueError(f"decode_attention: q {q_BxTxHxDh.shape} needs k and v [B, K, S, Dh] with "
                         f"K dividing H; got k {k_BxKxSxDh.shape}, v {v_BxKxSxDh.shape}")
    if chunk is not None and int(chunk) < 1:
        raise ValueError(f"decode_attention: chunk must be >= 1; got {chunk}")
    mp = _padded_rows(t * h // kh)
    versions = {}
    for platform in ("cuda", "tpu"):
        planned, misfit = plan_chunk(platform, s, mp, dh, q_BxTxHxDh.dtype, chunk)
        if misfit is not None and chunk is not None and policy.kernels == "auto":
            planned, misfit = plan_chunk(platform, s, mp, dh, q_BxTxHxDh.dtype)
        interpreted = planned if chunk is None else int(chunk)
        versions[platform] = dispatch.Version(
            lambda interpret, p=platform, c=planned, i=interpreted:
                _per_shard(policy, _Run(p, i if interpret else c, interpret))(*args), misfit)
    return dispatch.by_platform("decode_attention", policy, reference, **versions)


def _per_shard(policy: Policy, run: _Run):
    """The kernel on each device's rows and heads under a mesh (`dispatch.per_shard`): a
    query head's kv head is on the same device (H and K split alike over `tensor`), every
    slot of a row's cache is (slots are never split), so each device attends on its own."""
    rows = ("batch", None)
    heads_first = ("batch", "kv_heads", None, None)
    return dispatch.per_shard(lambda *a: _decode(*a, policy, run),
                              (("batch", None, "heads", None), heads_first, heads_first, rows, rows),
                              ("batch", None, "heads"))


# ----------------------------------------------------------------- plans
def _padded_rows(m: int) -> int:
    """Query rows padded to a power of two >= 16 (a Triton dot's smallest operand)."""
    return max(16, 1 << (m - 1).bit_length())


def _cuda_smem(mp: int, dh: int, chunk: int) -> int:
    """Shared memory of the cuda kernel (module docstring): both dots' f32 operands, 1 stage."""
    return 4 * (mp * dh + chunk * dh + mp * chunk + chunk * dh) * _TRITON.num_stages


def _vmem_block(rows: int, cols: int, itemsize: int) -> int:
    sub = 8 * 4 // itemsize
    return -(-rows // sub) * sub * -(-cols // _LANES) * _LANES * itemsize


def _tpu_vmem(mp: int, dh: int, chunk: int, itemsize: int) -> int:
    """VMEM of the tpu kernel (module docstring)."""
    blocks = (_vmem_block(mp, dh, itemsize) + 2 * _vmem_block(chunk, dh, itemsize)
              + _vmem_block(mp, 1, 4) + _vmem_block(1, chunk, 4)  # q, k, v, positions
              + _vmem_block(mp, dh, 4) + 2 * _vmem_block(mp, 1, 4))  # o, m, l
    return 2 * blocks + 4 * (mp * dh + 2 * chunk * dh + 8 * mp * chunk)


def plan_chunk(platform: str, s: int, mp: int, dh: int, dtype, chunk: int | None = None):
    """(chunk, misfit) of `platform`'s kernel for S slots, Mp query rows and head width Dh:
    `chunk` (or the platform's default, module docstring) and why the compiled kernel
    cannot take it on the current target, or None."""
    if platform == "cuda":
        if chunk is None:
            chunk = chunk_slots(s)
            while chunk > MIN_CHUNK and budget_misfit("cuda", _cuda_smem(mp, dh, chunk), ""):
                chunk //= 2  # the largest power of two that fits
        chunk = int(chunk)
        tile = f"[{mp}, {dh}] queries x [{chunk}, {dh}] keys and values"
        bad = dispatch.pow2_misfit(head_dim=dh, chunk=chunk)
        if bad is not None:
            return chunk, f"{bad} (Triton blocks and dots; the tile {tile})"
        return chunk, budget_misfit("cuda", _cuda_smem(mp, dh, chunk), tile)
    if chunk is None:
        chunk = max(_LANES, chunk_slots(s))
        chunk = s if chunk >= s else chunk
    chunk = int(chunk)
    tile = f"[{mp}, {dh}] queries x [{chunk}, {dh}] keys and values"
    if chunk != s and chunk % _LANES:
        return chunk, (f"chunk={chunk} is neither S={s} nor a multiple of {_LANES}: the [1, {chunk}] "
                       "block of slot positions breaks Mosaic TPU's last-two-dims rule")
    itemsize = jnp.dtype(dtype).itemsize
    return chunk, budget_misfit("tpu", _tpu_vmem(mp, dh, chunk, itemsize), tile)


class _Run(NamedTuple):
    """Which version runs (a `custom_vjp` static)."""

    platform: str  # `cuda` or `tpu`: the compiler params
    chunk: int
    interpret: bool


# ----------------------------------------------------------------- the kernel and its gradient
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _decode(q, k, v, q_pos, k_pos, policy, run: _Run):
    return _flash_decode(q, k, v, q_pos, k_pos, policy, run)


def _decode_fwd(q, k, v, q_pos, k_pos, policy, run):
    return _flash_decode(q, k, v, q_pos, k_pos, policy, run), (q, k, v, q_pos, k_pos)


def _decode_bwd(policy, run, res, g):
    """The reference's VJP at the same inputs (module docstring)."""
    del run
    q, k, v, q_pos, k_pos = res
    _, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, q_pos, k_pos, policy), q, k, v)
    return (*pullback(g), None, None)


_decode.defvjp(_decode_fwd, _decode_bwd)


def _flash_decode(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, q_pos_BxT, k_pos_BxS, policy, run: _Run):
    """Both passes (module docstring); returns [B, T, H*Dh] in compute precision."""
    b, t, h, dh = q_BxTxHxDh.shape
    kh, s = k_BxKxSxDh.shape[1], k_BxKxSxDh.shape[2]
    chunk = run.chunk
    g, c = h // kh, pl.cdiv(s, chunk)
    m = t * g
    # Query rows grouped by kv head, row index t * G + g (tiny: B * H * Dh values).
    q_BxKxMxDh = q_BxTxHxDh.reshape(b, t, kh, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, kh, m, dh)
    qpos_BxMx1 = jnp.repeat(q_pos_BxT.astype(jnp.int32), g, axis=1)[..., None]
    # Rows padded at position -1: they see no slot, compute a uniform average and are dropped.
    mp = _padded_rows(m)
    q_BxKxMxDh = jnp.pad(q_BxKxMxDh, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
    qpos_BxMx1 = jnp.pad(qpos_BxMx1, ((0, 0), (0, mp - m), (0, 0)), constant_values=-1)
    kpos_Bx1xS = k_pos_BxS.astype(jnp.int32)[:, None, :]
    kernel = functools.partial(_chunk_kernel, chunk=chunk, slots=s, scale=dh**-0.5,
                               compute=policy.compute_dtype, softmax_f32=policy.has("softmax"))
    per_chunk = lambda rows, cols: pl.BlockSpec((None, None, None, rows, cols),
                                                lambda i, j, k: (i, j, k, 0, 0))
    params = (_TRITON if run.platform == "cuda"
              else pltpu.CompilerParams(dimension_semantics=("parallel",) * 3))
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
        compiler_params=params,
        interpret=run.interpret,
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

