"""The MX block quantize/dequantize Pallas kernels against the numerics reference: bit for bit.

Every kernel runs in Pallas interpret mode on CPU (`kernels="interpret"`) with
a small tile (`TILES`: 16 rows, 4 scale blocks, 16 columns) so that every axis
of the `[P, N, Q]` view ends in a ragged tile (33 rows, 5 or 10 blocks, 33 or
40 columns). Inputs span 60 binades and hold zero blocks, f32 subnormals,
values near the f32 maximum, NaN and +-inf. Tolerance: none (bit-equal codes,
scales, tensor scales and dequantized values; gradients through the
fake-quant matmul bit-equal too).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from pallas_helpers import pallas_kernels

from jaxrl_lp.kernels import KernelUnavailableError, kernel_backend
from jaxrl_lp.kernels.quantize import QuantTiles, dequantize, quantize
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.layers import dot
from jaxrl_lp.models.model import param_shapes
from jaxrl_lp.numerics import formats
from jaxrl_lp.numerics.fake_quant import fake_quant, quantized_matmul
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.sync.export import quantize as quantize_exporter

BLOCK_FORMATS = ("mxfp8", "mxfp4", "nvfp4")
TILES = QuantTiles(rows=16, blocks=4, cols=16)
# (shape, axis, batch_axes): N = 160 is 5 MX blocks or 10 NVFP4 blocks (ragged at 4 a tile).
CASES = {
    "rows33_last_axis": ((33, 160), 1, ()),  # the activation case: [P, N] view
    "weight_axis0": ((160, 40), 0, ()),  # [1, N, Q]
    "stacked_batch0": ((3, 160, 33), 1, (0,)),  # per-layer NVFP4 tensor scales
}
SLOW_CASES = {
    "vector": ((64,), 0, ()),
    "four_axes": ((2, 3, 96, 5), 2, (0,)),
    "leading_axis_rows": ((96, 3, 33), 0, (1,)),
}


def _input(shape, seed=0, dtype=np.float32):
    """Wide-range values plus zero, subnormal, huge, NaN and inf entries (own blocks)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
    flat = x.reshape(-1)
    n = flat.size
    flat[: min(64, n // 4)] = 0.0  # whole zero blocks
    specials = [1e-40, -3e-42, 2e-45, 3.0e38, -3.4e38, np.nan, np.inf, -np.inf]
    idx = rng.choice(np.arange(n // 4, n), size=len(specials), replace=False)
    flat[idx] = specials
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_qarrays_bit_equal(got, want):
    assert (got.format, got.axis, got.batch_axes) == (want.format, want.axis, want.batch_axes)
    for a, b in ((got.codes, want.codes), (got.scales, want.scales)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert (got.tensor_scale is None) == (want.tensor_scale is None)
    if want.tensor_scale is not None:
        np.testing.assert_array_equal(_bits(got.tensor_scale), _bits(want.tensor_scale))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(x, fmt, axis, batch, kernels):
    return quantize(x, fmt, axis, batch, kernels=kernels, tiles=TILES)


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(q, kernels):
    return dequantize(q, kernels=kernels, tiles=TILES)


def _check_case(fmt, shape, axis, batch, dtype=np.float32):
    x = _input(shape, dtype=dtype)
    want = _quantize(x, fmt, axis, batch, "off")
    _assert_qarrays_bit_equal(_quantize(x, fmt, axis, batch, "interpret"), want)
    np.testing.assert_array_equal(_bits(_dequantize(want, "interpret")),
                                  _bits(_dequantize(want, "off")))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernel_quantize_and_dequantize_are_bit_equal_to_the_reference(fmt, case):
    _check_case(fmt, *CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("case", list(SLOW_CASES))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernel_quantize_sweep(fmt, case, dtype):
    _check_case(fmt, *SLOW_CASES[case], dtype=dtype)


def test_default_tiles_and_per_tensor_formats():
    x = _input((33, 96))
    _assert_qarrays_bit_equal(quantize(x, "mxfp8", 1, kernels="interpret"),
                              formats.quantize(x, "mxfp8", 1))
    # Per-tensor formats have no kernel: the reference runs, whatever the mode.
    assert pallas_kernels(lambda x: quantize(x, "fp8", 1, kernels="interpret").codes, x) == []
    _assert_qarrays_bit_equal(quantize(x, "fp8", 1, kernels="interpret"),
                              formats.quantize(x, "fp8", 1))


# ------------------------------------------------------ fake-quant matmul: values and gradients
@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _qmm_vjp(x, w, g, fmt, backward, kernels):
    y, pullback = jax.vjp(lambda x, w: quantized_matmul(x, w, fmt, backward, (0, 1), kernels), x, w)
    return y, pullback(g)


@pytest.mark.parametrize("backward", ["reuse", "fresh"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_quantized_matmul_values_and_gradients_are_bit_equal(fmt, backward):
    # T = 2 * 9 = 18 tokens: the fresh backward pads the token axis to a block multiple.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 9, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 9, 48)), jnp.float32)
    want = _qmm_vjp(x, w, g, fmt, backward, "off")
    got = _qmm_vjp(x, w, g, fmt, backward, "interpret")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    grad = jax.grad(lambda x: fake_quant(x, fmt, 1, kernels="interpret").sum())(x[0])
    np.testing.assert_array_equal(grad, np.ones_like(x[0]))  # straight-through


def test_policy_kernels_field_picks_the_kernel_in_the_model_matmul():
    x, w = jnp.ones((2, 3, 64)), jnp.ones((64, 32))
    names = lambda pol: pallas_kernels(lambda x, w: dot(x, w, Policy.parse(pol)), x, w)
    assert names("mxfp8") == []  # auto on CPU: the reference, the recorded program
    assert names("mxfp8,k=off") == []
    assert sorted(names("mxfp8,k=interpret")) == ["mxfp8_dequantize"] * 2 + ["mxfp8_quantize"] * 2


# ------------------------------------------------------------------------------ the exporter
@pytest.fixture(scope="module")
def master():
    cfg = get_preset("tiny-qwen3")
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.02, s), jnp.float32),
                        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_exporter_with_kernels_serves_the_same_bits(master, fmt):
    default = quantize_exporter(fmt, include_lm_head=True)
    kernel = quantize_exporter(fmt, include_lm_head=True, kernels="interpret")
    want, _ = jax.jit(default.apply)(master, default.init(master))
    got, _ = jax.jit(kernel.apply)(master, kernel.init(master))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert pallas_kernels(lambda p: default.apply(p, ())[0], master) == []
    assert f"{fmt}_quantize" in pallas_kernels(lambda p: kernel.apply(p, ())[0], master)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.skipif(kernel_backend() is not None, reason="a Pallas backend is present")
def test_kernels_on_where_pallas_cannot_run_is_one_clear_error(master):
    x = jnp.ones((4, 64))
    msg = r"kernel 'quantize'.*kernels=on.*cpu backend cannot compile Pallas"
    with pytest.raises(KernelUnavailableError, match=msg):
        quantize(x, "mxfp8", 1, kernels="on")
    with pytest.raises(KernelUnavailableError, match=msg):
        dot(x, jnp.ones((64, 8)), Policy.parse("mxfp8,k=on"))
    with pytest.raises(KernelUnavailableError, match=msg):
        quantize_exporter("mxfp8", kernels="on").apply(master, ())


def test_block_size_not_dividing_the_reduction_axis_is_one_clear_error(master):
    with pytest.raises(ValueError, match=r"shape \(33, 48\) and axis 1 has length 48, which is "
                                         r"not a multiple of the block size 32"):
        quantize(jnp.ones((33, 48)), "mxfp8", axis=1, kernels="interpret")
    with pytest.raises(ValueError, match=r"shape \(40,\) .* not a multiple of the block size 16"):
        quantize(jnp.ones(40), "nvfp4", kernels="interpret")
    bad = {**master, "layers": {**master["layers"], "o_proj": jnp.zeros((2, 48, 64))}}
    with pytest.raises(ValueError, match=r"'layers/o_proj' of shape \(2, 48, 64\).*block size 32"):
        quantize_exporter("mxfp8", kernels="interpret").apply(bad, ())


def test_unknown_kernels_mode_is_an_error():
    with pytest.raises(ValueError, match=r"kernels 'fast' is not one of"):
        quantize_exporter("mxfp8", kernels="fast")
    with pytest.raises(ValueError, match=r"kernels 'fast' is not one of"):
        quantize(jnp.ones(32), "mxfp8", kernels="fast")
