"""MX block quantize and dequantize (MXFP8, MXFP4, NVFP4) as Pallas kernels, for GPU and TPU.

The jnp reference is `jaxrl_lp.numerics.formats.quantize` / `qarray.dequantize`;
both kernels compute the same codes, scales and values bit for bit. What runs
is `kernels.dispatch.by_platform`'s choice (names `{fmt}_quantize`,
`{fmt}_dequantize`) for the platform the program is lowered for.

Views. A tensor is viewed, without moving data, as `[P, N, Q]`: `P` the
product of the axes before the reduction axis, `N` its length (a multiple of
the block size `bs`), `Q` the product of the axes after it; `[P, N]` when
`Q == 1` (the activation case, blocks along the last axis). A tile
(`QuantTiles`) holds `rows` of P (the `[P, N]` view; the `[P, N, Q]` view
takes one P per program, a 2-D tile), `blocks` whole scale blocks of N and
`cols` of Q, so no block crosses a tile. Tiles are independent: a ragged last
tile along any axis computes on padding that is never written back.

Maths. Each tile runs the reference's per-block maths on its blocks
(`formats.mx_block_values`; for NVFP4 `_nvfp4_values`, `nvfp4_block_values`
line for line with the E4M3 rounding of the block scale done as below).
NVFP4's f32 tensor scale is a reduction over whole tensors: computed first by
the reference's `nvfp4_tensor_scale`, it is constant along N and is read as
one value per (P, Q) index. Dequantize: `f32(code) * f32(scale)` (NVFP4
`f32(code) * (f32(s_b) * s_t)`, the reference's order).

Bit patterns. Neither compiler takes every narrow float in a kernel (Triton
has no float4 or E8M0 tensors, Mosaic TPU no 4-bit cast before v7), so the
kernels read and write `uint8` bit patterns and round in integer arithmetic
(`kernels.float_bits`); the codes and scales are bitcast outside. Nothing in a
kernel is narrower than f32 but the `uint8` in memory.

Versions (default tiles `CUDA_TILES`, `TPU_TILES`):

- cuda (Triton): `[P, N]` tiles of 32 rows x 4 blocks, `[P, N, Q]` tiles of
  1 block x 128 cols; blocks found by a reshape to `(.., N/bs, bs, ..)`;
  4 warps (8 from 4096 values a tile: about 16 a thread), 1 stage.
- tpu (Mosaic): `[P, N]` tiles of 32 rows x 128 blocks, blocks along lanes
  (a butterfly of lane rotations, a one-hot matmul); `[P, N, Q]` tiles of 32
  blocks x 128 cols, blocks along sublanes (the reshape); every grid axis
  `parallel`.

Triton blocks are powers of two (`dispatch.pow2_misfit`; a dim smaller than
its tile takes its next power of two, masked past the end). A Triton program
keeps the tile in registers; what may go through shared memory is the
scratch of a layout conversion or a cross-warp reduction, at most one f32
copy of the values and scales (`quantize_plan.cuda_misfit`: 16.5 KiB at the default MX
tiles, of 227 KiB). No loop, so nothing to pipeline: one stage. Triton's `/`
is PTX's approximate `div.full.f32`, so the compiled kernel divides NVFP4's
values by inline `div.rn.f32` (`_div_rn`), as XLA's divide does; interpreted
(an XLA program, where a division by a broadcast becomes a product with a
reciprocal) by `formats.ieee_divide`, as the reference. MX divides by powers
of two, exact either way. Mosaic's rules: a block's last two dims are whole
or multiples of (8, 128); ours are stricter for the `uint8` codes and scales
(Mosaic's native 8-bit tile is (32, 128)): rows and scale blocks along
sublanes are whole or multiples of 32, and a `[P, N]` tile's N is a multiple
of 128 (the butterfly rotates whole lanes). Mosaic cannot split lanes into
32-wide blocks (a shape cast it does not lower), so the `[P, N]` TPU kernel
finds each block's amax by a log2(bs)-step XOR butterfly of lane rotations
and gathers one scale code per block by a one-hot bf16 matmul (exact: the
codes are integers < 256); dequantize spreads them the same way. VMEM
(`quantize_plan.tpu_misfit`): the blocks, double-buffered, padded to Mosaic's tiles, plus
12 f32 tile-sized temporaries (the high side) and 10 bytes per element of the
one-hot matrix: 6.8 MiB (quantize, bf16) and 7.3 MiB (dequantize) at the
default `[P, N, Q]` MXFP8 tile, 6.2 and 6.5 MiB at `[32, 2560]` activations,
of v5's 16 MiB.

Per-tensor formats (`fp8`, `fp8_e5m2`, `ternary`, `binary`) have no kernel:
they always run the reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxrl_lp.kernels import dispatch
from jaxrl_lp.kernels import float_bits as fb
from jaxrl_lp.kernels.quantize_plan import (
    CUDA_TILES,
    TPU_TILES,
    QuantTiles,
    along,
    compiler_params,
    local_view,
    platform_versions,
    rows_axes,
    specs,
    views,
)
from jaxrl_lp.numerics import formats
from jaxrl_lp.numerics.policy import KERNEL_MODES, PRESETS, Policy, require
from jaxrl_lp.numerics.qarray import QArray, get_format
from jaxrl_lp.numerics.qarray import dequantize as dequantize_reference

__all__ = ["CUDA_TILES", "TPU_TILES", "QuantTiles", "dequantize", "kernels_mode", "quantize"]


def kernels_mode(kernels: str | Policy) -> str:
    """The kernels mode (`KERNEL_MODES`) of a mode name or a policy."""
    if isinstance(kernels, Policy):
        return kernels.kernels
    if isinstance(kernels, str) and kernels in KERNEL_MODES:
        return kernels
    if isinstance(kernels, str) and ("=" in kernels or kernels.partition(",")[0] in PRESETS):
        require(kernels, "quantize: kernels")  # a policy string: raises, naming the fix
    raise ValueError(f"kernels {kernels!r} is not one of {list(KERNEL_MODES)} (or a Policy)")


def quantize(x: jax.Array, fmt: str, axis: int = 0, batch_axes: Sequence[int] = (), *,
             kernels: str | Policy = "auto", tiles: QuantTiles | None = None,
             tpu_tiles: QuantTiles | None = None) -> QArray:
    """`formats.quantize` (same arguments, same `QArray` bit for bit), by the platform's kernel.

    Not jitted itself; every platform's version is traced (`dispatch.by_platform`).

    Args:
      x: floating array.
      fmt: a key of `FORMATS`; the block formats (`mxfp8`, `mxfp4`, `nvfp4`) have a kernel.
      axis: the reduction axis; its length must be a multiple of the block size.
      batch_axes: axes of independent tensors (only the NVFP4 tensor scale reads them).
      kernels: a kernels mode, or a policy whose `kernels` field is read
        (`auto` runs the reference when lowered for cpu).
      tiles, tpu_tiles: the cuda / tpu version's tile (default `CUDA_TILES` /
        `TPU_TILES` for the view). Under `auto` one that does not fit the
        compiled kernel is replaced by the default; interpreted, any tile runs.

    Returns:
      The `QArray` of `formats.quantize(x, fmt, axis, batch_axes)`.

    Raises:
      KernelUnavailableError: `kernels=on` lowered for cpu, or for a platform
        whose compiled kernel cannot take the shape or tile (at lowering).
      ValueError: the block size does not divide the reduction axis (naming the
        shape and the block size), or another bad axis.

    Examples:
      >>> q = quantize(jnp.ones((33, 64)), "mxfp8", axis=1, kernels="interpret")
    """
    spec, mode = get_format(fmt), kernels_mode(kernels)
    if mode == "off" or not spec.is_block or jnp.size(x) == 0:
        return formats.quantize(x, fmt, axis, batch_axes)
    # The reference's own validation, so both raise the same errors (block size, axes).
    axis, batch = formats._normalize_axes(jnp.shape(x), axis, batch_axes, spec)
    return dispatch.once_per_shape(_quantize, jnp.asarray(x), fmt=fmt, axis=axis,
                                   batch=tuple(batch), mode=mode, tiles=tiles, tpu_tiles=tpu_tiles)


def _quantize(x, *, fmt: str, axis: int, batch: tuple[int, ...], mode: str, tiles, tpu_tiles):
    """`quantize`'s dispatch, traced once per shape (`dispatch.once_per_shape`)."""
    spec = get_format(fmt)
    reference = lambda: formats.quantize(x, fmt, axis, batch)
    bs, shape = spec.block_size, x.shape
    view, sview, tview = views(shape, axis, bs)
    nvfp4 = spec.scale_kind == "block_e4m3_tensor_f32"
    operands, tscale = [x.reshape(view)], None
    if nvfp4:
        reduce_axes = tuple(i for i in range(x.ndim) if i not in batch)
        # Upcast: the tensor scale is computed from f32 values, as in the reference.
        tscale = formats.nvfp4_tensor_scale(x.astype(jnp.float32), reduce_axes)
        operands.append(jnp.broadcast_to(tscale, along(shape, axis, 1)).reshape(tview))

    def run(platform: str, tile: QuantTiles, interpret: bool) -> QArray:
        def call(*operands):
            local = operands[0].shape  # one device's rows under a mesh
            spec_x, spec_s, spec_t, grid = specs(platform, local, bs, tile)
            return pl.pallas_call(
                _kernel(_quantize_blocks_kernel, _quantize_lanes_kernel, platform, local, spec,
                        nvfp4, interpret),
                out_shape=(jax.ShapeDtypeStruct(local, jnp.uint8),
                           jax.ShapeDtypeStruct(local[:1] + sview[1:], jnp.uint8)),
                grid=grid, in_specs=[spec_x] + [spec_t] * nvfp4, out_specs=(spec_x, spec_s),
                compiler_params=compiler_params(platform, local, bs, tile), interpret=interpret,
                name=f"{fmt}_quantize",
            )(*operands)

        rows = rows_axes(view)
        codes, scales = dispatch.per_shard(call, (rows,) * len(operands), (rows, rows))(*operands)
        scale_dtype = jnp.float8_e4m3fn if nvfp4 else jnp.float8_e8m0fnu
        return QArray(fb.from_bits(codes, spec.element_dtype).reshape(shape),
                      fb.from_bits(scales, scale_dtype).reshape(along(shape, axis, shape[axis] // bs)),
                      fmt, axis, batch, tscale)

    versions = platform_versions(run, mode, local_view(view), bs, np.dtype(x.dtype), tiles, tpu_tiles)
    return dispatch.by_platform(f"{fmt}_quantize", Policy(kernels=mode), reference, **versions)


def dequantize(q: QArray, *, kernels: str | Policy = "auto", tiles: QuantTiles | None = None,
               tpu_tiles: QuantTiles | None = None) -> jax.Array:
    """`qarray.dequantize` (the f32 value, bit for bit), by the platform's kernel.

    Args:
      q: a quantized tensor; block formats have a kernel.
      kernels, tiles, tpu_tiles: as `quantize`.

    Returns:
      f32 array of `q.shape`.

    Raises:
      KernelUnavailableError: as `quantize`.
    """
    spec, mode = q.spec, kernels_mode(kernels)
    if mode == "off" or not spec.is_block or q.codes.size == 0:
        return dequantize_reference(q)
    return dispatch.once_per_shape(_dequantize, q, mode=mode, tiles=tiles, tpu_tiles=tpu_tiles)


def _dequantize(q: QArray, *, mode: str, tiles, tpu_tiles) -> jax.Array:
    """`dequantize`'s dispatch, traced once per shape (`dispatch.once_per_shape`)."""
    spec = q.spec
    reference = lambda: dequantize_reference(q)
    bs, shape = spec.block_size, q.shape
    view, sview, tview = views(shape, q.axis, bs)
    operands = [fb.to_bits(q.codes).reshape(view), fb.to_bits(q.scales).reshape(sview)]
    nvfp4 = q.tensor_scale is not None
    if nvfp4:
        operands.append(jnp.broadcast_to(q.tensor_scale, along(shape, q.axis, 1)).reshape(tview))

    def run(platform: str, tile: QuantTiles, interpret: bool) -> jax.Array:
        def call(*operands):
            local = operands[0].shape  # one device's rows under a mesh
            spec_x, spec_s, spec_t, grid = specs(platform, local, bs, tile)
            return pl.pallas_call(
                _kernel(_dequantize_blocks_kernel, _dequantize_lanes_kernel, platform, local,
                        spec, nvfp4, interpret),
                out_shape=jax.ShapeDtypeStruct(local, jnp.float32), grid=grid,
                in_specs=[spec_x, spec_s] + [spec_t] * nvfp4, out_specs=spec_x,
                compiler_params=compiler_params(platform, local, bs, tile), interpret=interpret,
                name=f"{q.format}_dequantize",
            )(*operands)

        rows = rows_axes(view)
        out = dispatch.per_shard(call, (rows,) * len(operands), rows)(*operands)
        return out.reshape(shape)

    versions = platform_versions(run, mode, local_view(view), bs, np.dtype(np.float32), tiles, tpu_tiles)
    return dispatch.by_platform(f"{q.format}_dequantize", Policy(kernels=mode), reference,
                                **versions)


# ----------------------------------------------------------------- per-block maths
def _nvfp4_values(xb: jax.Array, s_t: jax.Array, block_axis: int, div=jnp.divide):
    """`formats.nvfp4_block_values` with the E4M3 block scale rounded by `float_bits.encode` and the
    divisions by `div` (`_div_rn` in Triton): (y, s_b code)."""
    amax_b = formats._amax(xb, (block_axis,), keepdims=False)
    s_b = fb.encode(jnp.clip(div(amax_b, 6.0 * s_t), 0.0, 448.0), fb.E4M3)
    # The E4M3 block scale is exact in f32; the product is one f32 rounding.
    eff = jnp.expand_dims(fb.decode(s_b, fb.E4M3) * s_t, block_axis)
    safe = jnp.where(eff > 0, eff, 1.0)
    return jnp.where(eff > 0, jnp.clip(div(xb, safe), -6.0, 6.0), 0.0), s_b


def _div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a / b` rounded to nearest even in a Triton kernel: its `/` is PTX's approximate
    `div.full.f32` (up to 2 ulp off), where XLA divides exactly."""
    a, b = jnp.broadcast_arrays(a, b)
    [q] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return q


def _block_values(xb, spec, s_t, block_axis: int, div=jnp.divide):
    """(y, int32 scale code): the scaled values before the element rounding, per block. MX
    divides by a power of two, exact in any division (Triton's too); NVFP4 by `div`."""
    if s_t is not None:
        return _nvfp4_values(xb, s_t, block_axis, div)
    y, scale = formats.mx_block_values(xb, spec, block_axis)
    # The scale is 2^e with e in [-126, 127], a normal f32: its biased exponent is the E8M0 code.
    return y, jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23


def _scale_value(code: jax.Array, spec) -> jax.Array:
    return fb.decode(code, fb.E4M3) if spec.scale_kind == "block_e4m3_tensor_f32" else fb.e8m0_value(code)


def _split_blocks(x: jax.Array, bs: int, axis: int) -> jax.Array:
    """`axis` of a tile as `(n/bs, bs)`: one block per index of `axis`."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // bs, bs) + x.shape[axis + 1:])


# ----------------------------------------------------------------- kernels
def _kernel(blocks, lanes, platform: str, view, spec, nvfp4: bool, interpret: bool):
    """The kernel body of `platform` on `view`: TPU's `[P, N]` tiles find blocks along lanes."""
    # The NVFP4 divisions: compiled by Triton, by inline PTX (`_div_rn`); interpreted (an XLA
    # program, where `/` by a broadcast is a product with a reciprocal), by
    # `formats.ieee_divide`, as the reference; compiled by Mosaic, by `/`.
    if interpret:
        div = formats.ieee_divide
    else:
        div = _div_rn if platform == "cuda" else jnp.divide
    if platform == "tpu" and len(view) == 2:
        return functools.partial(lanes, spec=spec, nvfp4=nvfp4, div=div)
    # N is the tile's axis 1 of a `[P, N]` tile, axis 0 of a `[P, N, Q]` one (P squeezed).
    return functools.partial(blocks, spec=spec, nvfp4=nvfp4, axis=1 if len(view) == 2 else 0,
                             div=div)


def _quantize_blocks_kernel(x_ref, *refs, spec, nvfp4: bool, axis: int, div=jnp.divide):
    """One tile whose blocks a reshape finds: N is the tile's axis 0 (`[P, N, Q]`) or 1 (`[P, N]`)."""
    st_ref, codes_ref, scales_ref = refs if nvfp4 else (None, *refs)
    # Upcast: scales and codes are computed from f32 values (exact for bf16/f16).
    x = x_ref[...].astype(jnp.float32)
    y, scode = _block_values(_split_blocks(x, spec.block_size, axis), spec,
                             None if st_ref is None else st_ref[...], axis + 1, div)
    # Rounding site: the element codes, RNE; the scales are exact in theirs.
    codes_ref[...] = fb.encode(y.reshape(x.shape), fb.FLOATS[spec.element_dtype]).astype(jnp.uint8)
    scales_ref[...] = scode.astype(jnp.uint8)


def _quantize_lanes_kernel(x_ref, *refs, spec, nvfp4: bool, div=jnp.divide):
    """One `[rows, N]` tile on TPU, blocks along lanes (module docstring)."""
    st_ref, codes_ref, scales_ref = refs if nvfp4 else (None, *refs)
    bs = spec.block_size
    # Upcast: scales and codes are computed from f32 values (exact for bf16/f16).
    x = x_ref[...].astype(jnp.float32)
    # The block's amax joins each element as the second member of a two-member block: the
    # per-block maths, which reads a block's amax from its members, then runs per element.
    pair = jnp.stack([x, _lane_block_amax(x, bs)])
    y, scode = _block_values(pair, spec, None if st_ref is None else st_ref[...], 0, div)
    codes_ref[...] = fb.encode(y[0], fb.FLOATS[spec.element_dtype]).astype(jnp.uint8)
    n, nb = x.shape[1], x.shape[1] // bs
    pick = (jax.lax.broadcasted_iota(jnp.int32, (n, nb), 0)
            == jax.lax.broadcasted_iota(jnp.int32, (n, nb), 1) * bs)
    scales_ref[...] = _one_hot_dot(scode, pick).astype(jnp.uint8)


def _lane_block_amax(x: jax.Array, bs: int) -> jax.Array:
    """max |x| over each aligned run of `bs` lanes, in every lane (NaN-propagating, as `_amax`)."""
    bits = jax.lax.bitcast_convert_type(jnp.abs(x), jnp.int32)
    lane = jax.lax.broadcasted_iota(jnp.int32, bits.shape, 1)
    n, s = bits.shape[1], 1
    while s < bs:  # XOR butterfly: lane i meets lane i ^ s
        partner = jnp.where(lane & s == s, pltpu.roll(bits, s, 1), pltpu.roll(bits, n - s, 1))
        bits, s = jnp.maximum(bits, partner), 2 * s
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _one_hot_dot(codes: jax.Array, one_hot: jax.Array) -> jax.Array:
    """`codes @ one_hot` for int32 codes < 256: exact in bf16 (one 1 per output), back as int32."""
    out = jax.lax.dot_general(codes.astype(jnp.float32).astype(jnp.bfloat16),
                              one_hot.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return out.astype(jnp.int32)


def _dequantize_blocks_kernel(codes_ref, scales_ref, *refs, spec, nvfp4: bool, axis: int,
                              div=None):
    """One tile: `f32(code) * f32(scale)`, NVFP4 `f32(code) * (f32(s_b) * s_t)`."""
    del div  # no division
    st_ref, out_ref = refs if nvfp4 else (None, *refs)
    c = fb.decode(codes_ref[...].astype(jnp.int32), fb.FLOATS[spec.element_dtype])
    s = _scale_value(scales_ref[...].astype(jnp.int32), spec)
    if nvfp4:
        s = s * st_ref[...]
    out_ref[...] = (_split_blocks(c, spec.block_size, axis)
                    * jnp.expand_dims(s, axis + 1)).reshape(c.shape)


def _dequantize_lanes_kernel(codes_ref, scales_ref, *refs, spec, nvfp4: bool, div=None):
    """One `[rows, N]` tile on TPU: each block's scale code spread over its lanes by a one-hot matmul."""
    del div  # no division
    st_ref, out_ref = refs if nvfp4 else (None, *refs)
    c = fb.decode(codes_ref[...].astype(jnp.int32), fb.FLOATS[spec.element_dtype])
    n, nb = c.shape[1], scales_ref.shape[1]
    spread = (jax.lax.broadcasted_iota(jnp.int32, (nb, n), 1) >> int(math.log2(spec.block_size))
              == jax.lax.broadcasted_iota(jnp.int32, (nb, n), 0))
    s = _scale_value(_one_hot_dot(scales_ref[...].astype(jnp.int32), spread), spec)
    if nvfp4:
        s = s * st_ref[...]
    out_ref[...] = c * s
