"""Padding-free token layouts: the real tokens of a `[B, T]` batch as `M` packed rows.

A GRPO batch is mostly padding at its ends: prompts are left-padded,
completions right-padded after EOS. Every op of a decoder except attention
works token by token, so the learner's dense forward runs them on the real
tokens only (`Packing`), and attention on the `[B, T]` grid, where the
tokens are put back with zeros at the padding (which no real query sees:
padding is masked, or lies after the row's last real token).

`M` is static (a jit recompiles for each value), so callers round the real
count up to one of a few buckets (`bucket_rows`): the rows past the real
tokens are padding slots, computed and never read.

Both moves are gathers, and so are their gradients (`gather_rows`): each row
is taken at most once, so the transpose of "take row `index[m]`" is "take
back row `inverse[i]`", with no scatter (which XLA on CPU runs one element
at a time).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Packing", "bucket_rows", "gather_rows", "make_packing", "pack", "unpack"]


class Packing(NamedTuple):
    """Which slots of a `[B, T]` grid are computed as packed rows, and where each one sits.

    index_M: [M] int32 flat slot (`b * T + t`) of each packed row: the real
      slots in order, then padding slots up to M.
    slot_S: [B * T] int32 packed row of each flat slot, M where it is not packed.
    """

    index_M: jax.Array
    slot_S: jax.Array

    @property
    def rows(self) -> int:
        return self.index_M.shape[0]


def bucket_rows(count: int, total: int, buckets: int) -> int:
    """`count` rounded up to a multiple of `ceil(total / buckets)`, at most `total`.

    At most `buckets` distinct values (so compilations) per grid size, and at
    most `total / buckets` padding rows computed.
    """
    if not 0 <= count <= total:
        raise ValueError(f"bucket_rows: count {count} is not in [0, {total}]")
    step = max(1, math.ceil(total / max(buckets, 1)))
    return min(total, max(step, math.ceil(count / step) * step))


def make_packing(real_BxT: jax.Array, rows: int) -> tuple[Packing, jax.Array]:
    """The packing of the real slots of `real_BxT` into `rows` rows, and whether all fit ([] bool).

    Real slots come first, in grid order, then padding slots in grid order up
    to `rows` (a static int, at most B * T). When more than `rows` slots are
    real the packing drops the last ones and the flag is False: callers turn
    their results into NaN then (`rl.logprobs.dense_logprobs`).
    """
    flat = real_BxT.reshape(-1)
    if not 0 < rows <= flat.shape[0]:
        raise ValueError(f"make_packing: rows={rows} must be in [1, {flat.shape[0]}] (B * T)")
    order = jnp.argsort(~flat, stable=True).astype(jnp.int32)  # real slots first, in order
    place = jnp.argsort(order).astype(jnp.int32)  # the inverse permutation
    slot = jnp.where(place < rows, place, rows).astype(jnp.int32)
    return Packing(order[:rows], slot), jnp.sum(flat) <= rows


@jax.custom_vjp
def gather_rows(x_NxF: jax.Array, index_M: jax.Array, inverse_N: jax.Array) -> jax.Array:
    """Rows `index_M` of `x_NxF` ([M, ...]; an index of N or more gives a zero row).

    No row of `x` may be taken twice; `inverse_N[i]` is the output row that
    took row i (M or more if none). The gradient is then the same kind of
    gather, `gather_rows(g_MxF, inverse_N, index_M)`, exactly the transpose.
    """
    return jnp.take(x_NxF, index_M, axis=0, mode="fill", fill_value=0)


def _gather_rows_fwd(x_NxF, index_M, inverse_N):
    return jnp.take(x_NxF, index_M, axis=0, mode="fill", fill_value=0), inverse_N


def _gather_rows_bwd(inverse_N, g_MxF):
    return jnp.take(g_MxF, inverse_N, axis=0, mode="fill", fill_value=0), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def pack(x_BxTx: jax.Array, packing: Packing) -> jax.Array:
    """The packed rows of a `[B, T, ...]` array: `[M, ...]`."""
    b, t = x_BxTx.shape[:2]
    return gather_rows(x_BxTx.reshape(b * t, *x_BxTx.shape[2:]), packing.index_M, packing.slot_S)


def unpack(x_Mx: jax.Array, packing: Packing, b: int, t: int) -> jax.Array:
    """Packed rows back on the `[B, T, ...]` grid, zeros at the slots not packed."""
    out = gather_rows(x_Mx, packing.slot_S, packing.index_M)
    return out.reshape(b, t, *x_Mx.shape[1:])
