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

A packing may hold several groups (`make_packing(groups=S)`): the rows of
the batch split into S equal blocks, each packed into M rows of its own.
Packed arrays are `[S, M, ...]` (S = 1 for one group). On a mesh the groups
are the data shards (`rl.logprobs.pack_groups`): each device packs and
computes its own rows, and the moves run per device (`kernels.dispatch.
per_shard`: XLA's partitioner otherwise gathers a head-sharded operand whole
onto every device first).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_lp.kernels.dispatch import per_shard

__all__ = ["Packing", "bucket_rows", "gather_rows", "make_packing", "pack", "unpack"]


class Packing(NamedTuple):
    """Which slots of a `[B, T]` grid are computed as packed rows, and where each one sits.

    One group (`make_packing(groups=1)`):
    index_M: [M] int32 flat slot (`b * T + t`) of each packed row: the real
      slots in order, then padding slots up to M.
    slot_S: [B * T] int32 packed row of each flat slot, M where it is not packed.

    S groups: `index_M` is [S, M] and `slot_S` is [S, B * T / S], each group's
    own, over the flat slots of its B / S rows.
    """

    index_M: jax.Array
    slot_S: jax.Array

    @property
    def rows(self) -> int:
        """M, the packed rows of each group."""
        return self.index_M.shape[-1]

    @property
    def groups(self) -> int:
        """S, the groups (blocks of rows packed apart)."""
        return 1 if self.index_M.ndim == 1 else self.index_M.shape[0]


def bucket_rows(count: int, total: int, buckets: int) -> int:
    """`count` rounded up to a multiple of `ceil(total / buckets)`, at most `total`.

    At most `buckets` distinct values (so compilations) per grid size, and at
    most `total / buckets` padding rows computed.
    """
    if not 0 <= count <= total:
        raise ValueError(f"bucket_rows: count {count} is not in [0, {total}]")
    step = max(1, math.ceil(total / max(buckets, 1)))
    return min(total, max(step, math.ceil(count / step) * step))


def make_packing(real_BxT: jax.Array, rows: int, groups: int = 1) -> tuple[Packing, jax.Array]:
    """The packing of the real slots of `real_BxT` into `rows` rows, and whether all fit ([] bool).

    Real slots come first, in grid order, then padding slots in grid order up
    to `rows` (a static int, at most B * T). When more than `rows` slots are
    real the packing drops the last ones and the flag is False: callers turn
    their results into NaN then (`rl.logprobs.dense_logprobs`). With `groups`
    = S > 1 each block of B / S rows is packed apart into `rows` rows of its
    own (`rows` at most B * T / S), and the flag says whether every block fit.
    """
    b = real_BxT.shape[0]
    if groups < 1 or b % groups:
        raise ValueError(f"make_packing: groups={groups} must be >= 1 and divide the {b} rows")
    flat = real_BxT.reshape(groups, -1)
    if not 0 < rows <= flat.shape[1]:
        raise ValueError(f"make_packing: rows={rows} must be in [1, {flat.shape[1]}] "
                         f"(B * T{'' if groups == 1 else ' / groups'})")
    if groups == 1:
        return _pack_one(flat[0], rows)
    rows_axes = ("batch", None)
    packing, fits = per_shard(jax.vmap(lambda f: _pack_one(f, rows)), (rows_axes,),
                              (Packing(rows_axes, rows_axes), ("batch",)))(flat)
    return packing, jnp.all(fits)


def _pack_one(flat: jax.Array, rows: int) -> tuple[Packing, jax.Array]:
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


def pack(x_BxTx: jax.Array, packing: Packing, axes: tuple = ()) -> jax.Array:
    """The packed rows of a `[B, T, ...]` array: `[S, M, ...]` (S = 1 for one group).

    `axes`: the logical axes of the trailing dimensions (`parallel.rules`;
    default whole), so that under a mesh each device moves its own shard.
    """
    b, t = x_BxTx.shape[:2]
    rest = x_BxTx.shape[2:]
    if packing.index_M.ndim == 1:
        return gather_rows(x_BxTx.reshape(b * t, *rest), packing.index_M, packing.slot_S)[None]
    g = packing.groups
    return _per_group(x_BxTx.reshape(g, b * t // g, *rest), packing.index_M, packing.slot_S,
                      axes or (None,) * len(rest))


def unpack(x_SxMx: jax.Array, packing: Packing, b: int, t: int, axes: tuple = ()) -> jax.Array:
    """Packed rows `[S, M, ...]` back on the `[B, T, ...]` grid, zeros at the slots not packed.

    `axes`: as `pack`'s.
    """
    if packing.index_M.ndim == 1:
        out = gather_rows(x_SxMx[0], packing.slot_S, packing.index_M)
    else:
        out = _per_group(x_SxMx, packing.slot_S, packing.index_M,
                         axes or (None,) * (x_SxMx.ndim - 2))
    return out.reshape(b, t, *x_SxMx.shape[2:])


def _per_group(x_SxNx, index_SxM, inverse_SxN, axes: tuple):
    """`gather_rows` within each group, each device on its own groups under a mesh."""
    rows = ("batch", None)
    return per_shard(jax.vmap(gather_rows), (rows + axes, rows, rows), rows + axes)(
        x_SxNx, index_SxM, inverse_SxN)
