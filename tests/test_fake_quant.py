"""Tests of fake quantization and the quantized matmul's reuse / fresh backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.kernels.fake_quant import fake_quant, quantized_matmul
from jaxrl_lp.numerics import FORMATS

HI = jax.lax.Precision.HIGHEST


def _operands(t=40, k=64, n=48, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x_BxTxK = jax.random.normal(kx, (3, t, k), jnp.float32)
    w_KxN = jax.random.normal(kw, (k, n), jnp.float32) * 0.1
    g_BxTxN = jax.random.normal(kg, (3, t, n), jnp.float32)
    return x_BxTxK, w_KxN, g_BxTxN


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _vjp(x, w, g, fmt, backward, batch_axes=()):
    """Forward output and (dx, dw) for cotangent g."""
    y, pullback = jax.vjp(lambda x, w: quantized_matmul(x, w, fmt, backward, batch_axes), x, w)
    return y, pullback(g)


def _mm(a, b):
    return jnp.matmul(a, b, precision=HI, preferred_element_type=jnp.float32)


@jax.jit
def _plain_vjp(x, w, g):
    y, pullback = jax.vjp(_mm, x, w)
    return y, pullback(g)


def _rel(a, b) -> float:
    # Upcast: error norms in f64.
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fake_quant_value_and_identity_gradient(fmt):
    x = jax.random.normal(jax.random.key(1), (64, 16), jnp.float32)
    c = jax.random.normal(jax.random.key(2), (64, 16), jnp.float32)

    @jax.jit
    def run(x, c):
        q = fake_quant(x, fmt, 0)
        grad = jax.grad(lambda x: jnp.sum(fake_quant(x, fmt, 0) * c))(x)
        _, tangent = jax.jvp(lambda x: fake_quant(x, fmt, 0), (x,), (c,))
        return q, grad, tangent

    q, grad, tangent = run(x, c)
    assert q.dtype == jnp.float32
    assert not np.array_equal(np.asarray(q), np.asarray(x))  # it did quantize
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(c))  # straight through
    # Forward mode agrees (custom_jvp): the tangent passes through unchanged.
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(c))


def test_fake_quant_none_is_identity():
    x = jnp.linspace(-1, 1, 64, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(fake_quant(x, None, 0)), np.asarray(x))


def test_no_quantization_equals_plain_matmul_in_both_modes():
    x, w, g = _operands()
    y_ref, (dx_ref, dw_ref) = _plain_vjp(x, w, g)
    for backward in ("reuse", "fresh"):
        y, (dx, dw) = _vjp(x, w, g, None, backward)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4", "nvfp4", "ternary"])
def test_reuse_gradient_is_the_hand_formula(fmt):
    x, w, g = _operands()
    y, (dx, dw) = _vjp(x, w, g, fmt, "reuse")
    act = FORMATS[fmt].quantizes_activations
    xq = jax.jit(lambda x: fake_quant(x, fmt, -1))(x) if act else x
    wq = jax.jit(lambda w: fake_quant(w, fmt, 0))(w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(_mm(xq, wq)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(_mm(g, wq.T)), rtol=1e-6, atol=1e-6)
    dw_ref = _mm(xq.reshape(-1, 64).T, g.reshape(-1, 48))
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-6, atol=1e-5)


def test_fresh_gradient_is_the_hand_formula_with_padding():
    # T = 3 * 40 = 120 tokens (padded to 128) and N = 48 (padded to 64) for mxfp8.
    x, w, g = _operands()
    _, (dx, dw) = _vjp(x, w, g, "mxfp8", "fresh")
    fq = jax.jit(fake_quant, static_argnums=(1, 2))
    w_pad = jnp.pad(w, ((0, 0), (0, 16)))
    g_pad = jnp.pad(g, ((0, 0), (0, 0), (0, 16)))
    dx_ref = _mm(fq(g_pad, "mxfp8", -1)[..., :48], fq(w_pad, "mxfp8", 1)[:, :48].T)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-6, atol=1e-6)
    x_TxK = jnp.pad(x.reshape(-1, 64), ((0, 8), (0, 0)))
    g_TxN = jnp.pad(g.reshape(-1, 48), ((0, 8), (0, 0)))
    dw_ref = _mm(fq(x_TxK, "mxfp8", 0)[:120].T, fq(g_TxN, "mxfp8", 0)[:120])
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_reuse_and_fresh_differ_for_block_formats(fmt):
    x, w, g = _operands()
    y_r, (dx_r, dw_r) = _vjp(x, w, g, fmt, "reuse")
    y_f, (dx_f, dw_f) = _vjp(x, w, g, fmt, "fresh")
    np.testing.assert_array_equal(np.asarray(y_r), np.asarray(y_f))  # same forward
    assert _rel(dx_f, dx_r) > 1e-3 and _rel(dw_f, dw_r) > 1e-3
    # Both are close to the unquantized gradient (the format's error, not garbage).
    _, (dx_ref, dw_ref) = _plain_vjp(x, w, g)
    tol = 0.05 if fmt == "mxfp8" else 0.4
    assert _rel(dx_r, dx_ref) < tol and _rel(dx_f, dx_ref) < tol
    assert _rel(dw_r, dw_ref) < tol and _rel(dw_f, dw_ref) < tol


@pytest.mark.parametrize("fmt", ["ternary", "binary"])
def test_weights_only_formats_reuse_equals_fresh(fmt):
    x, w, g = _operands()
    _, (dx_r, dw_r) = _vjp(x, w, g, fmt, "reuse")
    _, (dx_f, dw_f) = _vjp(x, w, g, fmt, "fresh")
    np.testing.assert_array_equal(np.asarray(dx_r), np.asarray(dx_f))
    np.testing.assert_array_equal(np.asarray(dw_r), np.asarray(dw_f))


def test_cotangent_dtypes_follow_primals():
    x, w, g = _operands()
    x16 = x.astype(jnp.bfloat16)
    y, (dx, dw) = _vjp(x16, w, g, "mxfp8", "fresh")
    assert y.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


def test_per_token_activation_scales_make_tokens_independent():
    x, w, _ = _operands()
    f = jax.jit(quantized_matmul, static_argnums=(2, 3, 4))
    y_all = f(x, w, "fp8", "reuse", (0, 1))
    y_one = f(x[1:2, 7:8], w, "fp8", "reuse", (0, 1))
    # The same quantized operands; only the f32 matmul's rounding may differ with the row
    # count (XLA:CPU picks its kernel by shape: 3e-7 on an AVX-512 machine, 0 on others).
    np.testing.assert_allclose(np.asarray(y_all[1:2, 7:8]), np.asarray(y_one), atol=1e-6)
    # Without batch axes the activation scale is per tensor, so the row changes (by 8e-2).
    y_tensor = f(x[1:2, 7:8], w, "fp8", "reuse", ())
    y_all_tensor = f(x, w, "fp8", "reuse", ())
    assert np.abs(np.asarray(y_all_tensor[1:2, 7:8]) - np.asarray(y_tensor)).max() > 1e-2


def test_no_recompile_on_second_call():
    x, w, _ = _operands()

    @jax.jit
    def loss_grad(x, w):
        return jax.grad(lambda w: jnp.sum(quantized_matmul(x, w, "mxfp8", "fresh") ** 2))(w)

    loss_grad(x, w)
    loss_grad(x * 2.0, w + 1.0)
    assert loss_grad._cache_size() == 1


def test_invalid_arguments():
    x, w, _ = _operands()
    with pytest.raises(ValueError, match="reuse"):
        quantized_matmul(x, w, "mxfp8", "later")
    with pytest.raises(ValueError, match="allowed"):
        quantized_matmul(x, w, "int3")
    with pytest.raises(ValueError, match=r"\[\.\.\., K\]"):
        quantized_matmul(x, w.T, "fp8")
    with pytest.raises(ValueError, match="pad"):
        quantized_matmul(x[..., :48], w[:48], "mxfp8")
    with pytest.raises(ValueError, match="leading axis"):
        quantized_matmul(x, w, "fp8", "reuse", (2,))
