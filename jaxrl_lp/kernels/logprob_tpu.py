"""The Mosaic TPU kernels of the fused log-prob (`kernels.logprob`: maths, reference, entry point).

Mosaic places every block of a kernel in VMEM, so W `[D, V]` cannot stay whole
in the kernel as the GPU kernels keep it (`kernels.logprob_gpu`). Here the
vocabulary is a *grid axis* and W is tiled by a BlockSpec: one `[D, block_v]`
tile is in VMEM at a time (double-buffered by Pallas's pipeline). Letters: T
rows, D hidden, V vocabulary, B rows of a block (`block_t`), W columns of a
vocabulary tile (`block_v`).

| kernel | grid | semantics | per grid step |
|---|---|---|---|
| `logprob_fwd_tpu` | (T / B, V / W) | parallel, arbitrary | tile j into the online logsumexp (scratch) |
| `logprob_dh_tpu` | (T / B, V / W) | parallel, arbitrary | `acc_BxD += dz W_tile^T` (f32 scratch) |
| `logprob_dw_tpu` | (V / W, T / B) | parallel, arbitrary | `acc_DxW += h_rows^T dz` (f32 scratch) |

Each kernel writes its output blocks at the last step of its "arbitrary"
(sequential) axis: the forward's log-prob, entropy, lse and E_p s, d/dh's
rows and d/dW's columns, rounded once from f32.

The tile maths is `kernels.logprob`'s (`tempered`, and keepdims `[B, 1]`
copies of `running_update`, `running_finish`, `tile_dlogits` with the same
formulas in the same order). Per-row vectors travel as `[T, 1]` arrays with
`(B, 1)` blocks (Mosaic's last-two-dims rule). Rows are padded with zeros to a
multiple of `block_t` (zero g's give dz = 0, so padded rows add nothing to dW);
W is never copied: a last vocabulary tile that overruns V reads garbage
(possibly NaN) past V, so those columns' logits are set to the finite `NEG`,
their dz to 0, and (d/dh, which sums over the vocabulary) W's columns to 0;
Pallas drops the out-of-range part of an output block at writeback.

Plans fit the target's scoped VMEM (`vmem_bytes`, `tpu_tiles`;
`kernels.targets`). Checked on CPU in Pallas interpret mode and by lowering
for TPU (`kernels.lowering`); not run on a TPU here.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_lp.kernels.logprob_tiles import NEG, LogprobPlan, tempered
from jaxrl_lp.kernels.targets import budget_misfit, current_target, format_bytes

__all__ = ["KERNELS", "TpuLogprobTiles", "TpuTiles", "check_tpu_tiles", "plan_misfit", "tpu_backward",
           "tpu_forward", "tpu_tiles", "vmem_bytes"]

KERNELS = ("forward", "dh", "dw")
LANES, SUBLANES = 128, 8  # a VMEM tile of 32-bit values is [8, 128]
BLOCK_T_CHOICES = (512, 256, 128, 64, 32, 16, 8)
BLOCK_V_CHOICES = (1024, 512, 256, 128)
_HI = jax.lax.Precision.HIGHEST
_CONTRACT_V = (((1,), (1,)), ((), ()))  # dz [B, W] . W [D, W] -> [B, D]
_CONTRACT_B = (((0,), (0,)), ((), ()))  # h [B, D] . dz [B, W] -> [D, W]
# Live f32 [B, W] temporaries of one tile, counted on the kernels below (every op result,
# no fusion assumed: the high side). Forward: acc, the rounded z, s, cols, masked s, d, e,
# e d, the chosen pick (9). Backward: acc, z, s, cols, masked s, s - lse, p, onehot,
# onehot - p, g_lp (..), s - mean, g_ent p, g_ent p (s - mean), ds, ds / tau, dz (16).
_TILE_TEMPS = {"forward": 9, "dh": 16, "dw": 16}
# Live f32 [B, 1] temporaries (each B * 128 * 4 bytes: lane-padded). Forward: the 4 statistics
# read, the new max, scale, 3 tile sums, the 3 updated sums, and _finish's log l, E_p s - m and
# its 4 outputs (16). Backward: the 5 row inputs read.
_ROW_TEMPS = {"forward": 16, "dh": 5, "dw": 5}


class TpuTiles(NamedTuple):
    """One kernel's tile: rows and vocabulary columns per grid step."""

    block_t: int  # rows per step (a multiple of 8: sublanes)
    block_v: int  # vocabulary columns per step (a multiple of 128: lanes)


class TpuLogprobTiles(NamedTuple):
    """The tiles of the three kernels (each may differ)."""

    forward: TpuTiles
    dh: TpuTiles
    dw: TpuTiles


class RowStats(NamedTuple):
    """`kernels.logprob.Running` with keepdims fields: online statistics of one row block."""

    m: jax.Array  # [B, 1] running max of s
    l: jax.Array  # [B, 1] sum exp(s - m)
    a: jax.Array  # [B, 1] sum exp(s - m) (s - m)
    c: jax.Array  # [B, 1] s of the chosen token (0 until its tile is seen)


# ----------------------------------------------------------------- tiles and their VMEM
def check_tpu_tiles(tiles: TpuTiles, kernel: str) -> None:
    """Raises a ValueError naming the first tile size Mosaic's block rule refuses.

    `block_t` must be a positive multiple of 8 (sublanes) and `block_v` of 128
    (lanes): the last two dims of every block (h's `(block_t, D)`, W's
    `(D, block_v)`, the rows' `(block_t, 1)`) must be.
    """
    for name, b, unit in (("block_t", tiles.block_t, SUBLANES), ("block_v", tiles.block_v, LANES)):
        if not isinstance(b, int | np.integer) or isinstance(b, bool) or b < 1 or b % unit:
            raise ValueError(f"logprob TPU kernel {kernel!r}: {name}={b!r} is not a positive "
                             f"multiple of {unit} (Mosaic's block rule)")


def _buffer_bytes(rows: int, cols: int, dtype) -> int:
    """A `[rows, cols]` VMEM buffer: padded to whole [8 * packing, 128] tiles."""
    itemsize = np.dtype(dtype).itemsize
    sub = SUBLANES * max(1, 4 // itemsize)  # bf16 packs two rows per sublane
    return -(-rows // sub) * sub * -(-cols // LANES) * LANES * itemsize


def vmem_bytes(kernel: str, tiles: TpuTiles, d: int, h_dtype, w_dtype) -> int:
    """VMEM one program of `kernel` (`forward`, `dh`, `dw`) needs, in bytes, on the high side.

    The model: every block twice (Pallas's TPU pipeline double-buffers inputs
    and outputs), each padded to whole `[8 * packing, 128]` VMEM tiles (so a
    `(B, 1)` row block costs `B * 128 * 4`); the scratch once; and the tile
    maths' temporaries as if none were fused or kept in registers:
    `_TILE_TEMPS[kernel]` f32 `[B, W]` arrays, `_ROW_TEMPS[kernel]` f32
    `[B, 1]` ones, the f32 copy of a dot operand upcast to f32 (d/dh: W's
    tile `[D, W]`, masked; d/dW: h's rows `[B, D]`; the logits dot's narrower
    operand when h and W differ in dtype), and the f32 product the backward
    kernels add to their accumulator.

    Args:
      kernel: `forward`, `dh` or `dw`.
      tiles: its tile.
      d: the hidden size D.
      h_dtype, w_dtype: dtypes of h and W.

    Returns:
      The bytes, to compare with the target's scoped VMEM limit.
    """
    if kernel not in KERNELS:
        raise ValueError(f"vmem_bytes: kernel must be one of {KERNELS}; got {kernel!r}")
    bt, bv = tiles
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    row = _buffer_bytes(bt, 1, f32)
    h, w = _buffer_bytes(bt, d, h_dtype), _buffer_bytes(d, bv, w_dtype)
    tile = _TILE_TEMPS[kernel] * _buffer_bytes(bt, bv, f32) + _ROW_TEMPS[kernel] * row
    mixed = 0  # the narrower logits operand upcast to f32
    if np.dtype(h_dtype) != np.dtype(w_dtype):
        mixed = _buffer_bytes(bt, d, f32) if np.dtype(h_dtype).itemsize < 4 else _buffer_bytes(d, bv, f32)
    if kernel == "forward":  # h, W, tokens, mask in; logp, entropy, lse, mean out; m, l, a, c
        blocks = h + w + _buffer_bytes(bt, 1, i32) + row + 4 * row
        return 2 * blocks + 4 * row + tile + mixed
    rows_in = _buffer_bytes(bt, 1, i32) + 4 * row  # tokens, lse, mean, g_lp, g_ent
    if kernel == "dh":
        blocks = h + w + rows_in + _buffer_bytes(bt, d, h_dtype)
        acc = _buffer_bytes(bt, d, f32)
        return 2 * blocks + acc + tile + mixed + _buffer_bytes(d, bv, f32) + acc
    blocks = h + w + rows_in + _buffer_bytes(d, bv, w_dtype)
    acc = _buffer_bytes(d, bv, f32)
    return 2 * blocks + acc + tile + mixed + _buffer_bytes(bt, d, f32) + acc


def _first_fit(kernel, t, d, v, h_dtype, w_dtype, limit_bytes) -> TpuTiles | None:
    """The largest tile of `kernel` within `limit_bytes` (`tpu_tiles`)."""
    t8 = -(-t // SUBLANES) * SUBLANES
    v128 = -(-v // LANES) * LANES
    cands = [TpuTiles(bt, bv) for bt in BLOCK_T_CHOICES if bt <= t8
             for bv in BLOCK_V_CHOICES if bv <= v128]
    if not cands:  # T or V below the smallest choice: one block of each
        cands = [TpuTiles(min(t8, BLOCK_T_CHOICES[-1]), min(v128, BLOCK_V_CHOICES[-1]))]
    # Largest work per step first; ties go to the axis the kernel re-streams from HBM:
    # forward and d/dh read W once per row block (favour block_t), d/dW h once per vocab tile.
    streamed = (lambda c: c.block_v) if kernel == "dw" else (lambda c: c.block_t)
    for c in sorted(cands, key=lambda c: (c.block_t * c.block_v, streamed(c)), reverse=True):
        if vmem_bytes(kernel, c, d, h_dtype, w_dtype) <= limit_bytes:
            return c
    return None


def tpu_tiles(t: int, d: int, v: int, h_dtype, w_dtype, limit_bytes: int) -> TpuLogprobTiles | str:
    """The default plan: per kernel the largest tile whose `vmem_bytes` fit `limit_bytes`.

    Candidates: `block_v` in 1024, 512, 256, 128 (never above V rounded up to
    128), `block_t` in 512, 256, ..., 8 (never above T rounded up to 8). The
    largest is the one with most rows x columns per grid step (fewest steps);
    ties go to `block_t` for the forward and d/dh (which re-read W once per row
    block) and to `block_v` for d/dW (which re-reads h once per vocab tile).

    Returns:
      The plan, or a str saying why none fits (e.g. a D so large that even
      8 x 128 tiles do not).

    Examples:
      >>> tpu_tiles(4096, 1024, 151936, jnp.bfloat16, jnp.bfloat16, 16 << 20).forward
      TpuTiles(block_t=512, block_v=256)
    """
    picked = {}
    for kernel in KERNELS:
        tile = _first_fit(kernel, t, d, v, h_dtype, w_dtype, limit_bytes)
        if tile is None:
            small = TpuTiles(BLOCK_T_CHOICES[-1], BLOCK_V_CHOICES[-1])
            return (f"logprob TPU kernel {kernel!r}: even the tile {small.block_t} x {small.block_v} "
                    f"needs {format_bytes(vmem_bytes(kernel, small, d, h_dtype, w_dtype))} of VMEM at "
                    f"D={d} (h {np.dtype(h_dtype)}, W {np.dtype(w_dtype)}), over the limit of "
                    f"{format_bytes(limit_bytes)}")
        picked[kernel] = tile
    return TpuLogprobTiles(**picked)


def plan_misfit(tiles: TpuLogprobTiles, d: int, h_dtype, w_dtype) -> str | None:
    """Why the compiled kernels cannot take the plan `tiles` (a block rule, or a kernel's VMEM
    over the current TPU target's limit), or None: what the dispatch checks before it traces
    the compiled kernels (`_check` raises at trace time)."""
    for kernel, tile in zip(KERNELS, tiles, strict=True):
        try:
            check_tpu_tiles(tile, kernel)
        except ValueError as e:
            return str(e)
        why = budget_misfit("tpu", vmem_bytes(kernel, tile, d, h_dtype, w_dtype),
                            f"{kernel} {tile.block_t} x {tile.block_v} at D={d}")
        if why is not None:
            return why
    return None


def _check(tiles: TpuTiles, kernel: str, d: int, h_dtype, w_dtype, interpret: bool) -> None:
    """The tile's block rule always; its VMEM against the current TPU target when compiled."""
    check_tpu_tiles(tiles, kernel)
    if interpret:
        return
    why = budget_misfit("tpu", vmem_bytes(kernel, tiles, d, h_dtype, w_dtype),
                        f"{kernel} {tiles.block_t} x {tiles.block_v} at D={d}")
    if why is not None:
        raise ValueError(f"logprob TPU kernel: {why} ({current_target('tpu').source})")


# ----------------------------------------------------------------- keepdims tile maths
def _dot(a, b, dims):
    """`a . b` contracted as `dims`, accumulated in f32."""
    if a.dtype != b.dtype:
        # Upcast the narrower operand (bf16 -> f32 is exact): the reference's einsum promotes so.
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=_HI)


def _logits(h_ref, w_ref, j, v: int, plan: LogprobPlan):
    """(s, cols): tile j's tempered logits `[B, W]` (`NEG` past V) and their column ids."""
    s_BxW = tempered(_dot(h_ref[...], w_ref[...], (((1,), (0,)), ((), ()))), plan)
    bv = w_ref.shape[1]
    cols_BxW = j * bv + jax.lax.broadcasted_iota(jnp.int32, s_BxW.shape, 1)
    if v % bv:  # the last tile overruns V: its columns past V hold garbage
        s_BxW = jnp.where(cols_BxW < v, s_BxW, NEG)
    return s_BxW, cols_BxW


def _update(run: RowStats, s_BxW, cols_BxW, tokens_Bx1) -> RowStats:
    """`kernels.logprob.running_update`, keepdims: the same formulas in the same order."""
    m = jnp.maximum(run.m, jnp.max(s_BxW, axis=1, keepdims=True))
    scale = jnp.exp(run.m - m)
    d = s_BxW - m
    e = jnp.exp(d)
    return RowStats(m, run.l * scale + jnp.sum(e, axis=1, keepdims=True),
                    scale * (run.a + (run.m - m) * run.l) + jnp.sum(e * d, axis=1, keepdims=True),
                    run.c + jnp.sum(jnp.where(cols_BxW == tokens_Bx1, s_BxW, 0.0), axis=1,
                                    keepdims=True))


def _finish(run: RowStats, mask_Bx1):
    """`kernels.logprob.running_finish`, keepdims: (logp, entropy, lse, E_p s), each [B, 1]."""
    log_l = jnp.log(run.l)
    mean_rel = run.a / run.l  # E_p[s] - m
    lp = jnp.where(mask_Bx1, run.c - (run.m + log_l), 0.0)
    ent = jnp.where(mask_Bx1, log_l - mean_rel, 0.0)
    return lp, ent, run.m + log_l, run.m + mean_rel


def _dlogits(s_BxW, cols_BxW, v: int, tok, lse, mean, g_lp, g_ent, plan: LogprobPlan):
    """`kernels.logprob.tile_dlogits`, keepdims rows `[B, 1]`; 0 in the columns past V."""
    p = jnp.exp(s_BxW - lse)
    onehot = jnp.where(cols_BxW == tok, 1.0, 0.0)
    ds = g_lp * (onehot - p) - g_ent * p * (s_BxW - mean)
    dz_BxW = (ds / plan.temperature).astype(plan.logits_dtype).astype(jnp.float32)
    return jnp.where(cols_BxW < v, dz_BxW, 0.0) if v % s_BxW.shape[1] else dz_BxW


# ----------------------------------------------------------------- the kernels
def _fwd_kernel(h_ref, w_ref, tok_ref, mask_ref, lp_ref, ent_ref, lse_ref, mean_ref,
                m_ref, l_ref, a_ref, c_ref, *, plan: LogprobPlan, v: int, n_tiles: int):
    j = pl.program_id(1)
    stats = (m_ref, l_ref, a_ref, c_ref)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        for ref in stats[1:]:
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    s, cols = _logits(h_ref, w_ref, j, v, plan)
    run = _update(RowStats(*(ref[...] for ref in stats)), s, cols, tok_ref[...])
    for ref, x in zip(stats, run, strict=True):
        ref[...] = x

    @pl.when(j == n_tiles - 1)
    def _write():
        outs = _finish(run, mask_ref[...] > 0)
        for ref, x in zip((lp_ref, ent_ref, lse_ref, mean_ref), outs, strict=True):
            ref[...] = x


def _dh_kernel(h_ref, w_ref, tok_ref, lse_ref, mean_ref, glp_ref, gent_ref, dh_ref, acc_ref, *,
               plan: LogprobPlan, v: int, n_tiles: int):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(ragged: bool):
        s, cols = _logits(h_ref, w_ref, j, v, plan)
        dz = _dlogits(s, cols, v, tok_ref[...], lse_ref[...], mean_ref[...], glp_ref[...],
                      gent_ref[...], plan)
        # Upcast W's tile to dz's f32 (exact): the reference's einsum promotes so.
        w_DxW = w_ref[...].astype(jnp.float32)
        if ragged:  # a sum over the vocabulary: W's garbage past V (maybe NaN) must be 0
            w_cols = j * w_DxW.shape[1] + jax.lax.broadcasted_iota(jnp.int32, w_DxW.shape, 1)
            w_DxW = jnp.where(w_cols < v, w_DxW, 0.0)
        acc_ref[...] += _dot(dz, w_DxW, _CONTRACT_V)

    if v % w_ref.shape[1]:  # only the last tile pays for the mask
        pl.when(j < n_tiles - 1)(lambda: step(False))
        pl.when(j == n_tiles - 1)(lambda: step(True))
    else:
        step(False)

    @pl.when(j == n_tiles - 1)
    def _write():
        dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)  # one rounding, to h's dtype


def _dw_kernel(h_ref, w_ref, tok_ref, lse_ref, mean_ref, glp_ref, gent_ref, dw_ref, acc_ref, *,
               plan: LogprobPlan, v: int, n_blocks: int):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s, cols = _logits(h_ref, w_ref, j, v, plan)
    dz = _dlogits(s, cols, v, tok_ref[...], lse_ref[...], mean_ref[...], glp_ref[...],
                  gent_ref[...], plan)
    # Upcast h's rows to dz's f32 (exact): the reference's einsum promotes so.
    acc_ref[...] += _dot(h_ref[...].astype(jnp.float32), dz, _CONTRACT_B)

    @pl.when(i == n_blocks - 1)
    def _write():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)  # one rounding, to W's dtype


# ----------------------------------------------------------------- the entry points
def _pad_rows(bt: int, *xs):
    """Each row input padded with zeros to a multiple of `bt` rows."""
    pad = -xs[0].shape[0] % bt
    return tuple(jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) for x in xs)


def _col(x, dtype):
    """A per-row vector `[T]` as the `[T, 1]` array its `(B, 1)` blocks tile."""
    return x.astype(dtype).reshape(-1, 1)


def tpu_forward(h_TxD, w_DxV, tokens_T, mask_T, plan: LogprobPlan, tiles: TpuLogprobTiles,
                interpret: bool):
    """`reference_forward` by the forward kernel (module table); not jitted itself.

    Args:
      h_TxD: hidden rows, compute precision (bf16 or f32).
      w_DxV: the output matrix, already rounded by the policy (bf16 or f32).
      tokens_T: int chosen tokens in `[0, V)`.
      mask_T: rows to compute (nonzero); the others give log-prob and entropy 0.
      plan: only its `temperature` and `logits_dtype` are read.
      tiles: `tiles.forward` is used.
      interpret: True for Pallas interpret mode (CPU checks; a
        `pltpu.InterpretParams()` selects the TPU interpreter); False compiles,
        and the tile must fit the current TPU target's VMEM (`kernels.targets`).

    Returns:
      (logp, entropy, lse, E_p s), each [T] f32.

    Examples:
      >>> lp, ent, lse, mean = tpu_forward(h, w, tokens, mask, plan, tiles, interpret=True)
    """
    (t, d), v = h_TxD.shape, w_DxV.shape[1]
    bt, bv = tiles.forward
    _check(tiles.forward, "forward", d, h_TxD.dtype, w_DxV.dtype, interpret)
    h, tok, mask = _pad_rows(bt, h_TxD, _col(tokens_T, jnp.int32), _col(mask_T, jnp.int32))
    grid = (h.shape[0] // bt, pl.cdiv(v, bv))
    row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
    f32_Tx1 = jax.ShapeDtypeStruct(tok.shape, jnp.float32)
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan, v=v, n_tiles=grid[1]),
        grid=grid,
        in_specs=[pl.BlockSpec((bt, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((d, bv), lambda i, j: (0, j)), row, row],
        out_specs=[row] * 4,
        out_shape=[f32_Tx1] * 4,
        scratch_shapes=[pltpu.VMEM((bt, 1), jnp.float32)] * 4,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name="logprob_fwd_tpu",
        interpret=interpret,
    )(h, w_DxV, tok, mask)
    return tuple(o[:t, 0] for o in outs)


def tpu_backward(h_TxD, w_DxV, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T, plan: LogprobPlan,
                 tiles: TpuLogprobTiles, interpret: bool):
    """`reference_backward` by the d/dh and d/dW kernels (module table); not jitted itself.

    Args:
      h_TxD, w_DxV, tokens_T: as `tpu_forward`.
      lse_T, mean_T: the forward's residuals, [T] f32.
      g_lp_T, g_ent_T: cotangents of log-prob and entropy, [T] f32, already masked.
      plan: only its `temperature` and `logits_dtype` are read.
      tiles: `tiles.dh` and `tiles.dw` are used.
      interpret: as `tpu_forward`.

    Returns:
      (dh [T, D] in h's dtype, dW [D, V] in W's dtype), each accumulated in f32
      and rounded once.
    """
    (t, d), v = h_TxD.shape, w_DxV.shape[1]
    rows = (_col(tokens_T, jnp.int32), *(_col(x, jnp.float32) for x in (lse_T, mean_T, g_lp_T, g_ent_T)))
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))

    bt, bv = tiles.dh
    _check(tiles.dh, "dh", d, h_TxD.dtype, w_DxV.dtype, interpret)
    h, *rows_dh = _pad_rows(bt, h_TxD, *rows)
    grid = (h.shape[0] // bt, pl.cdiv(v, bv))
    h_block = pl.BlockSpec((bt, d), lambda i, j: (i, 0))
    dh = pl.pallas_call(
        functools.partial(_dh_kernel, plan=plan, v=v, n_tiles=grid[1]),
        grid=grid,
        in_specs=[h_block, pl.BlockSpec((d, bv), lambda i, j: (0, j))]
        + [pl.BlockSpec((bt, 1), lambda i, j: (i, 0))] * 5,
        out_specs=h_block,
        out_shape=jax.ShapeDtypeStruct(h.shape, h_TxD.dtype),
        scratch_shapes=[pltpu.VMEM((bt, d), jnp.float32)],
        compiler_params=params,
        name="logprob_dh_tpu",
        interpret=interpret,
    )(h, w_DxV, *rows_dh)

    bt, bv = tiles.dw
    _check(tiles.dw, "dw", d, h_TxD.dtype, w_DxV.dtype, interpret)
    h, *rows_dw = _pad_rows(bt, h_TxD, *rows)
    grid = (pl.cdiv(v, bv), h.shape[0] // bt)
    w_block = pl.BlockSpec((d, bv), lambda j, i: (0, j))
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, plan=plan, v=v, n_blocks=grid[1]),
        grid=grid,
        in_specs=[pl.BlockSpec((bt, d), lambda j, i: (i, 0)), w_block]
        + [pl.BlockSpec((bt, 1), lambda j, i: (i, 0))] * 5,
        out_specs=w_block,
        out_shape=jax.ShapeDtypeStruct(w_DxV.shape, w_DxV.dtype),
        scratch_shapes=[pltpu.VMEM((d, bv), jnp.float32)],
        compiler_params=params,
        name="logprob_dw_tpu",
        interpret=interpret,
    )(h, w_DxV, *rows_dw)
    return dh[:t], dw
