"""`models.layers.scale_features`: the norm weights' gradient as a product on XLA:CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.models.layers import rms_norm, scale_features
from jaxrl_lp.numerics.policy import Policy


def _inputs(shape, seed=0):
    ky, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ky, shape), 1.0 + 0.1 * jax.random.normal(kw, shape[-1:]),
            jax.random.normal(kg, shape))


def _grads(fn, y, w, g):
    _, vjp = jax.vjp(fn, y, w)
    return jax.jit(vjp)(g)


@pytest.mark.parametrize("shape", [(1, 1024, 512), (2, 64, 4, 16), (7, 32)])
def test_the_gradients_are_autodiffs(shape):
    """The value and the input's gradient are the plain product's bits; the weight's gradient
    is its sum over every leading axis, in another order (f32 summation error only)."""
    y, w, g = _inputs(shape)
    plain = lambda y, w: y * w
    assert np.array_equal(jax.jit(scale_features)(y, w), jax.jit(plain)(y, w))
    dy, dw = _grads(scale_features, y, w, g)
    dy0, dw0 = _grads(plain, y, w, g)
    assert np.array_equal(dy, dy0)
    want = np.sum(np.asarray(g, np.float64) * np.asarray(y, np.float64),
                  axis=tuple(range(len(shape) - 1)))
    scale = np.sqrt(np.prod(shape[:-1]))  # the terms are O(1): the sum's size grows as sqrt(n)
    np.testing.assert_allclose(dw, want, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(dw0, want, rtol=0, atol=1e-5 * scale)


def test_a_one_axis_input_has_no_leading_axes():
    """A [D] input (nothing to sum over) gets `g * y` as the weight's gradient, exactly."""
    y, w, g = _inputs((16,))
    dy, dw = _grads(scale_features, y, w, g)
    assert np.array_equal(dw, g * y) and np.array_equal(dy, g * w)


def test_rms_norm_differentiates_through_it():
    """The norm region's weight gradient is the plain norm's up to summation order."""
    x, w, g = _inputs((2, 48, 64), seed=1)
    policy = Policy.parse("fp32")
    assert policy.has("norm")
    _, vjp = jax.vjp(lambda x, w: rms_norm(x, w, 1e-6, policy), x, w)
    dx, dw = vjp(g)
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    _, vjp0 = jax.vjp(lambda x, w: x * inv * w, x, w)  # the weight's part of the same norm
    np.testing.assert_allclose(dw, vjp0(g)[1], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(dx))


def _weight_grad_text(platform: str) -> str:
    y, w, g = _inputs((1, 256, 64))
    dw = lambda y, w, g: jax.vjp(scale_features, y, w)[1](g)[1]
    return jax.jit(dw).trace(y, w, g).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gpu_and_tpu_lower_the_reduce(platform):
    """The product is chosen by the platform lowered for (`jax.lax.platform_dependent`):
    an accelerator's program sums with a reduce and has no matmul; a CPU program has the
    product."""
    text = _weight_grad_text(platform)
    assert "stablehlo.reduce" in text and "stablehlo.dot_general" not in text
    assert "stablehlo.dot_general" in _weight_grad_text("cpu")


def test_the_cpu_product_is_fast_where_the_reduce_is_not():
    """What the product is for, in compiled work rather than time: XLA:CPU's program for the
    weight gradient of a [1024, 512] activation holds a dot, and no reduce over the token
    axis."""
    y, w, g = _inputs((1, 1024, 512))
    dw = lambda y, w, g: jax.vjp(scale_features, y, w)[1](g)[1]
    hlo = jax.jit(dw).lower(y, w, g).compile().as_text()
    assert " dot(" in hlo
    assert "dimensions={1}" not in hlo  # the column reduce autodiff's product compiles to
