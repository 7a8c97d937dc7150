"""Per-tensor FP8 products as FP8 GEMMs on a GPU, and the decode's weights quantized once.

A program lowered for cuda multiplies the FP8 codes themselves (`fake_quant.fp8_codes_product`,
XLA:GPU's FP8 GEMM) where every other platform keeps the reference product of the rebuilt
f32 values; the decode copy (`blocks.decode_weights`) holds each matmul weight as its `QArray`
`Q(w)`, so the decode loop reads codes and quantizes nothing, with the same bits on CPU.
Each mechanism is also removed here (planted) and the check watched to fail.
"""

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.bench.decode import report
from jaxrl_lp.kernels.fake_quant import (
    FP8_GEMM_FORMATS,
    QUANTIZED_WEIGHT_FORMATS,
    _dot,
    _value,
    fp8_codes_product,
    quantized_matmul,
)
from jaxrl_lp.kernels.quantize import quantize
from jaxrl_lp.models.blocks import MATMUL_WEIGHTS, unstack_layers
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import forward, init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.qarray import QArray
from jaxrl_lp.plan.cuda_aot import plugin_from_env

FP8 = Policy.parse("fp8")
_BLOCKS = "jaxrl_lp.models.blocks"


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((3, 5, 256)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((256, 96)) * 0.05).astype(np.float32))
    return x, w


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _operand_pairs(fmt):
    """(a, b, a_axis, b_axis) as the three products quantize them: the forward's `x @ w` (a
    scale a token), the `fresh` backward's `dx = Q(g) @ Q(w).T` (a scale a token) and
    `dw = Q(x).T @ Q(g)` (over the tokens, one scale each)."""
    x, w = _operands()
    g = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 96)).astype(np.float32))
    x2, g2 = x.reshape(15, 256), g.reshape(15, 96)
    return [(quantize(x, fmt, -1, (0, 1)), quantize(w, fmt, 0, ()), -1, 0),
            (quantize(g, fmt, -1, (0, 1)), quantize(w, fmt, 1, ()), -1, 1),
            (quantize(x2, fmt, 0, ()), quantize(g2, fmt, 0, ()), 0, 0)]


@pytest.mark.parametrize("fmt", FP8_GEMM_FORMATS)
def test_the_codes_product_is_the_reference_within_f32_rounding(fmt):
    """What a GPU runs, computed here: `(c_a . c_b) * s_a * s_b` against the f32 product of
    the rebuilt values, for each of the three products. Each code product is exact in f32,
    so they differ by the order of f32 roundings only (measured 1.5e-7 of the sum of
    magnitudes; bound 1e-6)."""
    for aq, bq, a_axis, b_axis in _operand_pairs(fmt):
        ref = _dot(_value(aq, "auto"), _value(bq, "auto"), a_axis, b_axis)
        mag = _dot(jnp.abs(_value(aq, "auto")), jnp.abs(_value(bq, "auto")), a_axis, b_axis)
        got = jax.jit(fp8_codes_product, static_argnums=(2, 3))(aq, bq, a_axis, b_axis)
        assert got.shape == ref.shape
        assert float(jnp.max(jnp.abs(got - ref) / mag)) < 1e-6
    # The per-token scales matter: one token's scale for every token is far off.
    xq, wq, _, _ = _operand_pairs(fmt)[0]
    one = dataclasses.replace(xq, scales=jnp.broadcast_to(xq.scales[:1, :1], xq.scales.shape))
    ref = _dot(_value(xq, "auto"), _value(wq, "auto"), -1, 0)
    mag = _dot(jnp.abs(_value(xq, "auto")), jnp.abs(_value(wq, "auto")), -1, 0)
    assert float(jnp.max(jnp.abs(fp8_codes_product(one, wq) - ref) / mag)) > 1e-2
    with pytest.raises(ValueError, match="one scale for the second operand"):
        fp8_codes_product(wq, xq)


def _f8_dots(fn, *args, platform: str) -> tuple[int, int]:
    """(dot_generals with FP8 operands, all dot_generals) of `fn` lowered for `platform`."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    return sum("xf8E" in d for d in dots), len(dots)


@pytest.mark.parametrize("backward", ["reuse", "fresh"])
@pytest.mark.parametrize("fmt", FP8_GEMM_FORMATS)
def test_the_products_are_fp8_gemms_lowered_for_cuda_only(fmt, backward):
    """The loss and its gradient: lowered for cuda the forward's product takes FP8 operands,
    and under `fresh` the backward's two as well (`reuse`'s multiply the f32 cotangent); for
    cpu and tpu, under `kernels=off` on cuda, and in a block format none does."""
    x, w = _operands()

    def loss(x, w, fmt=fmt, kernels="auto"):
        f = lambda x, w: quantized_matmul(x, w, fmt, backward, (0, 1), kernels=kernels)
        return jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))(x, w)

    assert _f8_dots(loss, x, w, platform="cuda") == ((1, 3) if backward == "reuse" else (3, 3))
    for platform in ("cpu", "tpu"):
        assert _f8_dots(loss, x, w, platform=platform) == (0, 3)
    assert _f8_dots(lambda x, w: loss(x, w, kernels="off"), x, w, platform="cuda") == (0, 3)
    assert _f8_dots(lambda x, w: loss(x, w, fmt="mxfp8"), x, w, platform="cuda") == (0, 3)


@pytest.mark.parametrize("backward", ["reuse", "fresh"])
@pytest.mark.parametrize("fmt", QUANTIZED_WEIGHT_FORMATS)
def test_a_weight_quantized_already_is_taken_as_its_codes(fmt, backward):
    """`quantized_matmul(x, Q(w))` is `quantized_matmul(x, w)` in value bit for bit,
    per-tensor FP8 and MX formats, and its input gradient is that of `Q(w)`'s value as a
    plain weight: `w`'s too except under `fresh` in a block format (which quantizes the
    weight along N). The quantized weight's codes get a zero gradient. A layer of a stacked
    `[L, K, N]` QArray (its block axis the stack's) too."""
    x, w = _operands()
    g = jnp.ones((3, 5, 96), jnp.float32)

    def vjp(w_or_q):
        y, pull = jax.vjp(lambda x, w: quantized_matmul(x, w, fmt, backward, (0, 1)), x, w_or_q)
        return y, pull(g)

    y, (dx, _) = jax.jit(vjp)(w)
    stacked = quantize(jnp.stack([w * 3.0, w]), fmt, 1, (0,))
    for wq in (quantize(w, fmt, 0, ()), jax.tree.map(lambda a: a[1], stacked)):
        y_q, (dx_q, dwq) = jax.jit(vjp)(wq)
        value = _value(dataclasses.replace(wq, axis=0), "auto")  # a layer's blocks: axis 0
        y_v, (dx_v, _) = jax.jit(vjp)(value)  # its value as a plain weight
        assert (_bits(y_q) == _bits(y)).all() and (_bits(y_v) == _bits(y)).all()
        assert (_bits(dx_q) == _bits(dx_v)).all()
        # `fresh` quantizes the weight along N for dx: a block format's `Q(w)` there is not
        # `w` (per-tensor, the axis does not matter).
        assert (_bits(dx_q) == _bits(dx)).all() == (fmt in FP8_GEMM_FORMATS or backward == "reuse")
        # Zeros for the codes (E8M0 block scales have no zero: theirs is zeros_like's).
        assert isinstance(dwq, QArray) and not np.asarray(dwq.codes, np.float32).any()


def test_a_served_fp8_weight_is_its_own_q_and_misfits_are_refused():
    """A served FP8 weight's codes are `Q` of its value: quantizing the rebuilt value gives
    back its codes and scale, across 10 decades of scale and both formats. A weight in a
    format not taken as quantized, another format than the product's, or blocked along N is
    refused in one line."""
    x, w = _operands()
    for fmt in FP8_GEMM_FORMATS:
        for scale in 10.0 ** np.arange(-6, 4):
            q = quantize(w * scale, fmt, 0, ())
            again = quantize(_value(q, "auto"), fmt, 0, ())
            assert (np.asarray(again.codes).view(np.uint8) == np.asarray(q.codes).view(np.uint8)).all()
            assert (_bits(again.scales) == _bits(q.scales)).all()
    with pytest.raises(ValueError, match="its own format"):
        quantized_matmul(x, quantize(w, "nvfp4", 0, ()), "nvfp4")
    with pytest.raises(ValueError, match="its own format"):
        quantized_matmul(x, quantize(w, "fp8", 0, ()), "fp8_e5m2")
    with pytest.raises(ValueError, match=r"block scales \[8, 96\], not \[256, 3\]"):
        quantized_matmul(x, quantize(w, "mxfp8", 1, ()), "mxfp8")  # blocks along N


def _requantized_values_differ(fmt: str, trials: int = 40) -> int:
    """Of `trials` random tensors (normal, heavy-tailed, cubed uniform, powers of two near
    the formats' edges; scales over 10 decades), how many quantize to a value whose value
    quantizes to another one: `Q(dequantize(Q(w))) != Q(w)` in value."""
    rng = np.random.default_rng(0)
    differ = 0
    for t in range(trials):
        scale, shape = 10.0 ** rng.uniform(-6, 4), (256, 96)
        w = [rng.standard_normal(shape), rng.standard_t(2, shape), rng.uniform(-1, 1, shape) ** 3,
             np.sign(rng.standard_normal(shape)) * 2.0 ** rng.integers(-3, 3, shape)
             * rng.choice([1, 0.999, 1.001, 1.75, 1.875, 1.99], shape)][t % 4]
        q = quantize(jnp.asarray(w * scale, jnp.float32), fmt, 0, ())
        again = quantize(_value(q, "auto"), fmt, 0, ())
        differ += bool((_bits(_value(again, "auto")) != _bits(_value(q, "auto"))).any())
    return differ


def test_the_formats_taken_as_quantized_are_those_whose_values_quantize_to_themselves():
    """`QUANTIZED_WEIGHT_FORMATS` takes a `QArray` as `Q(w)` whoever made it (the decode's
    copy, a served weight, a LoRA base): in those formats `Q` of a quantized value is that
    value (none of 40 tensors moved); NVFP4, ternary and binary move some, so theirs are
    dequantized and quantized again (the reason they are left out)."""
    from jaxrl_lp.numerics.formats import FORMATS

    for fmt in FORMATS:
        differ = _requantized_values_differ(fmt)
        assert (differ == 0) == (fmt in QUANTIZED_WEIGHT_FORMATS), (fmt, differ)


@pytest.mark.parametrize("tied", [False, True])
def test_the_decode_copy_quantizes_each_layer_once_with_the_same_bits(tied, monkeypatch):
    """Under `fp8` the decode copy holds every layer's matmul weights and the head as FP8
    `QArray`s, one scale a layer, and a forward reading it gives the master's logits bit for
    bit (the format quantizes the master's weights the same way on every step). The plant:
    one scale for the stacked layers together changes the logits."""
    cfg = dataclasses.replace(get_preset("tiny-qwen3"), tie_embeddings=tied)
    params = init_params(cfg, jax.random.PRNGKey(1))
    copy = unstack_layers(params, policy=FP8)
    layer = copy["layers"][1]
    assert len(MATMUL_WEIGHTS) == 7
    assert all(isinstance(layer[k], QArray) and layer[k].codes.dtype == jnp.float8_e4m3fn
               and layer[k].scales.size == 1 for k in MATMUL_WEIGHTS)
    assert isinstance(copy["lm_head"], QArray)
    assert copy["lm_head"].shape == (cfg.hidden_size, cfg.vocab_size)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 7)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    logits = lambda p: jax.jit(lambda p: forward(p, cfg, FP8, tokens, positions)[0])(p)
    want = _bits(logits(params))
    assert (_bits(logits(copy)) == want).all()

    blocks = sys.modules[_BLOCKS]
    real = blocks.quantize
    monkeypatch.setattr(blocks, "quantize",
                        lambda x, fmt, axis, batch_axes, kernels: real(x, fmt, axis, (), kernels=kernels))
    assert (_bits(logits(unstack_layers(params, policy=FP8))) != want).any()


@pytest.mark.parametrize("fmt", [  # mxfp4's cell (15 s cold, the same path) in the slow tier
    "mxfp8", pytest.param("mxfp4", marks=pytest.mark.slow)])
def test_an_mx_decode_copy_gives_the_masters_bits_and_its_loop_quantizes_no_weight(
        fmt, monkeypatch):
    """Under an MX policy the decode copy holds each layer's matmul weights and the (tied)
    head as `QArray`s blocked along their contraction axis, a forward reading it gives the
    master's logits bit for bit, and the sampler's program quantizes activations only (every
    weight once, before it, in the copy). The plant: the copy left unquantized, the sampler
    quantizes every weight again inside its program."""
    import jaxrl_lp.kernels.fake_quant as fake_quant
    from jaxrl_lp.rollout import SamplingConfig, generate

    policy = Policy.parse(fmt)
    cfg = dataclasses.replace(get_preset("tiny-qwen3"), tie_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(1))
    copy = unstack_layers(params, policy=policy)
    for k in MATMUL_WEIGHTS:
        q = copy["layers"][0][k]
        assert isinstance(q, QArray) and q.format == fmt and q.axis == 0
        assert q.scales.shape == (q.shape[0] // 32, q.shape[1])
    assert isinstance(copy["lm_head"], QArray)
    assert copy["lm_head"].shape == (cfg.hidden_size, cfg.vocab_size)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 7)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    logits = lambda p: jax.jit(lambda p: forward(p, cfg, policy, tokens, positions)[0])(p)
    assert (_bits(logits(copy)) == _bits(logits(params))).all()

    def weights_quantized_in_the_sampler(rows):  # traced anew: a row count of its own
        shapes, real = [], fake_quant.quantize
        weight_shapes = {tuple(x.shape[-2:]) for x in jax.tree.leaves(params) if x.ndim >= 2}

        def counting(x, fmt, axis=0, batch_axes=(), **kw):
            if x.ndim == 2 and axis % 2 == 0 and tuple(x.shape) in weight_shapes:
                shapes.append(tuple(x.shape))
            return real(x, fmt, axis, batch_axes, **kw)

        with monkeypatch.context() as m:
            m.setattr(fake_quant, "quantize", counting)
            generate(params, cfg, [[3, 4, 5]] * rows, policy=policy, max_new_tokens=3,
                     sampling=SamplingConfig(temperature=1.0), eos_id=None,
                     key=jax.random.PRNGKey(0))
        return shapes

    assert weights_quantized_in_the_sampler(3) == []
    monkeypatch.setattr(sys.modules[_BLOCKS], "QUANTIZED_WEIGHT_FORMATS", ())
    assert len(weights_quantized_in_the_sampler(5)) >= len(MATMUL_WEIGHTS)


SPEC = {"preset": "tiny-qwen3", "policy": FP8, "layers": None, "rows": 2, "prompt_len": 8,
        "new_tokens": 4}


def test_the_fp8_decode_loop_reads_codes_and_converts_no_weight(monkeypatch):
    """The sampler under `fp8` lowered for cuda: the loop carries FP8 codes, converts no
    weight on any step, and its products take FP8 operands. The plant: the decode copy left
    unquantized (each step quantizes every weight again)."""
    got = report({**SPEC, "rows": 3})
    low = got["lowered"]
    assert got["ok"] and low["weight_ops"] == (), got["problems"]
    assert "f8e4m3fn" in low["weight_bytes"]
    monkeypatch.setattr(sys.modules[_BLOCKS], "QUANTIZED_WEIGHT_FORMATS", ())
    got = report({**SPEC, "rows": 5})
    low = got["lowered"]
    assert not got["ok"] and "f8e4m3fn" not in low["weight_bytes"]
    assert low["weight_ops"] and all("convert" in line for line in low["weight_ops"])


def test_the_mx_decode_loop_rebuilds_codes_and_converts_no_master_weight(monkeypatch):
    """The sampler under `mxfp8` lowered for cuda: the loop carries E4M3 codes and rebuilds
    their values for the reference product on each step (`code_rebuilds`), converting no
    master weight. The plant: the copy left unquantized, each step converts the weights."""
    mx = {**SPEC, "policy": Policy.parse("mxfp8")}
    low = report({**mx, "rows": 3})["lowered"]
    assert low["weight_ops"] == () and "f8e4m3fn" in low["weight_bytes"], low["weight_ops"]
    assert low["code_rebuilds"] and all("f8e4m3fn codes" in line for line in low["code_rebuilds"])
    monkeypatch.setattr(sys.modules[_BLOCKS], "QUANTIZED_WEIGHT_FORMATS", ())
    got = report({**mx, "rows": 5})
    assert not got["ok"] and got["lowered"]["weight_ops"] and not got["lowered"]["code_rebuilds"]


@pytest.mark.skipif(plugin_from_env() is None, reason="needs the CUDA PJRT plugin "
                    "($JAXRL_LP_CUDA_PLUGIN, plan.cuda_aot)")
def test_xla_gpu_compiles_the_fp8_decode_step_without_a_weight_convert():
    """XLA:GPU's program for an H200 (deviceless) at Qwen3-0.6B's widths, 2 layers: the loop
    reads the FP8 codes as they are, no weight converted or copied on any step."""
    spec = {**SPEC, "preset": "qwen3-0.6b", "layers": 2, "rows": 8, "prompt_len": 16}
    got = report(spec, "h200", plugin_from_env(), ("none",))
    assert got["ok"], got["problems"]
    step = got["compiled"]["none"]
    assert step["weight_ops"] == () and "f8e4m3fn" in step["weight_bytes"]
