"""The NVFP4 tensor scale as NVFP4 defines it, in every program, and the kernels on it: bit for bit.

NVFP4's f32 tensor scale is `amax / (6 * 448)` rounded once (torchao's
`per_tensor_amax_to_scale`). XLA rewrites a division by a constant as a
product with the constant's f32 reciprocal in a jitted program, which is one
ulp above the quotient for about a fifth of all amax values, so the jitted
kernel path and the eager `formats.quantize` gave different tensor scales
(and flipped codes with them) on bf16 input along axis 0 at the kernels'
default tiles. Checked here: the rounded division (`formats._divide_by_constant`)
against numpy's IEEE division on every bf16 value and random f32 bit
patterns; the per-tensor scales of `formats.quantize` eager and jitted; and,
as a property over random inputs (seeds, scales, shapes, bf16 and f32, both
axes), each kernel version interpreted on CPU at its default tiles against
eager and jitted `formats.quantize` and against numpy's quotient. Tolerance:
none (bit-equal codes, block scales and tensor scales; the inputs are finite).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_lp.kernels.quantize import quantize
from jaxrl_lp.numerics import formats

F32 = np.float32
TINY = np.finfo(F32).tiny
MODES = ("interpret", "interpret-tpu")  # the cuda and the tpu versions, interpreted
# (shape, axis): the cells a review found the tensor scale one ulp off at (bf16 along axis 0 at
# the default tiles: "review"), and more shapes along both axes where 16 divides the axis.
REVIEW_CELLS = (((64, 96), 0), ((96, 200), 0))
SWEEP_CELLS = REVIEW_CELLS + (((64, 96), 1), ((160, 48), 0), ((160, 48), 1))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _quotient(amax: np.ndarray, d: int) -> np.ndarray:
    """numpy's f32 `amax / d` (IEEE: rounded once, to nearest even)."""
    return (np.asarray(amax, F32) / F32(d)).astype(F32)


def _jitted_divide(amax: np.ndarray, d: int) -> np.ndarray:
    """What `amax / d` gives in a jitted XLA program: `amax * f32(1 / d)`."""
    return (np.asarray(amax, F32) * F32(1 / d)).astype(F32)


@pytest.mark.parametrize("d", [6 * 448, 448, 57344])
def test_divide_by_constant_is_the_rounded_quotient_eager_and_jitted(d):
    """Every non-negative finite bf16 value and 200,000 random f32 bit patterns: the quotient is
    numpy's, bit for bit, where it is a normal f32, 0 below; inf and NaN pass through. Also shows
    why: a jitted `/` differs from numpy on many of them."""
    rng = np.random.default_rng(d)
    patterns = np.concatenate([np.arange(0x7F80, dtype=np.uint32) << 16,
                               rng.integers(0, 0x7F800000, 200_000, dtype=np.uint32),
                               np.array([0x7F7FFFFF, 0x00800000, 1, 0x7F800000], np.uint32)])
    a = patterns.view(F32)
    want = _quotient(a, d)
    want = np.where(want < TINY, F32(0), want)
    for got in (formats._divide_by_constant(jnp.asarray(a), d),
                jax.jit(lambda a: formats._divide_by_constant(a, d))(jnp.asarray(a))):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    nan = formats._divide_by_constant(jnp.asarray([np.nan], F32), d)
    assert np.isnan(np.asarray(nan)).all()
    plain = np.asarray(jax.jit(lambda a: a / d)(jnp.asarray(a)))
    normal = want >= TINY
    assert (_bits(plain)[normal] != _bits(want)[normal]).mean() > 0.1


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_e5m2"])
def test_per_tensor_scales_are_the_same_eager_and_jitted(fmt):
    """The per-tensor f32 scale of `formats.quantize` on tensors whose amax a jitted `/` rounds
    one ulp off (amax 12.625 and 10.625 for NVFP4, the review's and another): eager, jitted and
    numpy's quotient agree bit for bit."""
    d = {"nvfp4": 6 * 448, "fp8": 448, "fp8_e5m2": 57344}[fmt]
    amaxes = np.array([12.625, 10.625, 13.9375, 0.30078125, 3.0e5, 7.0e-20], F32)
    amaxes = amaxes[_quotient(amaxes, d) != _jitted_divide(amaxes, d)]
    assert amaxes.size >= 2
    jitted = jax.jit(lambda x: formats.quantize(x, fmt, 0).tensor_scale if fmt == "nvfp4"
                     else formats.quantize(x, fmt, 0).scales)
    for amax in amaxes:
        x = np.linspace(-1, 1, 64, dtype=F32) * amax
        q = formats.quantize(jnp.asarray(x), fmt, 0)
        eager = q.tensor_scale if fmt == "nvfp4" else q.scales
        want = np.maximum(_quotient(np.abs(x).max(), d), TINY).reshape(1)
        np.testing.assert_array_equal(_bits(np.asarray(eager).reshape(1)), _bits(want))
        np.testing.assert_array_equal(_bits(np.asarray(jitted(jnp.asarray(x))).reshape(1)),
                                      _bits(want))


# ------------------------------------------------------------ the kernels: a property
@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(x, axis, kernels):
    """The kernel path at the version's default tiles (no `tiles=`), jitted as a model runs it."""
    return quantize(x, "nvfp4", axis, kernels=kernels)


def _sample(shape, seed: int, dtype) -> np.ndarray:
    """Normal values times a scale: 3 every fourth seed (the review's data), else 2^u with u in
    [-30, 30); every other seed a column-wise spread of 2^-6 .. 2^5 and a zero block."""
    rng = np.random.default_rng(seed)
    scale = 3.0 if seed % 4 == 0 else np.exp2(rng.uniform(-30, 30))
    x = rng.standard_normal(shape) * scale
    if seed % 2:
        x = x * np.exp2(rng.integers(-6, 6, shape[1:]))
        x[:16, 0] = 0.0
    return x.astype(F32).astype(dtype)


def _check_inputs(mode: str, cells, dtypes, seeds) -> tuple[int, int]:
    """The kernel path under `mode` against `formats.quantize` eager and jitted, bit for bit, and
    its tensor scale against numpy's quotient, on `_sample` inputs. Returns (inputs, inputs whose
    amax a jitted `/` rounds off)."""
    checked = hits = 0
    for shape, axis in cells:
        for dtype in dtypes:
            for seed in seeds:
                x = _sample(shape, seed + 1000 * axis + shape[1], dtype)
                got = _quantize(jnp.asarray(x), axis, mode)
                amax = np.abs(x.astype(F32)).max()
                quotient = np.maximum(_quotient(amax, 6 * 448), TINY)
                where = (f"{mode} {np.dtype(dtype).name} {shape} axis {axis} seed {seed}, tensor "
                         f"scale {np.asarray(got.tensor_scale).reshape(())!r}")
                for name, want in (("eager", formats.quantize(jnp.asarray(x), "nvfp4", axis)),
                                   ("jitted", _quantize(jnp.asarray(x), axis, "off"))):
                    for field in ("tensor_scale", "scales", "codes"):
                        np.testing.assert_array_equal(
                            _bits(getattr(got, field)), _bits(getattr(want, field)),
                            err_msg=f"{field} against {name} formats.quantize, {where}")
                np.testing.assert_array_equal(_bits(np.asarray(got.tensor_scale).reshape(())),
                                              _bits(quotient), err_msg=f"{amax!r} / 2688, {where}")
                checked += 1
                hits += int(_quotient(amax, 6 * 448) != _jitted_divide(amax, 6 * 448))
    return checked, hits


@pytest.mark.parametrize("mode", MODES)
def test_kernels_tensor_scale_and_codes_at_the_review_cells(mode):
    """bf16 along axis 0 at the default tiles, (64, 96) and (96, 200): 48 random inputs per
    version, a fifth or more of them with an amax a jitted `/` rounds one ulp off."""
    checked, hits = _check_inputs(mode, REVIEW_CELLS, (ml_dtypes.bfloat16,), range(24))
    assert (checked, hits >= checked // 5) == (48, True), hits


# The whole file takes about 30 s on one core with a cold compilation cache: the sweep's 20
# compiled programs a version (5 cells x 2 dtypes, kernel and jitted reference) are most of it.
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("mode", MODES)
def test_kernels_tensor_scale_and_codes_property(mode, dtype):
    """Five cells (the review's two, (64, 96) along axis 1, (160, 48) along both) x 20 seeds: 100
    random inputs per version and dtype, 200 per version with the other dtype's, a tenth or more
    of them with an amax a jitted `/` rounds one ulp off."""
    checked, hits = _check_inputs(mode, SWEEP_CELLS, (dtype,), range(100, 120))
    assert (checked, hits >= checked // 10) == (100, True), hits
