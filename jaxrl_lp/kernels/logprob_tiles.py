"""The tile maths of the fused log-prob read-out, shared by its reference and its kernels.

`kernels.logprob` (the reference scan and the dispatch) and the platform kernels
(`kernels.logprob_gpu`, `kernels.logprob_tpu`) all compute a tile with these
functions, so every implementation rounds alike; none of those modules imports
another to get them. The algorithm: `kernels.logprob`'s module docstring.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["NEG", "LogprobPlan", "Running", "running_finish", "running_init", "running_merge",
           "running_update", "tempered", "tile_dlogits"]

NEG = -1e30  # the running max before any tile: finite, so (m - m') * 0 is 0, not NaN


class LogprobPlan(NamedTuple):
    """The static description of one fused call (hashable: a `custom_vjp` static)."""

    temperature: float
    logits_dtype: np.dtype  # z is rounded to it (and dz, as autodiff of the rounding does)
    block_t: int  # rows per GPU kernel program
    block_v: int  # vocabulary columns per tile (the reference scan's and the GPU kernel's)
    block_d: int  # hidden columns per GPU matmul chunk (divides D)
    impl: str  # `reference`, `cuda` (the Triton kernels), `tpu` (the Mosaic TPU kernels) or
    # `mosaic` (the Mosaic GPU forward, `tiled_readout`'s)
    interpret: bool = False  # the kernel in Pallas interpret mode
    tpu: tuple | None = None  # the TPU kernels' `logprob_tpu.TpuLogprobTiles` (impl `tpu`)


class Running(NamedTuple):
    """Online statistics of the tempered logits over the vocabulary tiles seen so far."""

    m: jax.Array  # [T] running max of s
    l: jax.Array  # [T] sum exp(s - m)
    a: jax.Array  # [T] sum exp(s - m) (s - m)
    c: jax.Array  # [T] s of the chosen token (0 until its tile is seen)


def running_init(t: int) -> Running:
    z = jnp.zeros((t,), jnp.float32)
    return Running(jnp.full((t,), NEG, jnp.float32), z, z, z)


def tempered(acc_TxW: jax.Array, plan: LogprobPlan) -> jax.Array:
    """s = round_logits(acc) / tau, f32."""
    z = acc_TxW.astype(plan.logits_dtype).astype(jnp.float32)
    return z / plan.temperature


def _by_row(x_T: jax.Array, shape) -> jax.Array:
    """`x_T` broadcast along the columns of a `[T, W]` tile (`broadcast_in_dim`: a Mosaic GPU
    kernel's registers take no `[T, 1]` reshape)."""
    return jax.lax.broadcast_in_dim(x_T, shape, (0,))


def running_update(run: Running, s_TxW: jax.Array, v0, tokens_T: jax.Array,
                   iota_TxW: jax.Array | None = None) -> Running:
    """`run` after the tile `s_TxW` of columns `[v0, v0 + W)`; `iota_TxW` the tile's column
    indices from 0 (default `broadcasted_iota`; a Mosaic GPU kernel passes its own, laid out
    as its registers)."""
    if iota_TxW is None:
        iota_TxW = jax.lax.broadcasted_iota(jnp.int32, s_TxW.shape, 1)
    cols = v0 + iota_TxW
    m = jnp.maximum(run.m, jnp.max(s_TxW, axis=1))
    scale = jnp.exp(run.m - m)
    d = s_TxW - _by_row(m, s_TxW.shape)
    e = jnp.exp(d)
    return Running(m, run.l * scale + jnp.sum(e, axis=1),
                   scale * (run.a + (run.m - m) * run.l) + jnp.sum(e * d, axis=1),
                   run.c + jnp.sum(jnp.where(cols == _by_row(tokens_T, s_TxW.shape), s_TxW, 0.0),
                                   axis=1))


def running_merge(parts: Running) -> Running:
    """One row's statistics from those of disjoint ranges of its columns, `[P, T]` each (the
    same rescaling as `running_update`, applied across the ranges; a range with no column
    holds `running_init`'s values and adds nothing)."""
    m = jnp.max(parts.m, axis=0)
    scale = jnp.exp(parts.m - m)
    return Running(m, jnp.sum(parts.l * scale, axis=0),
                   jnp.sum(scale * (parts.a + (parts.m - m) * parts.l), axis=0),
                   jnp.sum(parts.c, axis=0))


def running_finish(run: Running, mask_T: jax.Array):
    """(logp, entropy, lse, E_p s) per row; masked rows give log-prob and entropy 0."""
    log_l = jnp.log(run.l)
    mean_rel = run.a / run.l  # E_p[s] - m
    lp = jnp.where(mask_T, run.c - (run.m + log_l), 0.0)
    ent = jnp.where(mask_T, log_l - mean_rel, 0.0)
    return lp, ent, run.m + log_l, run.m + mean_rel


def tile_dlogits(s_TxW, v0, tokens_T, lse_T, mean_T, g_lp_T, g_ent_T, plan: LogprobPlan):
    """The cotangent of one tile's f32 accumulator [T, W] (module docstring)."""
    cols = v0 + jax.lax.broadcasted_iota(jnp.int32, s_TxW.shape, 1)
    p = jnp.exp(s_TxW - lse_T[:, None])
    onehot = jnp.where(cols == tokens_T[:, None], 1.0, 0.0)
    ds = g_lp_T[:, None] * (onehot - p) - g_ent_T[:, None] * p * (s_TxW - mean_T[:, None])
    return (ds / plan.temperature).astype(plan.logits_dtype).astype(jnp.float32)
