"""The GPU (Pallas Triton) kernels of the fused log-prob, their tile plan and shared-memory budget.

`kernels.logprob` holds the maths, the reference and the entry points. Three
kernels share its tile maths (`running_update`, `tile_dlogits`), so they
differ from the reference only in where they sum:

- forward, one program per block of `block_t` rows: a loop over the
  vocabulary tiles (`fori_loop` over the full tiles, then the ragged last tile
  at its static width), each tile's logits accumulated over `block_d` chunks
  of the hidden axis, folded into the online logsumexp. Writes log-prob,
  entropy, and the two per-row residuals of the backward (lse, E_p s).
- d/dh, one program per row block: the same loop, recomputing each tile and
  accumulating `dz W_tile^T` into its `[block_t, D]` output block.
- d/dW, one program per vocabulary tile: a loop over the row blocks,
  accumulating `h_rows^T dz` into its own columns of `dW` (no two programs
  write the same column, so no atomics).

Every read is in bounds without masks: rows are padded to a multiple of
`block_t` (a copy of h, `[T, D]`, never of W), and the last vocabulary tile
is read at its own width. `W` and, in the d/dW kernel, every row input are
passed whole (`pl.no_block_spec`: a pointer into global memory) and sliced in
the kernel.

Backend: Triton, named on every `pallas_call` by its compiler params (JAX
0.10's default Pallas GPU backend is Mosaic GPU, which places each whole
block in shared memory and needs Hopper's warpgroup shapes; Triton stages
only what a `dot` reads, compiles for Ampere, Hopper and Blackwell alike, and
fits the pointer-and-loop shape these kernels have; docs/design/kernels.md).

dtypes. h arrives in compute precision, W as the policy rounded it (bf16, or
f32); Triton's `dot` takes two operands of one dtype, so where they differ
(dz is f32 against a bf16 W in d/dh, h bf16 against dz in d/dW) the narrower
is upcast to f32 first: exact, and what the reference's einsum does by type
promotion. Every dot accumulates in f32.

Shared memory (the budget `plan_tiles` checks against `kernels.targets`): a
model, not Triton's own count (which only its compiler, on a GPU, makes).
Triton stages each `dot`'s operand tiles through shared memory, `NUM_STAGES`
buffers deep where the loads are pipelined, and converts the f32 accumulator
tile's layout through shared memory once:

    forward:  S (bt bd |h| + bd bv |W|) + 4 bt bv
    d/dh:     forward + S (4 bt bv + 4 bd bv)      (dz and the W chunk, f32)
    d/dW:     forward + S (4 bt bd + 4 bt bv)      (the h chunk and dz, f32)

with S = `NUM_STAGES` and |x| the operand's bytes (4 for both when h and W
differ in dtype). The default plan (`plan_tiles`) keeps all three within the
target's 227 KiB.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_lp.kernels.logprob_tiles import (
    LogprobPlan,
    running_finish,
    running_init,
    running_update,
    tempered,
    tile_dlogits,
)
from jaxrl_lp.kernels.targets import budget_misfit

__all__ = ["GPU_KERNELS", "GpuTiles", "NUM_STAGES", "NUM_WARPS", "check_gpu_tiles", "kernel_backward",
           "kernel_forward", "plan_tiles", "smem_bytes"]

NUM_WARPS = 4  # one warpgroup: the rows of a [<=64, 128] tile need no more
NUM_STAGES = 2  # double-buffered loads in the loops over the hidden and vocabulary axes
GPU_KERNELS = ("forward", "dh", "dw")
LANES = 128  # a compiled tile's vocabulary axis is a multiple of the 128-wide lane
_HI = jax.lax.Precision.HIGHEST
_CONTRACT_V = (((1,), (1,)), ((), ()))  # dz [t, V] . W [d, V] -> [t, d]
_CONTRACT_T = (((0,), (0,)), ((), ()))  # h [t, d] . dz [t, V] -> [d, V]
_TRITON = pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


class GpuTiles(NamedTuple):
    """The tile of the three GPU kernels (powers of two >= 16 when compiled)."""

    block_t: int  # rows per program (rows are padded to a multiple of it)
    block_v: int  # vocabulary columns per tile (the last may be ragged)
    block_d: int  # hidden columns per matmul chunk (divides D)


def smem_bytes(kernel: str, tiles: GpuTiles, h_dtype, w_dtype) -> int:
    """Shared memory one program of `kernel` (`forward`, `dh`, `dw`) is modelled to use
    (module docstring)."""
    bt, bv, bd = tiles
    hb, wb = np.dtype(h_dtype).itemsize, np.dtype(w_dtype).itemsize
    if hb != wb:  # both upcast to f32 for the logits dot
        hb = wb = 4
    s = NUM_STAGES
    need = s * (bt * bd * hb + bd * bv * wb) + 4 * bt * bv
    if kernel == "dh":
        need += s * (4 * bt * bv + 4 * bd * bv)
    elif kernel == "dw":
        need += s * (4 * bt * bd + 4 * bt * bv)
    elif kernel != "forward":
        raise ValueError(f"unknown kernel {kernel!r}; one of {GPU_KERNELS}")
    return need


def check_gpu_tiles(d: int, v: int, tiles: GpuTiles) -> str | None:
    """Why the compiled Triton kernels cannot take `tiles` for `W [d, v]`, or None.

    Triton blocks are powers of two and a `dot` needs every operand dimension
    >= 16; the vocabulary tile is a multiple of the 128-wide lane and the last,
    ragged tile (`v % block_v`) is 0 or itself a power of two >= 16; `block_d`
    divides D.
    """
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    for name, b in zip(GpuTiles._fields, tiles, strict=True):
        if not pow2(b):
            return f"{name}={b} is not a power of two >= 16"
    if tiles.block_v % LANES:
        return f"block_v={tiles.block_v} is not a multiple of the {LANES}-wide lane"
    if v % tiles.block_v and not pow2(v % tiles.block_v):
        return (f"the last vocabulary tile (V={v} % block_v={tiles.block_v} = "
                f"{v % tiles.block_v}) is not a power of two >= 16")
    if d % tiles.block_d:
        return f"block_d={tiles.block_d} does not divide the hidden size D={d}"
    return None


def _describe(tiles: GpuTiles) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in tiles._asdict().items()) + ")"


def _misfit(d: int, v: int, tiles: GpuTiles, h_dtype, w_dtype) -> str | None:
    shape = check_gpu_tiles(d, v, tiles)
    if shape is not None:
        return f"the tile {_describe(tiles)}: {shape}"
    need = max(smem_bytes(k, tiles, h_dtype, w_dtype) for k in GPU_KERNELS)
    return budget_misfit("cuda", need, _describe(tiles) + f" with {np.dtype(h_dtype).name} h and "
                                       f"{np.dtype(w_dtype).name} W")


def plan_tiles(t: int, d: int, v: int, h_dtype, w_dtype, *, block_t: int | None = None,
               block_v: int | None = None, block_d: int | None = None
               ) -> tuple[GpuTiles, str | None]:
    """The compiled kernels' tile for T rows and `W [d, v]`, and why it does not fit (or None).

    Explicit sizes are kept; the others are searched: `block_t` the rows
    rounded up to a power of two, between 16 and 64; then the largest
    `block_v x block_d` (block_v from 512, 256, 128; block_d from 128 down to
    16, dividing D) that passes `check_gpu_tiles` and whose modelled shared
    memory (`smem_bytes`, all three kernels) fits the current cuda target. The
    answer depends on the shapes and dtypes only, so the sampler and the
    learner (same model, same policy) make the same choice. When nothing fits,
    the first candidate and why it does not.
    """
    bt = block_t or min(64, max(16, 1 << max(0, int(t) - 1).bit_length()))
    bvs = [block_v] if block_v else [512, 256, 128]
    bds = [block_d] if block_d else [b for b in (128, 64, 32, 16) if d % b == 0] or [16]
    candidates = sorted((GpuTiles(bt, bv, bd) for bv in bvs for bd in bds),
                        key=lambda c: -c.block_v * c.block_d)
    for tiles in candidates:
        if _misfit(d, v, tiles, h_dtype, w_dtype) is None:
            return tiles, None
    return candidates[0], _misfit(d, v, candidates[0], h_dtype, w_dtype)


# ----------------------------------------------------------------- the kernels
def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    """`dot_general` with f32 accumulation; operands of two dtypes are both upcast to f32
    (exact; Triton's dot takes one operand dtype)."""
    if a.dtype != b.dtype:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=_HI)


def _chunks(d: int, plan: LogprobPlan, body, init):
    """`body(d0, carry)` over the hidden axis in chunks of `block_d` (a `fori_loop`)."""
    bd = plan.block_d
    return jax.lax.fori_loop(0, d // bd, lambda k, c: body(pl.multiple_of(k * bd, bd), c), init)


def _logits(h_ref, w_ref, rows, v0, width: int, plan: LogprobPlan):
    """Tempered logits `[block_t, width]` of `h_ref[rows]` at columns `[v0, v0 + width)`."""
    bd = plan.block_d

    def chunk(d0, acc):
        return acc + _dot(h_ref[rows, pl.ds(d0, bd)], w_ref[pl.ds(d0, bd), pl.ds(v0, width)])

    acc = _chunks(w_ref.shape[0], plan, chunk, jnp.zeros((plan.block_t, width), jnp.float32))
    return tempered(acc, plan)


def _over_tiles(tile, carry, v: int, plan: LogprobPlan):
    """`tile(carry, v0, width)` over the full vocabulary tiles, then the ragged last one."""
    bv = plan.block_v
    nfull, r = divmod(v, bv)
    if nfull:  # (a loop body is traced even for zero trips, and a full tile may not fit V)
        carry = jax.lax.fori_loop(0, nfull, lambda j, c: tile(c, pl.multiple_of(j * bv, bv), bv),
                                  carry)
    return tile(carry, nfull * bv, r) if r else carry


def _fwd_kernel(h_ref, w_ref, tok_ref, mask_ref, lp_ref, ent_ref, lse_ref, mean_ref, *,
                plan: LogprobPlan):
    tokens = tok_ref[...]

    def tile(run, v0, width):
        return running_update(run, _logits(h_ref, w_ref, slice(None), v0, width, plan), v0, tokens)

    run = _over_tiles(tile, running_init(plan.block_t), w_ref.shape[1], plan)
    lp_ref[...], ent_ref[...], lse_ref[...], mean_ref[...] = running_finish(run, mask_ref[...] > 0)


def _dh_kernel(h_ref, w_ref, tok_ref, lse_ref, mean_ref, glp_ref, gent_ref, dh_ref, *,
               plan: LogprobPlan):
    bd = plan.block_d
    rows = (tok_ref[...], lse_ref[...], mean_ref[...], glp_ref[...], gent_ref[...])

    def zero(d0, c):
        dh_ref[:, pl.ds(d0, bd)] = jnp.zeros((plan.block_t, bd), jnp.float32)
        return c

    def tile(c, v0, width):
        dz = tile_dlogits(_logits(h_ref, w_ref, slice(None), v0, width, plan), v0, *rows, plan)

        def chunk(d0, c):
            dh_ref[:, pl.ds(d0, bd)] += _dot(dz, w_ref[pl.ds(d0, bd), pl.ds(v0, width)],
                                             _CONTRACT_V)
            return c

        return _chunks(w_ref.shape[0], plan, chunk, c)

    _over_tiles(tile, _chunks(w_ref.shape[0], plan, zero, 0), w_ref.shape[1], plan)


def _dw_kernel(h_ref, w_ref, tok_ref, lse_ref, mean_ref, glp_ref, gent_ref, dw_ref, *,
               plan: LogprobPlan):
    bt, bv, bd = plan.block_t, plan.block_v, plan.block_d
    d, v = w_ref.shape
    nfull, r = divmod(v, bv)

    def tile(v0, width):
        def zero(d0, c):
            dw_ref[pl.ds(d0, bd), pl.ds(v0, width)] = jnp.zeros((bd, width), jnp.float32)
            return c

        def row_block(i, c):
            rs = pl.ds(pl.multiple_of(i * bt, bt), bt)
            dz = tile_dlogits(_logits(h_ref, w_ref, rs, v0, width, plan), v0, tok_ref[rs],
                              lse_ref[rs], mean_ref[rs], glp_ref[rs], gent_ref[rs], plan)

            def chunk(d0, c):
                dw_ref[pl.ds(d0, bd), pl.ds(v0, width)] += _dot(h_ref[rs, pl.ds(d0, bd)], dz,
                                                                _CONTRACT_T)
                return c

            return _chunks(d, plan, chunk, c)

        jax.lax.fori_loop(0, h_ref.shape[0] // bt, row_block, _chunks(d, plan, zero, 0))

    j = pl.program_id(0)
    if nfull:
        pl.when(j < nfull)(lambda: tile(pl.multiple_of(j * bv, bv), bv))
    if r:  # the ragged last tile, at its own (static) width
        pl.when(j == nfull)(lambda: tile(nfull * bv, r))


def _pad_rows(plan: LogprobPlan, *xs):
    """Each row input padded with zeros to a multiple of `block_t` rows."""
    t = xs[0].shape[0]
    pad = -t % plan.block_t
    return tuple(jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) for x in xs)


def _call(kernel, name: str, plan: LogprobPlan, grid, in_specs, out_specs, out_shape, *args):
    return pl.pallas_call(functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, name=name,
                          interpret=plan.interpret, compiler_params=_TRITON)(*args)


def kernel_forward(h_TxD, w_DxV, tokens_T, mask_T, plan: LogprobPlan):
    """`reference_forward` by the forward kernel: (logp, entropy, lse, E_p s), each [T] f32."""
    t, d = h_TxD.shape
    h, tokens, mask = _pad_rows(plan, h_TxD, tokens_T, mask_T.astype(jnp.int32))
    row = pl.BlockSpec((plan.block_t,), lambda i: (i,))
    f32 = jax.ShapeDtypeStruct(tokens.shape, jnp.float32)
    outs = _call(_fwd_kernel, "logprob_fwd_gpu", plan, (h.shape[0] // plan.block_t,),
                 [pl.BlockSpec((plan.block_t, d), lambda i: (i, 0)), pl.no_block_spec, row, row],
                 [row] * 4, [f32] * 4, h, w_DxV, tokens, mask)
    return tuple(o[:t] for o in outs)


def kernel_backward(h_TxD, w_DxV, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T, plan: LogprobPlan):
    """`reference_backward` by the d/dh and d/dW kernels: (dh [T, D], dW [D, V])."""
    t, d = h_TxD.shape
    v = w_DxV.shape[1]
    padded = _pad_rows(plan, h_TxD, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T)
    row = pl.BlockSpec((plan.block_t,), lambda i: (i,))
    block = pl.BlockSpec((plan.block_t, d), lambda i: (i, 0))
    rows = padded[0].shape[0]
    dh = _call(_dh_kernel, "logprob_dh_gpu", plan, (rows // plan.block_t,),
               [block, pl.no_block_spec] + [row] * 5, block,
               jax.ShapeDtypeStruct((rows, d), jnp.float32), padded[0], w_DxV, *padded[1:])
    whole = pl.no_block_spec
    dw = _call(_dw_kernel, "logprob_dw_gpu", plan, (pl.cdiv(v, plan.block_v),), [whole] * 7, whole,
               jax.ShapeDtypeStruct((d, v), jnp.float32), padded[0], w_DxV, *padded[1:])
    return dh[:t].astype(h_TxD.dtype), dw.astype(w_DxV.dtype)
