"""Quantization of f32 tensors to the number formats (docs/design/low_precision.md, "Number formats").

Formats (`FORMATS` holds their facts; `QArray` states how values are rebuilt):

- `fp8`, `fp8_e5m2`: per-tensor f32 scale `s = amax / max` (max 448 for E4M3,
  57344 for E5M2), codes `E(x / s)` rounded to nearest even, saturated.
- `mxfp8`, `mxfp4` (OCP MX): blocks of 32 along `axis`, one E8M0 power-of-two
  scale `2^e` per block with the exponent rounded *up*,
  `e = ceil(log2(amax_block / max))` (max 448 for E4M3 elements, 6 for E2M1),
  so every `|x| / 2^e <= max` and nothing saturates; codes RNE.
- `nvfp4`: blocks of 16 along `axis`, f32 tensor scale `s_t = amax / (6*448)`,
  E4M3 block scale `s_b = E4M3(amax_block / (6 * s_t))` (RNE), E2M1 codes of
  `x / (s_b * s_t)`, saturated at +-6 (a block scale rounded down can push a
  block's largest element up to 6 * 16/15). Each division is one f32 division
  rounded once in every program (`_divide_by_constant`, `ieee_divide`): XLA
  would otherwise multiply by a reciprocal where the divisor is a constant or
  a broadcast, two roundings.
- `ternary` (BitNet b1.58 / Falcon-E): `gamma = mean|W|` accumulated in f32,
  `codes = clip(floor(W / gamma + 0.5), -1, 1)` (round half up), value
  `codes * gamma`.
- `binary`: `codes = sign(W)` with `sign(0) = +1`, value `codes * mean|W|`.

Per-tensor means over the whole array unless `batch_axes` names axes holding
independent tensors (e.g. the layer axis of stacked weights `[L, in, out]`):
then every per-tensor quantity (the fp8 scale, gamma, mean|W|, the NVFP4 tensor
scale) is computed separately for each index of those axes. Block formats take
their blocks along `axis` (the matmul reduction axis); `batch_axes` only
changes their NVFP4 tensor scale.

Guards: scales are never zero or subnormal, so all-zero tensors and blocks give
finite scales and zero values: per-tensor f32 scales are floored at the
smallest normal f32 (`1.18e-38`); E8M0 exponents are clamped to [-126, 127]
(2^-127 is an f32 subnormal, which XLA on CPU flushes to zero); ternary
`gamma` is floored at `TERNARY_EPS = 1e-5` (the clamp of the BitNet b1.58
reference code); an NVFP4 block whose scale rounds to zero gets zero codes.
Non-finite inputs: a NaN or an inf makes every dequantized value of its
scale's reach NaN, in every program and in the kernels alike. MXFP8 and
MXFP4: the block (its E8M0 scale is NaN, 0xFF); FP8, FP8-E5M2 and NVFP4: the
tensor, or the index of its `batch_axes` (the f32 tensor scale is NaN or
inf, and a NaN block scale or a 0 * inf makes each value NaN); ternary and
binary: the tensor (`gamma = mean|W|` is NaN or inf). A diverged weight is
never exported as finite numbers, and sync check 3 refuses the non-finite
scale. The amax propagates NaN in every program (`_amax`). f32 subnormal
inputs may be flushed to zero on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxrl_lp.numerics.qarray import FORMATS, FormatSpec, QArray, dequantize, get_format

__all__ = [
    "FORMATS", "TERNARY_EPS", "FormatSpec", "QArray", "dequantize", "ieee_divide",
    "mx_block_values", "nvfp4_block_values", "nvfp4_tensor_scale", "quantize",
]

# Floor of the ternary scale `gamma = mean|W|`, so an all-zero tensor does not divide by 0.
TERNARY_EPS = 1e-5
_F32_TINY = float(np.finfo(np.float32).tiny)
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def quantize(x: jax.Array, fmt: str, axis: int = 0, batch_axes: Sequence[int] = ()) -> QArray:
    """Quantizes `x` to the number format `fmt`.

    Args:
      x: floating array (upcast to f32; exact for bf16/f16).
      fmt: a key of `FORMATS`.
      axis: the reduction axis; block formats take their blocks along it (its
        length must be a multiple of the block size).
      batch_axes: axes of independent tensors; per-tensor scales are computed
        per index of these axes (see module docstring). Must not contain `axis`
        for block formats.

    Returns:
      A `QArray`; `dequantize(quantize(x, fmt))` is the quantized value in f32.

    Examples:
      >>> q = quantize(jnp.ones((64, 8)), "mxfp8", axis=0)
      >>> q.scales.shape
      (2, 8)
    """
    spec = get_format(fmt)
    # Upcast: scales and codes are computed from f32 values.
    x32 = jnp.asarray(x).astype(jnp.float32)
    axis, batch = _normalize_axes(x32.shape, axis, batch_axes, spec)
    reduce_axes = tuple(i for i in range(x32.ndim) if i not in batch)
    if spec.scale_kind == "tensor_f32":
        codes, scales, tscale = _quantize_tensor_f32(x32, spec, reduce_axes)
    elif spec.scale_kind == "tensor_mean_abs":
        codes, scales, tscale = _quantize_mean_abs(x32, spec, reduce_axes)
    elif spec.scale_kind == "block_e8m0":
        codes, scales, tscale = _quantize_mx(x32, spec, axis)
    else:
        codes, scales, tscale = _quantize_nvfp4(x32, spec, axis, reduce_axes)
    return QArray(codes, scales, fmt, axis, batch, tscale)


def _normalize_axes(
    shape: tuple[int, ...], axis: int, batch_axes: Sequence[int], spec: FormatSpec
) -> tuple[int, tuple[int, ...]]:
    ndim = len(shape)
    if ndim == 0:
        raise ValueError(f"quantize({spec.name!r}): x must have at least one axis; got a scalar")
    if not -ndim <= axis < ndim:
        raise ValueError(f"quantize({spec.name!r}): axis {axis} out of range for shape {shape}")
    axis %= ndim
    batch = []
    for b in batch_axes:
        if not -ndim <= b < ndim:
            raise ValueError(
                f"quantize({spec.name!r}): batch axis {b} out of range for shape {shape}"
            )
        batch.append(b % ndim)
    batch_t = tuple(sorted(set(batch)))
    if len(batch_t) != len(batch):
        raise ValueError(f"quantize({spec.name!r}): repeated batch axes {tuple(batch_axes)}")
    if spec.is_block:
        if axis in batch_t:
            raise ValueError(
                f"quantize({spec.name!r}): the block axis {axis} cannot also be a batch axis "
                f"(batch_axes={tuple(batch_axes)})"
            )
        if shape[axis] % spec.block_size:
            raise ValueError(
                f"quantize({spec.name!r}): x has shape {shape} and axis {axis} has length "
                f"{shape[axis]}, which is not a multiple of the block size {spec.block_size}; "
                f"pad axis {axis} with zeros to a multiple of {spec.block_size} (zero padding "
                "leaves every block amax unchanged) or use a per-tensor format"
            )
    return axis, batch_t


def _amax(x: jax.Array, axes: tuple[int, ...], keepdims: bool = True) -> jax.Array:
    """max |x| over `axes`; NaN when any element is NaN, in every program.

    XLA on CPU drops NaN from some f32 max reductions and not others, depending
    on the shape (openxla/xla#21461), so a float max gave one block a NaN scale
    in one program and a finite one in another. The bit patterns of non-negative
    floats order as int32, with NaN above +inf: the integer max is exact and
    always propagates NaN.
    """
    bits = jax.lax.bitcast_convert_type(jnp.abs(x), jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axes, keepdims=keepdims), jnp.float32)


def _quantize_tensor_f32(x, spec: FormatSpec, reduce_axes):
    """Per-tensor FP8: `s = amax / max` (rounded once: `_divide_by_constant`), codes `E(clip(x / s))`."""
    scale = jnp.maximum(_divide_by_constant(_amax(x, reduce_axes), int(spec.max_value)), _F32_TINY)
    y = jnp.clip(x / scale, -spec.max_value, spec.max_value)  # saturate, never NaN/inf
    return y.astype(spec.element_dtype), scale, None


def _quantize_mean_abs(x, spec: FormatSpec, reduce_axes):
    """Ternary (round half up of W / gamma, clipped to [-1, 1]) or binary (sign)."""
    mean_abs = jnp.mean(jnp.abs(x), axis=reduce_axes, keepdims=True, dtype=jnp.float32)
    mean_abs = jnp.where(jnp.isfinite(mean_abs), mean_abs, jnp.nan)  # an inf: NaN, as a NaN
    if spec.name == "ternary":
        gamma = jnp.maximum(mean_abs, TERNARY_EPS)
        # Round half up by comparisons: `floor(y + 0.5)` rounds the add (y = 0.5 - 2^-25 gives
        # 1), and XLA may fuse it into an FMA under jit, so eager and jit codes differed.
        y = x / gamma
        codes = (jnp.where(y >= 0.5, 1, 0) - jnp.where(y < -0.5, 1, 0)).astype(jnp.int8)
        return codes, gamma, None
    codes = jnp.where(x >= 0, 1, -1).astype(jnp.int8)  # sign(0) := +1
    return codes, mean_abs, None


def _blocks(x: jax.Array, axis: int, block_size: int) -> jax.Array:
    """Splits `axis` into `(n_blocks, block_size)`: shape (..., nb, bs, ...)."""
    shape = x.shape
    return x.reshape(shape[:axis] + (shape[axis] // block_size, block_size) + shape[axis + 1 :])


def _ceil_exponent(amax: jax.Array, max_value: float) -> jax.Array:
    """The smallest integer `e` with `amax <= max_value * 2^e`, read from the bits.

    Maths: `amax = 1.m * 2^E` and `max_value = 1.m_max * 2^E_max` give
    `e = E - E_max + (m > m_max)`, i.e. `ceil(log2(amax / max_value))` without a
    floating-point log. Zero and subnormal amax give a very negative `e` that the
    caller clamps.
    """
    bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
    biased = (bits >> 23).astype(jnp.int32)
    mant = bits & jnp.uint32(0x7FFFFF)
    max_bits = int(np.float32(max_value).view(np.uint32))
    e_max, m_max = (max_bits >> 23) - 127, max_bits & 0x7FFFFF
    return (biased - 127) - e_max + (mant > m_max).astype(jnp.int32)


def _pow2(e: jax.Array) -> jax.Array:
    """`2^e` as f32 for integer `e` in [-126, 127], built from the bit pattern."""
    return jax.lax.bitcast_convert_type((e + 127).astype(jnp.uint32) << 23, jnp.float32)


def _quantize_mx(x, spec: FormatSpec, axis: int):
    """MX: E8M0 block scale `2^ceil(log2(amax / max))`, element codes RNE."""
    y, scale = mx_block_values(_blocks(x, axis, spec.block_size), spec, axis + 1)
    codes = y.reshape(x.shape).astype(spec.element_dtype)
    return codes, scale.astype(ml_dtypes.float8_e8m0fnu), None


def mx_block_values(xb: jax.Array, spec: FormatSpec, block_axis: int):
    """The MX scales of blocked f32 values and the scaled values before the element cast.

    Shared by `quantize` and the Pallas kernel (`jaxrl_lp.kernels.quantize`), which
    runs it on one tile, so the two round identically.

    Args:
      xb: f32 values with the elements of each block along `block_axis`.
      spec: an MX format (`block_e8m0`).
      block_axis: the axis of `xb` holding one block's elements.

    Returns:
      `(y, scale)`: `y` like `xb`, `clip(xb / 2^e, -max, max)` (cast it to the
      element dtype for the codes, RNE); `scale` f32 `2^e` with `block_axis` removed,
      `e = clip(ceil(log2(amax / max)), -126, 127)` (cast it to E8M0: exact), NaN
      for a block holding a NaN or an inf (E8M0's NaN code, 0xFF).
    """
    amax = _amax(xb, (block_axis,), keepdims=False)
    e = jnp.clip(_ceil_exponent(amax, spec.max_value), -126, 127)
    # A NaN or an inf in the block: its scale is E8M0's NaN, and so its every value.
    scale = jnp.where(jnp.isfinite(amax), _pow2(e), jnp.nan)
    # Division by a power of two is exact; the clip only guards NaN-free saturation.
    y = jnp.clip(xb / jnp.expand_dims(scale, block_axis), -spec.max_value, spec.max_value)
    return y, scale


def _quantize_nvfp4(x, spec: FormatSpec, axis: int, reduce_axes):
    """NVFP4: f32 tensor scale, E4M3 block scales, E2M1 codes saturated at +-6."""
    s_t = nvfp4_tensor_scale(x, reduce_axes)
    y, s_b = nvfp4_block_values(_blocks(x, axis, spec.block_size), s_t, axis + 1)
    codes = y.reshape(x.shape).astype(spec.element_dtype)
    return codes, s_b, s_t


def nvfp4_tensor_scale(x: jax.Array, reduce_axes: tuple[int, ...]) -> jax.Array:
    """The NVFP4 f32 tensor scale `max(amax / (6 * 448), tiny)` over `reduce_axes` (kept as 1s).

    The quotient is `amax / 2688` rounded once to nearest even, as NVFP4 defines
    it (torchao's `per_tensor_amax_to_scale`: `amax.float() / (F8E4M3_MAX *
    F4_E2M1_MAX)`), in every program: `_divide_by_constant`, not `/`, which a
    jitted program turns into `amax * f32(1 / 2688)`, one ulp off for some amax.
    """
    return jnp.maximum(_divide_by_constant(_amax(x, reduce_axes), 6 * 448), _F32_TINY)


def _divide_by_constant(a: jax.Array, d: int) -> jax.Array:
    """`a / d` rounded to nearest even, for f32 `a >= 0` (or NaN, inf) and an integer constant `d`.

    XLA rewrites a division by a constant as a product with the constant's f32
    reciprocal, which rounds twice: under jit `x / 2688.0` is `x * f32(1/2688)`,
    one ulp above the quotient for 28 of the 128 bf16 values in [8, 16), while
    the same `/` run eagerly divides. So the quotient is computed from the bits,
    the same in every program and on every platform. Maths: `d = odd * 2^k`,
    `a = M * 2^(E - 150)` with `M` the 24-bit significand and `E` the biased
    exponent; `q0 = (M << s) // odd` with `s` picked so that `2^24 <= q0 < 2^25`:
    `q0 >> 1` is the quotient's significand, `q0`'s last bit its round bit and
    the remainder its sticky bit. The result's biased exponent is `E + 1 - k - s`.

    Returns:
      f32 like `a`: the rounded quotient; 0 where it is below the smallest normal
      f32 (callers floor it there); `a` itself where it is inf or NaN.
    """
    odd, k = d, 0
    while odd % 2 == 0:
        odd, k = odd // 2, k + 1
    width = odd.bit_length()
    assert width <= 6, f"{d}: its odd factor {odd} must be < 64 (M << s fits int32)"
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    e = bits >> 23  # a >= 0: no sign bit
    m = (bits & 0x7FFFFF) | 0x800000
    s = jnp.where(m < (odd << (24 - width)), width + 1, width)
    n = m << s  # < odd * 2^25 <= 2^31
    q0, rem = jax.lax.div(n, jnp.int32(odd)), jax.lax.rem(n, jnp.int32(odd))
    q = q0 >> 1
    # Round to nearest even: up when the round bit is set, unless a tie (no sticky) at an even q.
    q = q + (((q0 & 1) == 1) & ((rem != 0) | ((q & 1) == 1))).astype(jnp.int32)
    # Adding q (in [2^23, 2^24]) adds its implicit bit to the exponent field, hence `E - k - s`
    # below, not `E + 1 - k - s`; a q rounded up to 2^24 carries into the next binade.
    out = jax.lax.bitcast_convert_type(((e - k - s) << 23) + q, jnp.float32)
    out = jnp.where(e >= k + s, out, 0.0)  # a normal quotient; zero and subnormal a give 0
    return jnp.where(e == 255, a, out)


def nvfp4_block_values(xb: jax.Array, s_t: jax.Array, block_axis: int):
    """NVFP4 E4M3 block scales of blocked f32 values and the scaled values before the cast.

    Shared by `quantize` and the Pallas kernel, like `mx_block_values`.

    Args:
      xb: f32 values with the elements of each block along `block_axis`.
      s_t: the f32 tensor scale (`nvfp4_tensor_scale`), broadcastable to `xb` with
        `block_axis` removed.
      block_axis: the axis of `xb` holding one block's elements.

    Returns:
      `(y, s_b)`: `y` like `xb`, `clip(xb / (f32(s_b) * s_t), -6, 6)` (0 where the
      effective scale is 0; cast it to E2M1 for the codes); `s_b` E4M3
      `E4M3(clip(amax_block / (6 * s_t), 0, 448))` with `block_axis` removed.
    """
    amax_b = _amax(xb, (block_axis,), keepdims=False)
    # f32 rounding of 6 * s_t can put the largest block a hair above 448: clip.
    s_b = jnp.clip(ieee_divide(amax_b, _E2M1_MAX * s_t), 0.0, _E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    # Upcast: the E4M3 block scale is exact in f32; the product is one f32 rounding.
    eff = jnp.expand_dims(s_b.astype(jnp.float32) * s_t, block_axis)
    safe = jnp.where(eff > 0, eff, 1.0)
    y = jnp.where(eff > 0, jnp.clip(ieee_divide(xb, safe), -_E2M1_MAX, _E2M1_MAX), 0.0)
    return y, s_b


def ieee_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a / b` for f32 `a` and `b` broadcastable to `a`'s shape: one division per element, rounded
    once to nearest even, in every XLA program.

    XLA's algebraic simplifier rewrites a division by a broadcast as a product with
    the reciprocal, `a * broadcast(1 / b)`, which rounds twice, and only where the
    divisor expands: whether `xb / eff` divides then depended on the shapes in the
    program (a kernel tile of one block along N divides, one of 32 multiplies).
    The divisor reaches `a`'s shape behind an optimization barrier, which the
    simplifier does not see through. The barrier keeps the divisor as its own
    buffer (the price of one f32 copy of `a`'s size).
    """
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, jnp.shape(a)))
