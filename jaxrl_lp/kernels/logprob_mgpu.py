"""The fused log-prob's forward on Mosaic GPU (`plgpu.kernel`, Hopper's `wgmma`): the port of
`kernels.logprob_gpu`'s forward to JAX's maintained GPU backend.

`kernels.logprob` holds the maths (its module docstring) and `logprob_tiles` the tile
functions every implementation shares, so this kernel differs from the reference only in
where it sums. A grid of (row blocks of 64, vocabulary splits) thread blocks, one
warpgroup each:

- each program takes its 64 rows (`h`, padded with zero rows to a multiple of 64) and a
  contiguous range of the vocabulary's tiles of 128 columns; per tile it computes the
  logits `[64, 128]` in a register accumulator, `wgmma` over the hidden axis in chunks of 64
  (`plgpu.emit_pipeline`: `h`'s and `W`'s chunks through shared memory, two stages deep),
  and folds them into its rows' online statistics (`running_update`);
- it writes its statistics (max, sum of exp, the entropy's sum, the chosen token's logit)
  for its range; XLA merges the ranges of each row (`running_merge`) and finishes
  (`running_finish`): log-prob, entropy and the backward's two residuals.

The vocabulary is split so that the grid holds at least `MIN_PROGRAMS` thread blocks (two
per SM of a 132-SM Hopper): a read-out of 4,096 rows is 64 row blocks, which alone would
leave half of an H100's SMs idle. Every program streams its range of `W` once per row
block; `W` is not copied.

Operands: `h` and `W` of one 2-byte dtype (bf16, f16): `wgmma` reads f32 as tf32, which is
not an f32 product (`misfit`). The hidden size a multiple of 64 and the vocabulary a
multiple of 128 (Qwen3's 151,936 and Ouro's 49,152 are), else `misfit` says why and the
caller takes XLA's read-out. The logits are rounded to the policy's logits dtype
(`tempered`), as everywhere.

`interpret=True` runs it in Mosaic GPU's interpreter (any host; what the CPU tests check at
small shapes). That interpreter (JAX 0.10) has no rule for layout casts, so the interpreted
body leaves out the register layouts (`plgpu.layout_cast`, the layout of the column iota),
which say how a compiled program holds a value, not what it computes.

The backward is not here: `kernels.logprob.tiled_readout(..., forward="mosaic")` pairs this
forward with XLA's tiled backward. Not in compiled use (docs/design/kernels.md, "Kernels
on GPU and TPU"): `jaxrl-lp bench kernels --kernels retired` times it on a GPU against
XLA's read-out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_lp.kernels.logprob_tiles import (
    LogprobPlan,
    Running,
    running_finish,
    running_init,
    running_merge,
    running_update,
    tempered,
)

__all__ = ["MGPU_TILES", "MIN_PROGRAMS", "mgpu_forward", "misfit", "splits"]

# (rows, vocabulary columns, hidden columns) per step: `wgmma`'s warpgroup row tile, a
# 128-column logits tile (64 f32 registers a thread), the 128-byte swizzle of a 2-byte dtype.
MGPU_TILES = (64, 128, 64)
MIN_PROGRAMS = 264


def misfit(d: int, v: int, h_dtype, w_dtype) -> str | None:
    """Why the Mosaic GPU forward cannot take `h [T, d]` and `W [d, v]`, or None."""
    h_dtype, w_dtype = np.dtype(h_dtype), np.dtype(w_dtype)
    _, bv, bd = MGPU_TILES
    if h_dtype != w_dtype:
        return f"its operands are of one dtype, not {h_dtype} and {w_dtype}"
    if h_dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
        return (f"its operands are bf16 or f16, not {h_dtype} (Hopper's wgmma reads f32 as "
                "tf32, which is not an f32 product)")
    if d % bd:
        return f"the hidden size {d} is not a multiple of {bd}"
    if v % bv:
        return f"the vocabulary {v} is not a multiple of {bv}"
    return None


def splits(rows: int, v: int) -> int:
    """How many contiguous ranges the vocabulary's tiles are split into for `rows` rows:
    enough that the grid holds `MIN_PROGRAMS` thread blocks, at most one tile each."""
    bt, bv, _ = MGPU_TILES
    blocks = -(-rows // bt)
    return max(1, min(v // bv, -(-MIN_PROGRAMS // blocks)))


def mgpu_forward(h_TxD: jax.Array, w_DxV: jax.Array, tokens_T: jax.Array, mask_T: jax.Array,
                 plan: LogprobPlan, interpret: bool = False):
    """`reference_forward` by the Mosaic GPU kernel (module docstring): (logp, entropy, lse,
    E_p s), each `[T]` f32. The operands must pass `misfit`."""
    (t, d), v = h_TxD.shape, w_DxV.shape[1]
    if (why := misfit(d, v, h_TxD.dtype, w_DxV.dtype)) is not None:
        raise ValueError(f"mgpu_forward: {why}")
    bt, bv, bd = MGPU_TILES
    rows = -(-t // bt) * bt
    pad = ((0, rows - t),)
    h = jnp.pad(h_TxD, pad + ((0, 0),))
    tokens = jnp.pad(tokens_T.astype(jnp.int32), pad)
    n_split, n_tiles = splits(rows, v), v // bv
    per_split = -(-n_tiles // n_split)
    itemsize = np.dtype(h.dtype).itemsize
    swizzle = plgpu.find_swizzle(bd * itemsize * 8)
    smem_layout = (plgpu.TilingTransform((8, swizzle // itemsize)),
                   plgpu.SwizzleTransform(swizzle))
    per_row = plgpu.Layout.WGMMA.reduce(1)
    if interpret:  # the interpreter has no layout casts (module docstring)
        as_rows = lambda x: x
        columns = lambda: jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
    else:
        as_rows = lambda x: plgpu.layout_cast(x, per_row)
        columns = lambda: plgpu.broadcasted_iota(jnp.int32, (bt, bv), 1,
                                                 layout=plgpu.Layout.WGMMA)

    def logprob_fwd(h_gmem, w_gmem, tok_gmem, out_gmem, tok_smem, out_smem, barrier):
        i, part = jax.lax.axis_index("t"), jax.lax.axis_index("v")
        plgpu.copy_gmem_to_smem(tok_gmem.at[pl.ds(i * bt, bt)], tok_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        chosen = as_rows(tok_smem[...])

        def vocabulary_tile(j, run: Running) -> Running:
            def logits(acc):
                def step(_, h_smem, w_smem):
                    plgpu.wgmma(acc, h_smem, w_smem)
                    plgpu.wgmma_wait(1)  # the next chunk's copy overlaps this product

                plgpu.emit_pipeline(
                    step, grid=(d // bd,), max_concurrent_steps=2,
                    in_specs=[plgpu.BlockSpec((bt, bd), lambda k: (i, k),
                                              transforms=smem_layout, delay_release=1),
                              plgpu.BlockSpec((bd, bv), lambda k: (k, j),
                                              transforms=smem_layout, delay_release=1)],
                )(h_gmem, w_gmem)
                return acc[...]

            z = pl.run_scoped(logits, plgpu.ACC((bt, bv), jnp.float32))
            return running_update(run, tempered(z, plan), j * bv, chosen, columns())

        first = part * per_split
        run = jax.lax.fori_loop(first, jnp.minimum(n_tiles, first + per_split), vocabulary_tile,
                                Running(*map(as_rows, running_init(bt))))
        for k, stat in enumerate(run):
            out_smem[k] = stat
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[part, :, pl.ds(i * bt, bt)])
        plgpu.wait_smem_to_gmem(0)

    options = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        options["interpret"] = InterpretGPUParams()
    parts = plgpu.kernel(
        logprob_fwd, out_type=jax.ShapeDtypeStruct((n_split, len(Running._fields), rows), jnp.float32),
        scratch_types={"tok_smem": plgpu.SMEM((bt,), jnp.int32),
                       "out_smem": plgpu.SMEM((len(Running._fields), bt), jnp.float32),
                       "barrier": plgpu.Barrier(num_barriers=1)},
        grid=(rows // bt, n_split), grid_names=("t", "v"), **options)(h, w_DxV, tokens)
    run = running_merge(Running(*(parts[:, k, :t] for k in range(len(Running._fields)))))
    return running_finish(run, mask_T)
