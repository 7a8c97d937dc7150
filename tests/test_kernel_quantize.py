"""The MX block quantize/dequantize Pallas kernels against the numerics reference: bit for bit.

Both versions run in Pallas interpret mode on CPU: `kernels="interpret"` (the
cuda version) with a small tile (`TILES`: 16 rows, 4 scale blocks, 16
columns) so that every axis of the `[P, N, Q]` view ends in a ragged tile (33
rows, 5 or 10 blocks, 33 or 40 columns), and `kernels="interpret-tpu"` (the
tpu version) with its default tiles on shapes (`TPU_CASES`) where those end
ragged too (40 rows of 32; 160 or 320 blocks of 128; 40 or 80 blocks of 32;
200 columns of 128). Inputs span 60 binades and hold zero blocks, f32
subnormals, values near the f32 maximum, NaN and +-inf. Tolerance: none
(bit-equal codes, scales, tensor scales and dequantized values; gradients
through the fake-quant matmul bit-equal too), with one exception: a NaN
compares equal to a NaN of the other sign. The sign of a NaN made by an
invalid operation is not defined, and XLA on this CPU gives either sign for
the same `inf / inf` (an NVFP4 block holding inf in a tensor whose scale is
inf) depending on how it fuses the program. The integer codecs the kernels
round with are checked against XLA's conversions on their own (every code,
every midpoint and its neighbours). A slow test runs the tpu version under
Pallas's TPU interpreter with NaN in uninitialized memory (a ragged block's
padding on a device).

Lowering (what a device compiler gets) is checked on abstract inputs at the
preset shapes for `tpu`; for `cuda`, whose versions are retired from compiled
use (`kernels.dispatch.RETIRED`), `kernels=on` refuses.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from pallas_helpers import pallas_kernels

from jaxrl_lp.kernels import KernelUnavailableError
from jaxrl_lp.kernels.fake_quant import fake_quant, quantized_matmul
from jaxrl_lp.kernels.float_bits import E2M1, E4M3, decode, encode, from_bits, to_bits
from jaxrl_lp.kernels.lowering import kernel_calls, lower_for, trace_for
from jaxrl_lp.kernels.quantize import TPU_TILES, QuantTiles, dequantize, quantize
from jaxrl_lp.kernels.quantize_plan import tpu_misfit
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.layers import dot
from jaxrl_lp.models.model import param_shapes
from jaxrl_lp.numerics import formats
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
TPU_CASES = {
    "rows40_last_axis": ((40, 5120), 1, ()),  # [P, N]: 32 + 8 rows, 128 + 32 (MX) blocks
    "weight_axis0": ((1280, 200), 0, ()),  # [1, N, Q]: 32 + 8 (MX) blocks, 128 + 72 cols
    "stacked_batch0": ((2, 1280, 200), 1, (0,)),
}
SLOW_CASES = {
    "vector": ((64,), 0, ()),
    "four_axes": ((2, 3, 96, 5), 2, (0,)),
    "leading_axis_rows": ((96, 3, 33), 0, (1,)),
}
# The preset shapes lowered for cuda and tpu: a weight [in, out] along axis 0, activations [T, D].
LOWERED = {"weight": ((2560, 9728), 0), "activations": ((4096, 2560), 1)}


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


def _assert_same_bits(got, want):
    """Bit-equal arrays of one dtype and shape, a NaN equal to a NaN of either sign (docstring)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


def _assert_qarrays_bit_equal(got, want):
    assert (got.format, got.axis, got.batch_axes) == (want.format, want.axis, want.batch_axes)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _assert_same_bits(a, b)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(x, fmt, axis, batch, kernels):
    return quantize(x, fmt, axis, batch, kernels=kernels, tiles=TILES)


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(q, kernels):
    return dequantize(q, kernels=kernels, tiles=TILES)


def _check_case(fmt, shape, axis, batch, mode="interpret", dtype=np.float32):
    x = _input(shape, dtype=dtype)
    want = _quantize(x, fmt, axis, batch, "off")
    _assert_qarrays_bit_equal(_quantize(x, fmt, axis, batch, mode), want)
    _assert_same_bits(_dequantize(want, mode), _dequantize(want, "off"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_cuda_version_is_bit_equal_to_the_reference(fmt, case):
    _check_case(fmt, *CASES[case])


@pytest.mark.parametrize("case", list(TPU_CASES))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_tpu_version_is_bit_equal_to_the_reference(fmt, case):
    shape, axis, _ = TPU_CASES[case]
    view = (int(np.prod(shape[:axis])), shape[axis], int(np.prod(shape[axis + 1:])))
    view = view[:2] if view[2] == 1 else view
    bs = formats.FORMATS[fmt].block_size
    assert tpu_misfit(view, bs, TPU_TILES[len(view)], np.dtype(np.float32)) is None  # its real plan
    _check_case(fmt, *TPU_CASES[case], mode="interpret-tpu", dtype=ml_dtypes.bfloat16)


@pytest.mark.slow
@pytest.mark.usefixtures("tpu_interpreter")
@pytest.mark.parametrize("case", list(TPU_CASES))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_tpu_version_under_the_tpu_interpreter(fmt, case):
    _check_case(fmt, *TPU_CASES[case], mode="interpret-tpu")


@pytest.mark.parametrize("mode", ["interpret", "interpret-tpu"])
# bf16 inputs (what a bf16 policy quantizes) in the default suite, about 6 s in all; f32 in
# the slow tier.
@pytest.mark.parametrize("dtype", [pytest.param(np.float32, marks=pytest.mark.slow),
                                   ml_dtypes.bfloat16])
@pytest.mark.parametrize("case", list(SLOW_CASES))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernel_quantize_sweep(fmt, case, dtype, mode):
    _check_case(fmt, *SLOW_CASES[case], mode=mode, dtype=dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_default_tiles(x, fmt, axis, kernels):
    return quantize(x, fmt, axis, kernels=kernels)


# The shapes a review found the GPU version's default tiles off at on bf16 input along axis 0
# (64 x 96, 96 x 40, 160 x 40), and a ragged MX one. What it saw, XLA's divisions by a constant
# or a broadcast turned into reciprocal products (tensor scale, and block scales where a tile
# holds one block), is checked as a property over random inputs in tests/test_nvfp4_tensor_scale.py.
DEFAULT_TILE_SHAPES = ((64, 96), (96, 40), (160, 40), (96, 192))


@pytest.mark.parametrize("mode", ["interpret", "interpret-tpu"])
# bf16 in the default suite (about 12 s), f32 in the slow tier.
@pytest.mark.parametrize("dtype", [pytest.param(np.float32, marks=pytest.mark.slow),
                                   ml_dtypes.bfloat16])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_default_tiles_are_bit_equal_on_both_axes(fmt, dtype, mode):
    """Each version at its own default tiles (no `tiles=`), both axes, bf16 and f32 input."""
    bs = formats.get_format(fmt).block_size
    checked = 0
    for shape in DEFAULT_TILE_SHAPES:
        for axis in (0, 1):
            if shape[axis] % bs:
                continue
            x = _input(shape, seed=shape[0] + axis, dtype=dtype)
            _assert_qarrays_bit_equal(_quantize_default_tiles(x, fmt, axis, mode),
                                      _quantize_default_tiles(x, fmt, axis, "off"))
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn])
def test_the_kernels_bit_codecs_are_xlas_conversions(dtype):
    """`encode` (RNE in integer arithmetic) on every value of the format, every midpoint between
    two and their f32 neighbours, f32 subnormals, +-0 and NaN; `decode` on every code."""
    f, top = {ml_dtypes.float8_e4m3fn: (E4M3, 448.0), ml_dtypes.float4_e2m1fn: (E2M1, 6.0)}[dtype]
    n = 1 << (1 + f.exp_bits + f.man_bits)
    codes = jnp.arange(n, dtype=jnp.int32)
    values = np.asarray(jax.jit(lambda c: from_bits(c.astype(jnp.uint8), dtype))(codes), np.float32)
    grid = np.unique(values[np.abs(values) <= top])
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    tiny = rng.standard_normal(4096) * np.exp2(rng.integers(-149, -5, 4096))
    x = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        np.clip(tiny, -top, top), [0.0, -0.0, 1e-45, np.nan, -np.nan]])
    x = jnp.asarray(x.astype(np.float32))
    np.testing.assert_array_equal(jax.jit(lambda x: encode(x, f))(x),
                                  jax.jit(lambda x: to_bits(x.astype(dtype)))(x))
    np.testing.assert_array_equal(_bits(jax.jit(lambda c: decode(c, f))(codes)), _bits(values))


def test_default_tiles_and_per_tensor_formats():
    x = _input((33, 96))
    for mode in ("interpret", "interpret-tpu"):
        _assert_qarrays_bit_equal(quantize(x, "mxfp8", 1, kernels=mode),
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
    for mode in ("auto", "interpret"):
        got = _qmm_vjp(x, w, g, fmt, backward, mode)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    grad = jax.grad(lambda x: fake_quant(x, fmt, 1, kernels="interpret").sum())(x[0])
    np.testing.assert_array_equal(grad, np.ones_like(x[0]))  # straight-through


def test_policy_kernels_field_picks_the_kernel_in_the_model_matmul():
    x, w = jnp.ones((2, 3, 64)), jnp.ones((64, 32))
    names = lambda pol: pallas_kernels(lambda x, w: dot(x, w, Policy.parse(pol)), x, w)
    assert names("mxfp8,k=off") == []
    assert sorted(names("mxfp8,k=interpret")) == ["mxfp8_dequantize"] * 2 + ["mxfp8_quantize"] * 2
    # auto: the kernels where the program is lowered for a TPU, the reference for cpu and for
    # cuda (our GPU versions are retired, `kernels.dispatch.RETIRED`).
    traced = trace_for(lambda x, w: dot(x, w, Policy.parse("mxfp8")), [x, w])
    assert kernel_calls(lower_for(traced, "cpu"), "cuda") == []
    assert "custom_call" not in lower_for(traced, "cpu")
    assert kernel_calls(lower_for(traced, "cuda"), "cuda") == []
    assert sorted(kernel_calls(lower_for(traced, "tpu"), "tpu")) == [
        "mxfp8_dequantize", "mxfp8_quantize"]  # one call each: traced once per shape


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
    assert "custom_call" not in lower_for((lambda p: default.apply(p, ())[0], [master]), "cpu")
    assert f"{fmt}_quantize" in pallas_kernels(lambda p: kernel.apply(p, ())[0], master)


# ------------------------------------------------------------------------------ lowering
@pytest.mark.parametrize("case", list(LOWERED))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernels_lower_for_tpu_and_refuse_cuda_at_preset_shapes(fmt, case):
    """bf16 weights [2560, 9728] along axis 0 and activations [4096, 2560] along axis 1: one
    trace lowers under `on` for tpu (v5p), kernel calls included, and refuses cuda (retired,
    `kernels.dispatch.RETIRED`); under `auto` the same program lowered for cpu calls no
    kernel."""
    shape, axis = LOWERED[case]
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)]
    fake = lambda mode: lambda x: dequantize(quantize(x, fmt, axis, kernels=mode), kernels=mode)
    traced = trace_for(fake("on"), args, targets=["h100", "tpu-v5p"])
    want = [f"{fmt}_quantize", f"{fmt}_dequantize"]
    with pytest.raises(KernelUnavailableError, match="retired"):
        lower_for(traced, "cuda", "h100")
    assert kernel_calls(lower_for(traced, "tpu", "tpu-v5p"), "tpu") == want
    on_cpu = lower_for(trace_for(fake("auto"), args), "cpu")
    assert kernel_calls(on_cpu, "cuda") == kernel_calls(on_cpu, "tpu") == []


# ------------------------------------------------------------------------------ bad input
def test_kernels_on_where_pallas_cannot_run_is_one_clear_error(master):
    x = jnp.ones((4, 64))
    msg = r"kernel 'mxfp8_quantize' \(kernels=on\) has no version for cpu"
    with pytest.raises(KernelUnavailableError, match=msg):
        quantize(x, "mxfp8", 1, kernels="on")
    with pytest.raises(KernelUnavailableError, match=msg):
        lower_for((lambda x: quantize(x, "mxfp8", 1, kernels="on").codes, [x]), "cpu")
    with pytest.raises(KernelUnavailableError, match="has no version for cpu"):
        jax.jit(lambda x: dot(x, jnp.ones((64, 8)), Policy.parse("mxfp8,k=on")))(x)
    with pytest.raises(KernelUnavailableError, match=msg):
        quantize_exporter("mxfp8", kernels="on").apply(master, ())


def test_shapes_and_tiles_a_compiled_kernel_cannot_take():
    """`on` raises when lowered for the platform that cannot take them, naming the tile (cuda:
    the retirement); `auto` lowers the reference there."""
    # Activations [33, 160] along axis 1: N = 160 lanes is not a multiple of 128 (tpu only).
    x = [jax.ShapeDtypeStruct((33, 160), jnp.float32)]
    codes = lambda mode: lambda x: quantize(x, "mxfp8", 1, kernels=mode).codes
    traced = trace_for(codes("on"), x)
    with pytest.raises(KernelUnavailableError, match=r"'mxfp8_quantize' \(kernels=on\) does not fit "
                       r"tpu: the tile \[32, 160\] \(5 blocks of 32\).*N=160 is not a multiple "
                       r"of the 128 lanes"):
        lower_for(traced, "tpu")
    with pytest.raises(KernelUnavailableError, match="retired"):
        lower_for(traced, "cuda")
    assert kernel_calls(lower_for(trace_for(codes("auto"), x), "tpu"), "tpu") == []
    # Interpreted, any tile runs.
    odd = QuantTiles(rows=24, blocks=3)
    y = _input((33, 160))
    _assert_qarrays_bit_equal(quantize(y, "mxfp8", 1, kernels="interpret", tiles=odd),
                              formats.quantize(y, "mxfp8", 1))


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
