"""Narrow floats as `uint8` bit patterns, rounded in integer arithmetic: what the quantize kernels
store, since neither kernel compiler takes every narrow float (`kernels.quantize`).

Triton's dialect has no `f4E2M1FN` or `f8E8M0FNU` tensors (its verifier refuses
the loads and casts) and Mosaic TPU converts to 4-bit floats only from TPU v7
on, so a kernel computes the codes in int32 (`encode`: round to nearest even,
subnormals, XLA's NaN codes; `decode`: exact) and reads and writes `uint8`;
outside the kernel the patterns are bitcast to the real dtypes (`from_bits`,
`to_bits`; E2M1 through `uint4`). tests/test_kernel_quantize.py checks
`encode` and `decode` against XLA's own conversions on every code, every
midpoint and its neighbours, subnormals, +-0 and NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["E2M1", "E4M3", "FLOATS", "NarrowFloat", "decode", "e8m0_value", "encode", "from_bits",
           "to_bits"]


class NarrowFloat(NamedTuple):
    """A narrow float format: its exponent and mantissa widths and its NaN code."""

    exp_bits: int
    man_bits: int
    nan: int | None  # the code of a positive NaN (sign bit added), or None: NaN -> `nan_any`
    nan_any: int = 0


E4M3 = NarrowFloat(4, 3, 0x7F)
E2M1 = NarrowFloat(2, 1, None, 0x8)  # no NaN: XLA converts NaN of either sign to 0b1000 (-0)
FLOATS = {np.dtype(jnp.float8_e4m3fn): E4M3, np.dtype(jnp.float4_e2m1fn): E2M1}


def encode(y: jax.Array, f: NarrowFloat) -> jax.Array:
    """int32 codes of f32 `y` (|y| <= the format's max, or NaN), rounded to nearest even."""
    bias, m = (1 << (f.exp_bits - 1)) - 1, f.man_bits
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    a = bits & 0x7FFFFFFF
    drop = 23 - m
    normal = ((a + (1 << (drop - 1)) - 1 + ((a >> drop) & 1)) >> drop) - ((127 - bias) << m)
    # Subnormal codes: |y| / 2^(1 - bias - m) rounded to an integer, from the f32 mantissa.
    e = a >> 23
    mant = (a & 0x7FFFFF) | jnp.where(e > 0, 0x800000, 0)
    shift = jnp.minimum(151 - bias - m - jnp.maximum(e, 1), 30)
    q, rem, half = mant >> shift, mant & ((1 << shift) - 1), 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
    code = jnp.where(a < (128 - bias) << 23, sub, normal)
    sign = jnp.where(bits < 0, 1 << (f.exp_bits + m), 0)
    nan = f.nan_any if f.nan is None else f.nan | sign
    return jnp.where(a > 0x7F800000, nan, code | sign)


def decode(code: jax.Array, f: NarrowFloat) -> jax.Array:
    """The f32 value of int32 codes (exact, as XLA's conversion)."""
    bias, m = (1 << (f.exp_bits - 1)) - 1, f.man_bits
    sign = jnp.where((code >> (f.exp_bits + m)) & 1 == 1, np.int32(-(1 << 31)), 0)
    e, man = (code >> m) & ((1 << f.exp_bits) - 1), code & ((1 << m) - 1)
    normal = ((e + 127 - bias) << 23) | (man << (23 - m))
    # Subnormal codes: man * 2^(1 - bias - m), exact in f32.
    sub = jax.lax.bitcast_convert_type(man.astype(jnp.float32) * 2.0 ** (1 - bias - m), jnp.int32)
    bits = jnp.where(e == 0, sub, normal)
    if f.nan is not None:
        bits = jnp.where(code & f.nan == f.nan, 0x7FC00000, bits)
    return jax.lax.bitcast_convert_type(bits | sign, jnp.float32)


def e8m0_value(code: jax.Array) -> jax.Array:
    """The f32 value of int32 E8M0 codes: `2^(code - 127)`, code 0 the subnormal 2^-127, 255 NaN."""
    bits = jnp.where(code == 0, 0x00400000, jnp.where(code == 255, 0x7FC00000, code << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def from_bits(bits: jax.Array, dtype) -> jax.Array:
    """`uint8` codes as `dtype` (outside the kernels)."""
    if np.dtype(dtype) == np.dtype(jnp.float4_e2m1fn):
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint4), dtype)
    return jax.lax.bitcast_convert_type(bits, dtype)


def to_bits(codes: jax.Array) -> jax.Array:
    """Codes of a narrow float as their `uint8` bit patterns (outside the kernels)."""
    if codes.dtype == np.dtype(jnp.float4_e2m1fn):
        return jax.lax.bitcast_convert_type(codes, jnp.uint4).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(codes, jnp.uint8)
