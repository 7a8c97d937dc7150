"""MX block quantize and dequantize (MXFP8, MXFP4, NVFP4) as Pallas kernels.

The jnp reference is `jaxrl_lp.numerics.formats.quantize` / `qarray.dequantize`;
the kernels compute the same codes, scales and values bit for bit.

Algorithm. A tensor is viewed, without moving data, as `[P, N, Q]`: `P` the
product of the axes before the reduction axis, `N` its length (a multiple of
the block size `bs`), `Q` the product of the axes after it (`[P, N]` when
`Q == 1`, the activation case). The grid tiles the view by `(tp, tn, tq)` with
`tn` a whole number of blocks, so no block crosses a tile. Each tile is
reshaped to `(tp, tn/bs, bs, tq)` and handed to the reference's own per-block
maths (`formats.mx_block_values`, `formats.nvfp4_block_values`): the block
amax, the scale rounded as the reference rounds it, the scaled and saturated
values; the kernel then casts them to the element dtype (RNE) and the scales
to E8M0 / E4M3. Tiles are independent, so a ragged last tile along any axis
computes on padding that is never written back. NVFP4's f32 tensor scale is a
reduction over whole tensors: it is computed first by the reference's
`nvfp4_tensor_scale`, broadcast to one value per block and read beside the
block. Dequantize uses the same tiling: `f32(code) * f32(scale)` (NVFP4:
`f32(code) * (f32(s_b) * s_t)`, the reference's order).

Per-tensor formats (`fp8`, `fp8_e5m2`, `ternary`, `binary`) have no kernel:
they always run the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# The module, not its names: `numerics` imports this file (fake_quant) while `dispatch`
# may still be importing `numerics.policy`.
from jaxrl_lp.kernels import dispatch
from jaxrl_lp.numerics import formats
from jaxrl_lp.numerics.policy import KERNEL_MODES, PRESETS, Policy
from jaxrl_lp.numerics.qarray import QArray, get_format
from jaxrl_lp.numerics.qarray import dequantize as dequantize_reference

__all__ = ["DEFAULT_TILES", "QuantTiles", "dequantize", "kernels_mode", "quantize"]


class QuantTiles(NamedTuple):
    """Tile of the `[P, N, Q]` view: `rows` of P, `blocks` scale blocks of N, `cols` of Q."""

    rows: int = 32
    blocks: int = 8
    cols: int = 128


DEFAULT_TILES = QuantTiles()


def kernels_mode(kernels: str | Policy) -> str:
    """The kernels mode (`auto`, `on`, `off`, `interpret`) of a mode name, policy or policy string."""
    if isinstance(kernels, Policy):
        return kernels.kernels
    if isinstance(kernels, str) and kernels in KERNEL_MODES:
        return kernels
    if isinstance(kernels, str) and ("=" in kernels or kernels.partition(",")[0] in PRESETS):
        return Policy.parse(kernels).kernels
    raise ValueError(f"kernels {kernels!r} is not one of {list(KERNEL_MODES)} (or a policy)")


def _choice(kernels: str | Policy) -> str:
    return dispatch.choose(Policy(kernels=kernels_mode(kernels)), "quantize")


def quantize(x: jax.Array, fmt: str, axis: int = 0, batch_axes: Sequence[int] = (), *,
             kernels: str | Policy = "auto", tiles: QuantTiles = DEFAULT_TILES) -> QArray:
    """`formats.quantize` (same arguments, same `QArray` bit for bit), by the kernel where chosen.

    Args:
      x: floating array.
      fmt: a key of `FORMATS`; the block formats (`mxfp8`, `mxfp4`, `nvfp4`) have a kernel.
      axis: the reduction axis; its length must be a multiple of the block size.
      batch_axes: axes of independent tensors (only the NVFP4 tensor scale reads them).
      kernels: a kernels mode, or a policy whose `kernels` field is read
        (`kernels.dispatch.choose`: `auto` runs the reference on CPU).
      tiles: the kernel's tile (`QuantTiles`).

    Returns:
      The `QArray` of `formats.quantize(x, fmt, axis, batch_axes)`.

    Raises:
      KernelUnavailableError: `kernels=on` on a backend without Pallas.
      ValueError: the block size does not divide the reduction axis (naming the
        shape and the block size), or another bad axis.

    Example:
      >>> q = quantize(jnp.ones((33, 64)), "mxfp8", axis=1, kernels="interpret")
    """
    spec = get_format(fmt)
    choice = _choice(kernels)
    if choice == "reference" or not spec.is_block or jnp.size(x) == 0:
        return formats.quantize(x, fmt, axis, batch_axes)
    # The reference's own validation, so both raise the same errors (block size, axes).
    axis, batch = formats._normalize_axes(jnp.shape(x), axis, batch_axes, spec)
    x = jnp.asarray(x)
    bs, shape = spec.block_size, x.shape
    view, sview = _views(shape, axis, bs)
    if _fit(choice, kernels, view, bs, tiles, "quantize") == "reference":
        return formats.quantize(x, fmt, axis, batch_axes)
    nvfp4 = spec.scale_kind == "block_e4m3_tensor_f32"
    operands, tscale = [x.reshape(view)], None
    if nvfp4:
        reduce_axes = tuple(i for i in range(x.ndim) if i not in batch)
        # Upcast: the tensor scale is computed from f32 values, as in the reference.
        tscale = formats.nvfp4_tensor_scale(x.astype(jnp.float32), reduce_axes)
        block_shape = shape[:axis] + (shape[axis] // bs,) + shape[axis + 1:]
        operands.append(jnp.broadcast_to(tscale, block_shape).reshape(sview))
    scale_dtype = jnp.float8_e4m3fn if nvfp4 else jnp.float8_e8m0fnu
    out_shape = (jax.ShapeDtypeStruct(view, spec.element_dtype),
                 jax.ShapeDtypeStruct(sview, scale_dtype))
    grid, xspec, sspec = _specs(view, bs, tiles)
    codes, scales = pl.pallas_call(
        lambda *refs: _quantize_kernel(*refs, spec=spec, nvfp4=nvfp4),
        out_shape=out_shape, grid=grid,
        in_specs=[xspec] + ([sspec] if nvfp4 else []), out_specs=(xspec, sspec),
        interpret=choice == "interpret", name=f"{fmt}_quantize",
    )(*operands)
    scales = scales.reshape(shape[:axis] + (shape[axis] // bs,) + shape[axis + 1:])
    return QArray(codes.reshape(shape), scales, fmt, axis, batch, tscale)


def dequantize(q: QArray, *, kernels: str | Policy = "auto",
               tiles: QuantTiles = DEFAULT_TILES) -> jax.Array:
    """`qarray.dequantize` (the f32 value, bit for bit), by the kernel where chosen.

    Args:
      q: a quantized tensor; block formats have a kernel.
      kernels: a kernels mode or a policy (as `quantize`).
      tiles: the kernel's tile (`QuantTiles`).

    Returns:
      f32 array of `q.shape`.
    """
    spec = q.spec
    choice = _choice(kernels)
    if choice == "reference" or not spec.is_block or q.codes.size == 0:
        return dequantize_reference(q)
    bs, shape = spec.block_size, q.shape
    view, sview = _views(shape, q.axis, bs)
    if _fit(choice, kernels, view, bs, tiles, "dequantize") == "reference":
        return dequantize_reference(q)
    operands = [q.codes.reshape(view), q.scales.reshape(sview)]
    if q.tensor_scale is not None:
        operands.append(jnp.broadcast_to(q.tensor_scale, q.scales.shape).reshape(sview))
    grid, xspec, sspec = _specs(view, bs, tiles)
    out = pl.pallas_call(
        lambda *refs: _dequantize_kernel(*refs, bs=bs),
        out_shape=jax.ShapeDtypeStruct(view, jnp.float32), grid=grid,
        in_specs=[xspec] + [sspec] * (len(operands) - 1), out_specs=xspec,
        interpret=choice == "interpret", name=f"{q.format}_dequantize",
    )(*operands)
    return out.reshape(shape)


def _views(shape: tuple[int, ...], axis: int, bs: int):
    """The `[P, N, Q]` (or `[P, N]`) view of the values and the `[P, N/bs, Q]` view of the scales."""
    p, n, q = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    if q == 1:
        return (p, n), (p, n // bs)
    return (p, n, q), (p, n // bs, q)


def _fit(choice: str, kernels: str | Policy, view: tuple[int, ...], bs: int, tiles: QuantTiles,
         name: str) -> str:
    """`choice`, or `reference` where the compiled tile is not all powers of two (Triton)."""
    tile = _tile(view, bs, tiles)
    misfit = dispatch.pow2_misfit(1, **{f"tile[{i}]": n for i, n in enumerate(tile)})
    return dispatch.within_limits(choice, Policy(kernels=kernels_mode(kernels)), name, misfit)


def _tile(view: tuple[int, ...], bs: int, tiles: QuantTiles) -> list[int]:
    """The value tile of the view (a dim smaller than its tile is whole)."""
    tile = [min(view[0], tiles.rows), min(view[1] // bs, tiles.blocks) * bs]
    return tile + [min(view[2], tiles.cols)] if len(view) == 3 else tile


def _specs(view: tuple[int, ...], bs: int, tiles: QuantTiles):
    """Grid and block specs of the values and the scales (a dim smaller than its tile is whole)."""
    tile = _tile(view, bs, tiles)
    stile = [tile[0], tile[1] // bs, *tile[2:]]
    grid = tuple(pl.cdiv(d, t) for d, t in zip(view, tile, strict=True))
    index = lambda *ij: ij
    return grid, pl.BlockSpec(tuple(tile), index), pl.BlockSpec(tuple(stile), index)


def _split_blocks(x: jax.Array, bs: int) -> jax.Array:
    """A tile `(tp, tn, [tq])` as `(tp, tn/bs, bs, [tq])`: one block per index of axis 1."""
    return x.reshape(x.shape[0], x.shape[1] // bs, bs, *x.shape[2:])


def _quantize_kernel(*refs, spec, nvfp4: bool):
    """One tile: per-block scales and element codes by the reference's per-block maths."""
    if nvfp4:
        x_ref, st_ref, codes_ref, scales_ref = refs
    else:
        x_ref, codes_ref, scales_ref = refs
    # Upcast: scales and codes are computed from f32 values (exact for bf16/f16).
    x = x_ref[...].astype(jnp.float32)
    xb = _split_blocks(x, spec.block_size)
    if nvfp4:
        y, scale = formats.nvfp4_block_values(xb, st_ref[...], 2)
    else:
        y, scale = formats.mx_block_values(xb, spec, 2)
    # Rounding sites: RNE to the element dtype; the scales are exact in theirs.
    codes_ref[...] = y.reshape(x.shape).astype(codes_ref.dtype)
    scales_ref[...] = scale.astype(scales_ref.dtype)


def _dequantize_kernel(*refs, bs: int):
    """One tile: `f32(code) * f32(scale)`, NVFP4 `f32(code) * (f32(s_b) * s_t)`."""
    codes_ref, scales_ref, *ts_ref, out_ref = refs
    # Upcast: codes and scales are exact in f32.
    c = codes_ref[...].astype(jnp.float32)
    s = scales_ref[...].astype(jnp.float32)
    if ts_ref:
        s = s * ts_ref[0][...]
    out_ref[...] = (_split_blocks(c, bs) * jnp.expand_dims(s, 2)).reshape(c.shape)
