"""Tests of f32 -> bf16/f16 rounding: nearest, stochastic, error feedback, ulp."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_lp.numerics import error_feedback_round, round_nearest, round_stochastic, ulp

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DRAWS = 4096


def _values(dt: np.dtype) -> np.ndarray:
    """Values across the range of `dt`: negatives, tiny, subnormal, on the grid."""
    rng = np.random.default_rng(0)
    if dt == BF16:
        exps = rng.uniform(-40, 40, 72)
        tiny = [1e-39, -3e-40, 2.0**-133 * 0.3, 2.0**-126 * 1.37, 1e-30]
    else:
        exps = rng.uniform(-13, 14.9, 72)
        tiny = [1e-5, -3.3e-6, 3e-8, -4e-8, 2.0**-24 * 0.999, 1e-10, 2.0**-14 * 1.37]
    x = np.sign(rng.standard_normal(72)) * rng.uniform(1, 2, 72) * 2.0**exps
    on_grid = np.array([1.0, -2.0, 0.5], np.float64)
    return np.concatenate([x, tiny, on_grid]).astype(np.float32)


def _neighbours(x: np.ndarray, dt: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The representable values below and above `x` in magnitude (numpy reference)."""
    if dt == BF16:
        bits = x.view(np.uint32)
        lo_bits = bits & np.uint32(0xFFFF0000)  # truncation toward zero
        lo = lo_bits.view(np.float32)
        hi = np.where(lo == x, lo, (lo_bits + np.uint32(0x10000)).view(np.float32))
        return lo, hi
    towards_zero = x.astype(np.float64)
    lo = x.astype(np.float16)
    # Fix up the RNE cast to the neighbour toward zero.
    over = np.abs(lo.astype(np.float64)) > np.abs(towards_zero)
    lo = np.where(over, np.nextafter(lo, np.float16(0)), lo)
    hi = np.where(
        lo.astype(np.float64) == towards_zero,
        lo,
        np.nextafter(lo, np.copysign(np.float16(np.inf), x).astype(np.float16)),
    )
    return lo.astype(np.float32), hi.astype(np.float32)


@functools.partial(jax.jit, static_argnums=(1,))
def _draws(x, dt, key):
    x_DxM = jnp.broadcast_to(x, (DRAWS,) + x.shape)
    # Upcast: compare in f32 (exact for bf16/f16 values).
    return round_stochastic(x_DxM, dt, key).astype(jnp.float32)


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
def test_stochastic_gives_neighbours_and_is_unbiased(dt):
    x = _values(dt)
    d = np.asarray(_draws(jnp.asarray(x), dt, jax.random.key(0)))
    lo, hi = _neighbours(x, dt)
    assert np.all((d == lo) | (d == hi)), x[~np.all((d == lo) | (d == hi), axis=0)]
    # Upcast: statistics in f64.
    x64, lo64, hi64 = x.astype(np.float64), lo.astype(np.float64), hi.astype(np.float64)
    gap = np.abs(hi64 - lo64)
    p = np.where(gap > 0, np.abs(x64 - lo64) / np.where(gap > 0, gap, 1.0), 0.0)
    se = gap * np.sqrt(p * (1 - p) / DRAWS)
    mean = d.astype(np.float64).mean(axis=0)
    on_grid = gap == 0
    np.testing.assert_array_equal(mean[on_grid], x64[on_grid])
    assert np.all(np.abs(mean - x64) <= 4 * se + 1e-300), np.max(np.abs(mean - x64) / (se + 1e-300))
    # Both neighbours occur where neither is unlikely.
    mid = (p > 0.05) & (p < 0.95)
    assert mid.sum() > 20
    assert np.all((d[:, mid] == lo[mid]).any(0) & (d[:, mid] == hi[mid]).any(0))


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
def test_stochastic_specials_and_saturation(dt):
    big = [3.0e38, -3.39e38, 3.4028235e38] if dt == BF16 else [65519.0, 7.0e4, -1.0e30, 65504.0]
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, *big], np.float32)
    f = jax.jit(round_stochastic, static_argnums=(1,))
    for seed in range(4):
        y = np.asarray(f(jnp.asarray(x), dt, jax.random.key(seed))).astype(np.float32)
        assert np.isnan(y[0]) and y[1] == np.inf and y[2] == -np.inf
        assert y[3] == 0 and not np.signbit(y[3]) and y[4] == 0 and np.signbit(y[4])
        fmax = float(ml_dtypes.finfo(dt).max)
        assert np.all(np.isfinite(y[5:])), y
        assert np.all(np.abs(y[5:]) <= fmax)
        # Beyond max: saturated to +-max with the sign of x.
        beyond = np.abs(x[5:]) > fmax
        np.testing.assert_array_equal(y[5:][beyond], np.sign(x[5:][beyond]) * fmax)


def test_stochastic_keys():
    x = jnp.full((1024,), 1.0 + 2.0**-9, jnp.float32)  # halfway between two bf16 values
    f = jax.jit(round_stochastic, static_argnums=(1,))
    a = np.asarray(f(x, "bf16", jax.random.key(1)))
    b = np.asarray(f(x, "bf16", jax.random.key(2)))
    c = np.asarray(f(x, "bf16", jax.random.key(1)))
    assert a.dtype == BF16
    assert not np.array_equal(a, b)  # a fresh key gives different draws
    np.testing.assert_array_equal(a, c)  # the same key gives the same draws


def test_stochastic_f32_target_is_identity_and_bad_dtype_raises():
    x = jnp.linspace(-3, 3, 17, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(round_stochastic(x, "f32", jax.random.key(0))), x)
    with pytest.raises(ValueError, match="bf16, f16, f32"):
        round_stochastic(x, "int8", jax.random.key(0))


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
def test_nearest_equals_ml_dtypes_cast(dt):
    rng = np.random.default_rng(1)
    hi = 45 if dt == BF16 else 17
    x = (rng.standard_normal(4096) * 2.0 ** rng.uniform(-hi, hi, 4096)).astype(np.float32)
    x = np.concatenate([x, np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3e38], np.float32)])
    y = np.asarray(jax.jit(round_nearest, static_argnums=(1,))(jnp.asarray(x), dt))
    assert y.dtype == dt
    with np.errstate(over="ignore"):  # 3e38 -> inf in f16 is the expected IEEE result
        ref = x.astype(dt)
    np.testing.assert_array_equal(y.view(np.uint16), ref.view(np.uint16))


def _ef_run(master, dt, steps):
    def step(res, _):
        served, res = error_feedback_round(master, res, dt)
        # Upcast: served values are compared with the master in f32.
        return res, (served.astype(jnp.float32), res)

    _, (served, res) = jax.lax.scan(step, jnp.zeros_like(master), None, length=steps)
    return served, res


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
def test_error_feedback_mean_converges_and_residual_bounded(dt):
    steps = 512
    rng = np.random.default_rng(2)
    lo_e, hi_e = (-20, 20) if dt == BF16 else (-10, 12)
    # Masters off the grid, at least half an ulp inside their binade.
    frac = rng.uniform(2.0**-7, 1.0 - 2.0**-7, 64)
    master = np.sign(rng.standard_normal(64)) * (1 + frac) * 2.0 ** rng.integers(lo_e, hi_e, 64)
    master = master.astype(np.float32)
    run = jax.jit(_ef_run, static_argnums=(1, 2))
    served, res = (np.asarray(a) for a in run(jnp.asarray(master), dt, steps))
    u = np.asarray(jax.jit(ulp, static_argnums=(1,))(master, dt)).astype(np.float64)
    assert np.all(np.abs(res) <= u / 2), np.max(np.abs(res) / u)
    lo, hi = _neighbours(master, dt)
    assert np.all((served == lo) | (served == hi))
    # Upcast: the running mean in f64; sum(served) = N*master - residual_N exactly.
    mean = served.astype(np.float64).mean(axis=0)
    err = np.abs(mean - master.astype(np.float64))
    assert np.all(err <= u / (2 * steps)), np.max(err / u * steps)
    # Deterministic.
    served2, _ = run(jnp.asarray(master), dt, steps)
    np.testing.assert_array_equal(np.asarray(served2), served)


def test_error_feedback_first_step_is_nearest_and_nonfinite_residual_is_zero():
    x = jnp.array([1.0 + 2.0**-9 + 2.0**-12, -3.3, np.inf, np.nan, 3.4e38], jnp.float32)
    served, res = jax.jit(error_feedback_round, static_argnums=(2,))(x, jnp.zeros_like(x), "bf16")
    assert served.dtype == BF16 and res.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(served)[:2], np.asarray(x)[:2].astype(BF16))
    np.testing.assert_array_equal(np.asarray(res)[2:], 0.0)


def test_ulp_values():
    ulp_jit = jax.jit(ulp, static_argnums=(1,))
    x = np.array([1.0, 1.99, -3.0, 0.0, 2.0**-130, np.inf, np.nan], np.float32)
    u = np.asarray(ulp_jit(x, "bf16"))
    np.testing.assert_array_equal(u[:3], [2.0**-7, 2.0**-7, 2.0**-6])
    # Subnormal ulps compared as bit patterns (numpy keeps f32 subnormals).
    assert u[3] == np.float32(2.0**-133) and u[4] == np.float32(2.0**-133)
    assert u[5] == np.inf and np.isnan(u[6])
    x16 = np.array([1.5, 65504.0, 1e6, 1e-6, 0.0, 2.0**-14], np.float32)
    np.testing.assert_array_equal(
        np.asarray(ulp_jit(x16, "f16")), [2.0**-10, 32.0, 32.0, 2.0**-24, 2.0**-24, 2.0**-24]
    )
    # Agrees with the spacing numpy gives for f16 values.
    h = np.random.default_rng(3).standard_normal(1000).astype(np.float16) * 100
    h = h[np.abs(h) < 65504]
    spacing = np.abs(np.spacing(np.abs(h))).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(ulp_jit(h.astype(np.float32), "f16")), spacing)
