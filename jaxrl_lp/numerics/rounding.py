"""Rounding of f32 values to bf16 / f16: nearest, stochastic and error feedback.

The three ways a served (sampler) copy of an f32 master weight is made:

- `round_nearest`: round to nearest, ties to even (RNE), the IEEE cast.
- `round_stochastic`: unbiased stochastic rounding done on the f32 bit pattern:
  uniform random bits are added below the target precision and the result is
  truncated, so `x` goes up to its upper neighbour with probability equal to
  its distance from the lower one (in ulps). `E[round_stochastic(x)] = x`.
- `error_feedback_round`: deterministic RNE of `master + residual`; the rounding
  error is carried to the next export, so the running mean of the served
  values converges to the master.

All three accept `dtype` in {`bfloat16`, `float16`} (any spelling `parse_dtype`
accepts); `float32` is accepted too and leaves values unchanged, so a policy
with f32 served weights goes through the same code.

Subnormals: XLA on CPU flushes f32 subnormals to zero in *arithmetic* (not in
bit casts or dtype conversions). The rounding here is done with integer ops on
the bit pattern, so it is exact for f32 subnormal inputs too; `ulp` returns
f32 subnormals for the bf16 subnormal range, which are then flushed by any
arithmetic on CPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.numerics.policy import parse_dtype

__all__ = ["error_feedback_round", "round_nearest", "round_stochastic", "ulp"]

_F32 = np.dtype(np.float32)
_BF16 = parse_dtype("bf16")
_F16 = parse_dtype("f16")

# (mantissa bits, smallest normal exponent, largest exponent) of each target.
_LAYOUT = {_BF16: (7, -126, 127), _F16: (10, -14, 15), _F32: (23, -126, 127)}
# Magnitude bit patterns (as f32) of the largest finite value of each target.
_MAX_BITS = {_BF16: 0x7F7F0000, _F16: 0x477FE000}
_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)


def _target(dtype: Any) -> np.dtype:
    try:
        return parse_dtype(dtype, "dtype")
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"rounding target dtype {dtype!r} is not supported; allowed: bf16, f16, f32"
        ) from e


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _from_bits(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def round_nearest(x: jax.Array, dtype: Any) -> jax.Array:
    """Rounds to `dtype` with round-to-nearest-even (the IEEE cast).

    Values beyond the largest finite value by half an ulp or more become +-inf,
    as in any IEEE cast.

    Args:
      x: array of any floating dtype (upcast to f32 first; exact).
      dtype: `bfloat16`, `float16` or `float32`.

    Returns:
      `x` rounded, in `dtype`.

    Examples:
      >>> round_nearest(jnp.float32(1 + 2**-8), "bf16")  # a tie: to even
      Array(1, dtype=bfloat16)
    """
    dt = _target(dtype)
    # Upcast: the rounding is defined from the f32 value (exact for bf16/f16 inputs).
    return jnp.asarray(x).astype(jnp.float32).astype(dt)


def round_stochastic(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Unbiased stochastic rounding of f32 values to bf16 or f16.

    With `lo <= x <= hi` the two neighbouring values of `dtype` around `x`,
    the result is `hi` with probability `(x - lo) / (hi - lo)` and `lo` otherwise,
    so `E[result] = x`. It is computed on the f32 bit pattern: a uniform integer
    `r` in `[0, 2^d)` is added to the magnitude bits and the low `d` bits are
    cleared (`d` = 16 for bf16; for f16, `d` = 13 in the f16 normal range and
    grows to 23 through the f16 subnormal range so that the grid step is 2^-24).
    A carry into the exponent gives the next binade, which is the correct upper
    neighbour. For f16, magnitudes below 2^-24 (the smallest f16 subnormal) go up
    to 2^-24 with probability `|x| / 2^-24` computed with 32 random bits, so there
    the rounding is unbiased up to 2^-32 of an f16 ulp; everywhere else it is
    exactly unbiased.

    Saturation: finite values never become inf. A finite `|x|` above the largest
    finite value of `dtype` is returned as that value (with the sign of `x`); such
    values are outside the unbiased range. NaN and +-inf pass through unchanged;
    signed zeros keep their sign.

    Args:
      x: array of any floating dtype (upcast to f32 first; exact).
      dtype: `bfloat16`, `float16` or `float32` (f32: returned unchanged).
      key: a `jax.random` key; use a fresh one per export.

    Returns:
      The rounded array, in `dtype`, same shape as `x`.

    Examples:
      >>> y = round_stochastic(jnp.full((4096,), 1 + 2**-9), "bf16", jax.random.key(0))
      >>> sorted(set(y.tolist()))  # the two neighbours, each about half the time
      [1.0, 1.0078125]
    """
    dt = _target(dtype)
    # Upcast: stochastic rounding is defined on the f32 bit pattern.
    x32 = jnp.asarray(x).astype(jnp.float32)
    if dt == _F32:
        return x32
    bits = _bits(x32)
    sign = bits & _SIGN
    mag = bits & _ABS
    r = jax.random.bits(key, x32.shape, jnp.uint32)
    if dt == _BF16:
        mask = jnp.uint32(0xFFFF)
        out = (mag + (r & mask)) & ~mask
    else:
        out = _stochastic_f16_magnitude(mag, r)
    out = jnp.minimum(out, jnp.uint32(_MAX_BITS[dt]))  # saturate: never round to inf
    rounded = _from_bits(sign | out)
    finite = (mag >> 23) != 0xFF
    return jnp.where(finite, rounded, x32).astype(dt)


def _stochastic_f16_magnitude(mag: jax.Array, r: jax.Array) -> jax.Array:
    """Stochastically rounded magnitude bits (as f32 bits) on the f16 grid."""
    biased = (mag >> 23).astype(jnp.int32)
    # Bits to drop: 13 in the f16 normal range (|x| >= 2^-14), one more per binade
    # below it, 23 at [2^-24, 2^-23) where only the leading bit survives.
    drop = 13 + jnp.clip(113 - biased, 0, 10)
    mask = (jnp.uint32(1) << drop.astype(jnp.uint32)) - jnp.uint32(1)
    normal_part = (mag + (r & mask)) & ~mask
    # |x| < 2^-24: up to 2^-24 with probability |x| * 2^24 = sig * 2^(e - 126), i.e.
    # iff r < ceil(sig * 2^(e - 94)) with r uniform in [0, 2^32). Integer-only, so
    # f32 subnormal inputs (sig without the implicit bit, e = 1) are exact too.
    sig = jnp.where(biased == 0, mag & 0x7FFFFF, (mag & 0x7FFFFF) | 0x800000)
    shift = jnp.clip(94 - jnp.maximum(biased, 1), 0, 31).astype(jnp.uint32)
    left = jnp.clip(jnp.maximum(biased, 1) - 94, 0, 8).astype(jnp.uint32)
    threshold = jnp.where(
        biased >= 94,
        sig << left,
        (sig + (jnp.uint32(1) << shift) - jnp.uint32(1)) >> shift,
    )
    tiny_part = jnp.where(r < threshold, jnp.uint32(0x33800000), jnp.uint32(0))  # 2^-24
    return jnp.where(biased >= 103, normal_part, tiny_part)


def error_feedback_round(
    master: jax.Array, residual: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """Deterministic rounding with error feedback (one export step).

    Maths::

        t        = master + residual            (f32)
        served   = RNE_dtype(t)
        residual = t - served                   (f32, exact: Sterbenz)

    Summing over exports, `sum(served) = N * master + residual_0 - residual_N`, so
    the running mean of the served values is within `ulp / (2N)` of a constant
    master. `|residual| <= ulp(t) / 2` after every step. Where `served` is not
    finite (t is NaN/inf or rounds past the largest finite value) the new
    residual is 0, so exporter state never becomes NaN.

    Args:
      master: f32 master values (other floating dtypes are upcast).
      residual: f32 residual from the previous export (zeros at the start).
      dtype: `bfloat16`, `float16` or `float32` (f32: served = t, residual 0).

    Returns:
      `(served, new_residual)`: `served` in `dtype`, `new_residual` in f32.

    Examples:
      >>> served, e = error_feedback_round(jnp.float32(1 + 2**-10), jnp.float32(0), "bf16")
      >>> float(served), float(e)
      (1.0, 0.0009765625)
    """
    dt = _target(dtype)
    # Upcast: the residual is kept in f32 so the served error does not accumulate.
    t = jnp.asarray(master).astype(jnp.float32) + jnp.asarray(residual).astype(jnp.float32)
    served = t.astype(dt)
    # Upcast: the difference of an f32 value and its rounding is exact in f32.
    served32 = served.astype(jnp.float32)
    new_residual = jnp.where(jnp.isfinite(served32), t - served32, 0.0)
    return served, new_residual


def ulp(x: jax.Array, dtype: Any) -> jax.Array:
    """The unit in the last place of `dtype` in the binade of `x`, as f32.

    Maths: `ulp(x) = 2^(clip(floor(log2|x|), e_min, e_max) - m)` with `m` the
    mantissa bits (bf16: 7, f16: 10, f32: 23), `e_min` the smallest normal
    exponent (subnormals share its spacing; `ulp(0)` is the smallest subnormal)
    and `e_max` the largest exponent. RNE error is at most `ulp(x) / 2`; the two
    stochastic-rounding neighbours of `x` are `ulp(x)` apart. NaN gives NaN,
    +-inf gives inf. Computed from the bit pattern, so exact for every input.

    Args:
      x: array of any floating dtype (upcast to f32; exact).
      dtype: `bfloat16`, `float16` or `float32`.

    Returns:
      f32 array of `x`'s shape.

    Examples:
      >>> float(ulp(jnp.float32(3.0), "bf16"))
      0.015625
    """
    dt = _target(dtype)
    mbits, emin, emax = _LAYOUT[dt]
    # Upcast: the binade is read from the f32 bit pattern.
    x32 = jnp.asarray(x).astype(jnp.float32)
    biased = ((_bits(x32) & _ABS) >> 23).astype(jnp.int32)
    k = jnp.clip(biased - 127, emin, emax) - mbits
    # 2^k built from bits: normal for k >= -126, else an f32 subnormal (bf16 only).
    normal = (jnp.maximum(k, -126) + 127).astype(jnp.uint32) << 23
    sub = jnp.uint32(1) << jnp.clip(k + 149, 0, 31).astype(jnp.uint32)
    out = _from_bits(jnp.where(k >= -126, normal, sub))
    out = jnp.where(jnp.isinf(x32), jnp.inf, out)
    return jnp.where(jnp.isnan(x32), jnp.nan, out)
