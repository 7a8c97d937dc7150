"""The quantized-tensor pytree `QArray`, the table of formats, and dequantization.

`quantize` lives in `formats.py`; this file holds what a reader of a quantized
tensor needs: how each format is laid out and how the real value is rebuilt.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["FORMATS", "FormatSpec", "QArray", "dequantize"]

ScaleKind = Literal["tensor_f32", "block_e8m0", "block_e4m3_tensor_f32", "tensor_mean_abs"]


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """Facts about one number format.

    Attributes:
      name: the format's name (a key of `FORMATS`, a `Policy.matmul_format`).
      element_dtype: dtype of the codes (`QArray.codes.dtype`).
      block_size: elements per scale along the reduction axis, or None when the
        scale is per tensor.
      scale_kind: `tensor_f32` (one f32 scale per tensor), `block_e8m0` (one
        power-of-two E8M0 scale per block), `block_e4m3_tensor_f32` (an E4M3
        scale per block times an f32 scale per tensor), `tensor_mean_abs` (one
        f32 scale per tensor equal to mean|W|).
      max_value: largest code magnitude (the value the tensor or block amax is
        mapped to).
      element_bits: storage bits per element, scales excluded (ternary: log2 3).
      quantizes_activations: whether a matmul in this format also quantizes its
        activations (True for the FP8/FP4 formats; ternary and binary are
        weights-only).
    """

    name: str
    element_dtype: np.dtype
    block_size: int | None
    scale_kind: ScaleKind
    max_value: float
    element_bits: float
    quantizes_activations: bool

    @property
    def is_block(self) -> bool:
        return self.block_size is not None


_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_INT8 = np.dtype(np.int8)


def _spec(name, element_dtype, block_size, scale_kind, max_value, element_bits, acts):
    return FormatSpec(
        name=name,
        element_dtype=element_dtype,
        block_size=block_size,
        scale_kind=scale_kind,
        max_value=max_value,
        element_bits=element_bits,
        quantizes_activations=acts,
    )


# The number formats `quantize` / `dequantize` know, by name (`FormatSpec` each).
# fmt: off
FORMATS: dict[str, FormatSpec] = {s.name: s for s in (
    #     name        element  block  scale kind               max      bits          acts
    _spec("fp8",      _E4M3,   None,  "tensor_f32",            448.0,   8.0,          True),
    _spec("fp8_e5m2", _E5M2,   None,  "tensor_f32",            57344.0, 8.0,          True),
    _spec("mxfp8",    _E4M3,   32,    "block_e8m0",            448.0,   8.0,          True),
    _spec("mxfp4",    _E2M1,   32,    "block_e8m0",            6.0,     4.0,          True),
    _spec("nvfp4",    _E2M1,   16,    "block_e4m3_tensor_f32", 6.0,     4.0,          True),
    _spec("ternary",  _INT8,   None,  "tensor_mean_abs",       1.0,     math.log2(3), False),
    _spec("binary",   _INT8,   None,  "tensor_mean_abs",       1.0,     1.0,          False),
)}
# fmt: on


def get_format(fmt: str) -> FormatSpec:
    """The `FormatSpec` of `fmt`; ValueError naming the allowed formats otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown number format {fmt!r}; allowed: {list(FORMATS)}")
    return FORMATS[fmt]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scales", "tensor_scale"],
    meta_fields=["format", "axis", "batch_axes"],
)
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized tensor: element codes and their scales.

    The real value is rebuilt (`dequantize`) in f32, exactly as follows, with
    `c = codes.astype(f32)` (exact: every code is representable in f32):

    - per-tensor formats (`fp8`, `fp8_e5m2`, `ternary`, `binary`):
      `value = c * scales`. `scales` is f32 with the shape of `codes` reduced to
      1 on every axis not in `batch_axes` (one scale per independent tensor), so
      it broadcasts against `codes`.
    - `mxfp8`, `mxfp4`: `scales` (E8M0, powers of two) has the shape of `codes`
      with `codes.shape[axis]` replaced by `codes.shape[axis] // block_size`;
      element `i` along `axis` uses block scale `i // block_size`:
      `value[..., i, ...] = c[..., i, ...] * f32(scales[..., i // bs, ...])`
      (exact in f32).
    - `nvfp4`: as the MX formats with E4M3 block `scales`, and `tensor_scale`
      (f32, shaped like a per-tensor scale): the effective scale is
      `s = f32(scales[..., i // 16, ...]) * tensor_scale` (one f32 rounding) and
      `value = c * s`.

    `tensor_scale` is None for every format but `nvfp4`.

    Attributes:
      codes: element codes, dtype `FORMATS[format].element_dtype`, the shape of
        the quantized tensor.
      scales: the scales described above.
      format: the format's name (static).
      axis: the reduction axis the blocks run along (static; normalized to be
        non-negative; recorded but unused by per-tensor formats).
      batch_axes: axes holding independent tensors, each with its own per-tensor
        scale (static; sorted, non-negative).
      tensor_scale: the NVFP4 f32 tensor scale, else None.
    """

    codes: jax.Array
    scales: jax.Array
    format: str
    axis: int = 0
    batch_axes: tuple[int, ...] = ()
    tensor_scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def spec(self) -> FormatSpec:
        return get_format(self.format)

    def dequantize(self) -> jax.Array:
        """The f32 value; see the class docstring."""
        return dequantize(self)


def expand_block_scales(scales: jax.Array, axis: int, block_size: int) -> jax.Array:
    """Repeats each block scale `block_size` times along `axis`."""
    return jnp.repeat(scales, block_size, axis=axis)


def dequantize(q: QArray) -> jax.Array:
    """Rebuilds the f32 value of a `QArray` (exactly as its docstring states).

    Args:
      q: a quantized tensor.

    Returns:
      f32 array of shape `q.codes.shape`.
    """
    spec = get_format(q.format)
    # Upcast: codes are rebuilt in f32, where every code value is exact.
    c = q.codes.astype(jnp.float32)
    if not spec.is_block:
        return c * q.scales
    # Upcast: E8M0 / E4M3 scales are exact in f32.
    s = expand_block_scales(q.scales.astype(jnp.float32), q.axis, spec.block_size)
    if q.tensor_scale is not None:
        s = s * q.tensor_scale
    return c * s
