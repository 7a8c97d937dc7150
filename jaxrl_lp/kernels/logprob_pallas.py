"""The Pallas kernels of the fused log-prob (`kernels.logprob`: maths, reference, entry point).

Three kernels share the tile maths of `kernels.logprob` (`running_update`,
`tile_dlogits`), so they differ from the reference only in where they sum:

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
passed whole (`pl.no_block_spec`) and sliced in the kernel. Written for the
GPU (Triton) lowering and checked on CPU in interpret mode; not run on a
device here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrl_lp.kernels.logprob import (
    LogprobPlan,
    running_finish,
    running_init,
    running_update,
    tempered,
    tile_dlogits,
)

__all__ = ["kernel_backward", "kernel_forward"]

_HI = jax.lax.Precision.HIGHEST
_CONTRACT_V = (((1,), (1,)), ((), ()))  # dz [t, V] . W [d, V] -> [t, d]
_CONTRACT_T = (((0,), (0,)), ((), ()))  # h [t, d] . dz [t, V] -> [d, V]


def _chunks(d: int, plan: LogprobPlan, body, init):
    """`body(d0, carry)` over the hidden axis in chunks of `block_d` (a `fori_loop`)."""
    bd = plan.block_d
    return jax.lax.fori_loop(0, d // bd, lambda k, c: body(pl.multiple_of(k * bd, bd), c), init)


def _logits(h_ref, w_ref, rows, v0, width: int, plan: LogprobPlan):
    """Tempered logits `[block_t, width]` of `h_ref[rows]` at columns `[v0, v0 + width)`."""
    bd = plan.block_d

    def chunk(d0, acc):
        return acc + jnp.dot(h_ref[rows, pl.ds(d0, bd)], w_ref[pl.ds(d0, bd), pl.ds(v0, width)],
                             preferred_element_type=jnp.float32, precision=_HI)

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
            dh_ref[:, pl.ds(d0, bd)] += jax.lax.dot_general(
                dz, w_ref[pl.ds(d0, bd), pl.ds(v0, width)], _CONTRACT_V,
                preferred_element_type=jnp.float32, precision=_HI)
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
                dw_ref[pl.ds(d0, bd), pl.ds(v0, width)] += jax.lax.dot_general(
                    h_ref[rs, pl.ds(d0, bd)], dz, _CONTRACT_T,
                    preferred_element_type=jnp.float32, precision=_HI)
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


def _call(kernel, plan: LogprobPlan, grid, in_specs, out_specs, out_shape, *args):
    return pl.pallas_call(functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          interpret=plan.impl == "interpret")(*args)


def kernel_forward(h_TxD, w_DxV, tokens_T, mask_T, plan: LogprobPlan):
    """`reference_forward` by the forward kernel: (logp, entropy, lse, E_p s), each [T] f32."""
    t, d = h_TxD.shape
    h, tokens, mask = _pad_rows(plan, h_TxD, tokens_T, mask_T.astype(jnp.int32))
    row = pl.BlockSpec((plan.block_t,), lambda i: (i,))
    f32 = jax.ShapeDtypeStruct(tokens.shape, jnp.float32)
    outs = _call(_fwd_kernel, plan, (h.shape[0] // plan.block_t,),
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
    dh = _call(_dh_kernel, plan, (rows // plan.block_t,), [block, pl.no_block_spec] + [row] * 5,
               block, jax.ShapeDtypeStruct((rows, d), jnp.float32), padded[0], w_DxV, *padded[1:])
    whole = pl.no_block_spec
    dw = _call(_dw_kernel, plan, (pl.cdiv(v, plan.block_v),), [whole] * 7, whole,
               jax.ShapeDtypeStruct((d, v), jnp.float32), padded[0], w_DxV, *padded[1:])
    return dh[:t].astype(h_TxD.dtype), dw.astype(w_DxV.dtype)
