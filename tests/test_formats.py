"""Tests of the number formats: exact round trips, scale rules, error bounds, QArray."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_lp.numerics import (
    FORMATS,
    MATMUL_FORMATS,
    TERNARY_EPS,
    QArray,
    dequantize,
    quantize,
)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FLOAT_FORMATS = ("fp8", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4")
# (mantissa bits, smallest normal) of each element type, for the error bound.
ELEMENT = {E4M3: (3, 2.0**-6), E5M2: (2, 2.0**-14), E2M1: (1, 1.0)}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _qd(x, fmt, axis=0, batch_axes=()):
    q = quantize(x, fmt, axis, batch_axes)
    return q, dequantize(q)


def _grid(dt: np.dtype) -> np.ndarray:
    """All finite values of an 8-bit element type (4-bit: listed), as f32."""
    if dt == E2M1:
        v = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        return np.concatenate([v, -v])
    v = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    return v[np.isfinite(v)]


def _block_scales_f32(q: QArray) -> np.ndarray:
    """The effective per-element f32 scale of `q` (its dequantization rule)."""
    spec = FORMATS[q.format]
    s = np.asarray(q.scales).astype(np.float32)
    if spec.block_size is None:
        return np.broadcast_to(s, q.shape)
    s = np.repeat(s, spec.block_size, axis=q.axis)
    if q.tensor_scale is not None:
        s = s * np.asarray(q.tensor_scale)
    return s


def test_formats_table_matches_policy():
    assert tuple(FORMATS) == MATMUL_FORMATS
    facts = {
        k: (v.element_dtype, v.block_size, v.max_value, v.quantizes_activations)
        for k, v in FORMATS.items()
    }
    assert facts == {
        "fp8": (E4M3, None, 448.0, True),
        "fp8_e5m2": (E5M2, None, 57344.0, True),
        "mxfp8": (E4M3, 32, 448.0, True),
        "mxfp4": (E2M1, 32, 6.0, True),
        "nvfp4": (E2M1, 16, 6.0, True),
        "ternary": (np.dtype(np.int8), None, 1.0, False),
        "binary": (np.dtype(np.int8), None, 1.0, False),
    }


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dtypes_and_shapes(fmt):
    x = jax.random.normal(jax.random.key(0), (3, 64, 8), jnp.float32)
    q, d = _qd(x, fmt, 1, (0,))
    spec = FORMATS[fmt]
    assert q.codes.dtype == spec.element_dtype and q.codes.shape == x.shape
    assert d.dtype == jnp.float32 and d.shape == x.shape
    assert (q.format, q.axis, q.batch_axes) == (fmt, 1, (0,))
    if spec.block_size is None:
        assert q.scales.shape == (3, 1, 1) and q.scales.dtype == jnp.float32
    else:
        assert q.scales.shape == (3, 64 // spec.block_size, 8)
        assert q.scales.dtype == (E4M3 if fmt == "nvfp4" else E8M0)
    assert (q.tensor_scale is not None) == (fmt == "nvfp4")


def _representable(fmt: str, rng: np.random.Generator) -> np.ndarray:
    """A [3, 64, 8] tensor (3 layers, blocks along axis 1) exactly representable in `fmt`."""
    spec = FORMATS[fmt]
    shape = (3, 64, 8)
    if fmt in ("ternary", "binary"):
        gamma = 2.0 ** rng.integers(-8, 3, (3, 1, 1))
        return (np.where(rng.random(shape) < 0.5, -1.0, 1.0) * gamma).astype(np.float32)
    grid = _grid(spec.element_dtype)
    codes = rng.choice(grid, shape)
    big = grid[(grid > spec.max_value / 2) & (grid <= spec.max_value)]
    if spec.block_size is None:  # one element at +-max per layer fixes the tensor scale
        codes[:, 0, 0] = spec.max_value * np.sign(rng.standard_normal(3))
        return (codes * 2.0 ** rng.integers(-10, 10, (3, 1, 1))).astype(np.float32)
    bs = spec.block_size
    codes[:, ::bs, :] = rng.choice(big, (3, 64 // bs, 8)) * np.sign(rng.standard_normal())
    if fmt == "nvfp4":  # block scales on the E4M3 grid, one block at 448 per layer
        codes[:, ::bs, :] = 6.0
        s_b = rng.choice(_grid(E4M3)[_grid(E4M3) > 2.0**-6], (3, 64 // bs, 8))
        s_b[:, 0, 0] = 448.0
        s_t = 2.0 ** rng.integers(-6, 6, (3, 1, 1))
        return (codes * np.repeat(s_b, bs, axis=1) * s_t).astype(np.float32)
    e = rng.integers(-30, 30, (3, 64 // bs, 8))
    return (codes * np.repeat(2.0**e, bs, axis=1)).astype(np.float32)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_exact_round_trip_on_representable_values(fmt):
    x = _representable(fmt, np.random.default_rng(list(FORMATS).index(fmt)))
    _, d = _qd(jnp.asarray(x), fmt, 1, (0,))
    np.testing.assert_array_equal(np.asarray(d), x)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_e8m0_scale_exponent_is_rounded_up(fmt):
    max_v = FORMATS[fmt].max_value
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 32, 64)) * 2.0 ** rng.uniform(-30, 30, (8, 1, 64))
    x = x.reshape(256, 64).astype(np.float32)
    x = np.concatenate([x, np.zeros((32, 64), np.float32)])  # plus an all-zero block row
    q, d = _qd(jnp.asarray(x), fmt)
    scale = np.asarray(q.scales).astype(np.float32)
    mant, _ = np.frexp(scale)
    assert np.all(mant == 0.5)  # powers of two
    amax = np.abs(x).reshape(-1, 32, 64).max(axis=1)
    d_amax = np.abs(np.asarray(d)).reshape(-1, 32, 64).max(axis=1)
    nz = amax > 0
    # e = ceil(log2(amax / max)):  max * 2^(e-1) < amax <= max * 2^e.
    assert np.all(amax[nz] <= max_v * scale[nz])
    assert np.all(amax[nz] > max_v * scale[nz] / 2)
    assert np.all(d_amax[nz] <= max_v * scale[nz])
    assert np.all(d_amax[nz] >= max_v * scale[nz] / 2)
    assert np.all(np.isfinite(scale)) and np.all(np.asarray(d)[256:] == 0)


@pytest.mark.parametrize(
    "fmt, amaxes, expected",
    [
        (
            "mxfp8",
            [448.0, np.nextafter(np.float32(448), np.float32(1e9)), 224.0, 1.0, 0.0],
            [1.0, 2.0, 0.5, 2.0**-8, 2.0**-126],
        ),
        (
            "mxfp4",
            [6.0, np.nextafter(np.float32(6), np.float32(1e9)), 1.0, 3.0, 0.0],
            [1.0, 2.0, 0.25, 0.5, 2.0**-126],
        ),
    ],
)
def test_e8m0_scale_edges(fmt, amaxes, expected):
    x = np.zeros((32, len(amaxes)), np.float32)
    x[5] = amaxes
    x[7] = np.array(amaxes, np.float32) * -0.3
    q, _ = _qd(jnp.asarray(x), fmt)
    np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float32)[0], expected)


def _nvfp4_reference(x: np.ndarray):
    """NVFP4 in numpy f32 for a 2-D x with blocks along axis 0."""
    f32 = np.float32
    s_t = np.maximum(np.abs(x).max() / f32(6 * 448), np.finfo(f32).tiny).astype(f32)
    xb = x.reshape(-1, 16, x.shape[1])
    arg = np.abs(xb).max(axis=1) / (f32(6) * s_t)
    s_b = np.clip(arg, 0, 448).astype(E4M3)
    eff = (s_b.astype(f32) * s_t)[:, None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(eff > 0, np.clip(xb / eff, -6, 6), 0).astype(f32)
    return y.reshape(x.shape).astype(E2M1), s_b, s_t


def test_nvfp4_two_level_scales_match_reference():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((128, 24)) * 2.0 ** rng.uniform(-12, 4, (1, 24))).astype(np.float32)
    x[:16, 3] = 0.0  # an all-zero block
    q, d = _qd(jnp.asarray(x), "nvfp4")
    codes, s_b, s_t = _nvfp4_reference(x)
    np.testing.assert_array_equal(np.asarray(q.tensor_scale).reshape(()), s_t)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), s_b.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.codes).view(np.uint8), codes.view(np.uint8))
    # The tensor's largest element sits in a block with scale 448 and is coded as 6.
    i = np.unravel_index(np.argmax(np.abs(x)), x.shape)
    assert float(s_b[i[0] // 16, i[1]].astype(np.float32)) == 448.0
    assert abs(float(np.asarray(q.codes).astype(np.float32)[i])) == 6.0
    assert np.all(np.asarray(d)[:16, 3] == 0)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
def test_error_within_format_bound(fmt):
    """|x - Q(x)| <= 2^-(m+1) * max(|y|, n_min) * s + 2^-22 |x| with y = x / s.

    `s` is the element's effective scale, `m` the element mantissa bits and
    `n_min` its smallest normal: half an element ulp at `y`, in units of `s`,
    plus two f32 roundings (of `x / s` and `c * s`). NVFP4 elements with
    `|y| > 6` (block scale rounded down) are saturated to +-6 exactly.
    """
    spec = FORMATS[fmt]
    rng = np.random.default_rng(6)
    x = rng.standard_t(3, (3, 64, 8)) * 2.0 ** rng.uniform(-8, 8, (3, 1, 8))
    x = x.astype(np.float32)
    q, d = _qd(jnp.asarray(x), fmt, 1, (0,))
    s = _block_scales_f32(q)
    y = x.astype(np.float64) / s
    err = np.abs(x.astype(np.float64) - np.asarray(d))
    m, n_min = ELEMENT[spec.element_dtype]
    bound = 2.0 ** -(m + 1) * np.maximum(np.abs(y), n_min) * s + 2.0**-22 * np.abs(x)
    sat = np.abs(y) > spec.max_value * (1 + 2.0**-20)
    if fmt != "nvfp4":
        assert not sat.any()  # per-tensor and ceil-exponent scales never saturate
    assert np.all(err[~sat] <= bound[~sat]), np.max(err[~sat] / bound[~sat])
    codes = np.asarray(q.codes).astype(np.float32)
    np.testing.assert_array_equal(codes[sat], np.sign(x[sat]) * spec.max_value)


def test_ternary_round_half_up_and_gamma():
    gamma = 0.25
    w = np.array([0.5, -0.5, 1.5, -1.5], np.float32) * gamma  # mean|w| = gamma exactly
    q, d = _qd(jnp.asarray(w), "ternary")
    assert float(q.scales.reshape(())) == gamma
    np.testing.assert_array_equal(np.asarray(q.codes), [1, 0, 1, -1])  # half up: +0.5->1, -0.5->0
    np.testing.assert_array_equal(np.asarray(d), [gamma, 0.0, gamma, -gamma])
    # Random weights against the formula, one gamma per layer.
    w = np.random.default_rng(7).standard_normal((3, 64, 16)).astype(np.float32)
    w *= np.array([1e-3, 1.0, 30.0], np.float32)[:, None, None]
    q, d = _qd(jnp.asarray(w), "ternary", 0, (0,))
    g = np.abs(w).mean(axis=(1, 2), keepdims=True, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(q.scales), g, rtol=1e-6)
    ref = np.clip(np.floor(w / np.asarray(q.scales) + 0.5), -1, 1)
    np.testing.assert_array_equal(np.asarray(q.codes), ref)
    assert set(np.unique(np.asarray(q.codes))) == {-1, 0, 1}
    np.testing.assert_array_equal(np.asarray(d), ref * np.asarray(q.scales))


def test_binary_sign_and_mean_abs():
    w = np.array([[0.0, -0.0, 2.0, -1.0, 3.0, -6.0]], np.float32)
    q, d = _qd(jnp.asarray(w), "binary")
    np.testing.assert_array_equal(np.asarray(q.codes), [[1, 1, 1, -1, 1, -1]])  # sign(0) = +1
    assert float(q.scales.reshape(())) == 2.0
    np.testing.assert_array_equal(np.asarray(d), [[2, 2, 2, -2, 2, -2]])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_zeros_give_finite_scales_and_zero_values(fmt):
    q, d = _qd(jnp.zeros((3, 64, 8), jnp.float32), fmt, 1, (0,))
    assert np.all(np.isfinite(np.asarray(q.scales).astype(np.float32)))
    if q.tensor_scale is not None:
        assert np.all(np.isfinite(np.asarray(q.tensor_scale)))
    np.testing.assert_array_equal(np.asarray(d), 0.0)
    if fmt == "ternary":
        np.testing.assert_array_equal(np.asarray(q.scales), np.float32(TERNARY_EPS))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_batch_axes_equal_separate_tensors(fmt):
    w = np.random.default_rng(8).standard_normal((3, 64, 8)).astype(np.float32)
    w *= np.array([1e-2, 1.0, 1e2], np.float32)[:, None, None]
    _, d = _qd(jnp.asarray(w), fmt, 1, (0,))
    for i in range(3):
        _, di = _qd(jnp.asarray(w[i]), fmt, 0)
        np.testing.assert_array_equal(np.asarray(d)[i], np.asarray(di))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_block_axis_choice(fmt):
    x = jax.random.normal(jax.random.key(9), (32, 64), jnp.float32)
    _, d1 = _qd(x, fmt, 1)
    _, d0 = _qd(x.T, fmt, 0)
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(d0).T)
    _, dneg = _qd(x, fmt, -1)
    np.testing.assert_array_equal(np.asarray(dneg), np.asarray(d1))


def test_block_divisibility_error_names_shape_axis_block_and_fix():
    with pytest.raises(ValueError) as e:
        quantize(jnp.ones((4, 48, 8)), "mxfp8", axis=1)
    msg = str(e.value)
    for word in ("(4, 48, 8)", "axis 1", "48", "block size 32", "pad"):
        assert word in msg, (word, msg)
    with pytest.raises(ValueError, match="block size 16"):
        quantize(jnp.ones((24, 8)), "nvfp4")


def test_bad_arguments():
    with pytest.raises(ValueError, match="allowed"):
        quantize(jnp.ones((32,)), "int4")
    with pytest.raises(ValueError, match="batch axis"):
        quantize(jnp.ones((32, 4)), "mxfp8", axis=0, batch_axes=(0,))
    with pytest.raises(ValueError, match="out of range"):
        quantize(jnp.ones((32, 4)), "fp8", axis=2)


def test_qarray_is_a_pytree_through_jit_and_tree_map():
    x = jax.random.normal(jax.random.key(10), (2, 32, 16), jnp.float32)
    q, d = _qd(x, "nvfp4", 1, (0,))
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 3
    q2 = jax.tree.unflatten(treedef, leaves)
    assert (q2.format, q2.axis, q2.batch_axes) == ("nvfp4", 1, (0,))
    q3 = jax.jit(lambda q: q)(q)
    assert isinstance(q3, QArray) and q3.format == "nvfp4"
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(q3)), np.asarray(d))
    q4 = jax.tree.map(lambda a: a, q)
    np.testing.assert_array_equal(np.asarray(jax.jit(QArray.dequantize)(q4)), np.asarray(d))
    qt, _ = _qd(x, "fp8")
    assert len(jax.tree.leaves(qt)) == 2  # tensor_scale None has no leaves
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), qt, qt)
    assert stacked.codes.shape == (2, 2, 32, 16)


# What a NaN or an inf at one element reaches in the dequantized tensor: the 32-element block
# for MX, the tensor for the per-tensor scales (fp8, the NVFP4 tensor scale, mean|W|).
NON_FINITE_REACH = {"fp8": "tensor", "fp8_e5m2": "tensor", "mxfp8": "block", "mxfp4": "block",
                    "nvfp4": "tensor", "ternary": "tensor", "binary": "tensor"}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fmt", sorted(NON_FINITE_REACH))
def test_a_non_finite_element_makes_its_block_or_tensor_nan(fmt, bad):
    """A diverged weight never dequantizes to finite numbers; values out of reach stay as
    they were (torchao marks such MX blocks NaN too). Layer-batched: only that layer."""
    from jaxrl_lp.numerics.qarray import dequantize

    rng = np.random.RandomState(3)
    x = rng.randn(2, 4, 64).astype(np.float32)
    x[1, 2, 40] = bad
    got = np.asarray(dequantize(quantize(jnp.asarray(x), fmt, axis=2, batch_axes=(0,))))
    clean = np.asarray(dequantize(quantize(jnp.asarray(x[:1]), fmt, axis=2, batch_axes=(0,))))
    reach = np.zeros(x.shape, bool)
    if NON_FINITE_REACH[fmt] == "block":
        reach[1, 2, 32:64] = True
    else:
        reach[1] = True
    assert np.isnan(got[reach]).all()
    assert np.isfinite(got[~reach]).all()
    # The other layer is untouched (to the rounding of its mean over another batch shape).
    np.testing.assert_allclose(got[0], clean[0], rtol=1e-6)
