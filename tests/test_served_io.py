"""The served layout on disk: `write_served` / `read_served` round trips, bit for bit, for every
exporter, and the documented rebuild rule (docs/served_layout.md) applied to the raw file."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import deserialize

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.hf_config import read_hf_config
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.qarray import dequantize
from jaxrl_lp.sync.export import EmptyState, quantize, served_params_for_forward
from jaxrl_lp.sync.layout import flatten_served, is_qarray
from jaxrl_lp.sync.served_io import read_served, write_served
from jaxrl_lp.train.sync_hooks import make_exporter

# Reduction axes of 64 (hidden, heads * head_dim) and 96 (MLP): whole MX and NVFP4 blocks.
LOOPED = ModelConfig(family="ouro", vocab_size=40, hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=96, qk_norm=False,
                     loop_steps=2)
DENSE_TIED = LOOPED.replace(family="qwen3", qk_norm=True, loop_steps=1, tie_embeddings=True)
EXPORTERS = ["bf16:nearest", "bf16:stochastic", "f16:error_feedback", "fmt:mxfp8", "fmt:nvfp4",
             "fmt:mxfp4", "fmt:fp8", "fmt:fp8_e5m2", "ternary:direct_codes",
             "ternary:bf16_then_quantize", "ternary:bf16_fixed_point", "fmt:binary"]
_RAW = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I8": np.int8,
        "U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _components(leaf):
    if is_qarray(leaf):
        out = [leaf.codes, leaf.scales] + ([leaf.tensor_scale] if leaf.tensor_scale is not None
                                           else [])
        return (leaf.format, leaf.axis, leaf.batch_axes), out
    return None, [leaf]


def assert_served_equal(a, b):
    """Same tensors, formats, axes, dtypes, shapes and bytes."""
    fa, fb = flatten_served(a), flatten_served(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        (ma, xs), (mb, ys) = _components(fa[k]), _components(fb[k])
        assert ma == mb and len(xs) == len(ys), k
        for x, y in zip(xs, ys, strict=True):
            x, y = np.asarray(x), np.asarray(y)
            assert (x.dtype, x.shape) == (y.dtype, y.shape), k
            assert x.tobytes() == y.tobytes(), k


def _export(spec, params):
    ex = make_exporter(spec, seed=7)
    apply = jax.jit(ex.apply)
    served, state = apply(params, ex.init(params))
    served, _ = apply(params, state)  # a second export: advanced stochastic/error-feedback state
    return served


def _raw(path):
    return {n: np.frombuffer(v["data"], _RAW[v["dtype"]]).reshape(v["shape"])
            for n, v in deserialize((path / "model.safetensors").read_bytes())}


def _rebuild(t, name, qc):
    """W [out, in] in f32 from the file alone, by the rule of docs/served_layout.md."""
    w = t[name]
    if qc["element_dtype"] == "float4_e2m1fn":
        bits = np.stack([w & 0xF, w >> 4], axis=-1).reshape(w.shape[0], -1)
        w = bits.view(ml_dtypes.float4_e2m1fn)
    s = t[f"{name}_scale"].astype(np.float32)
    if qc["block_size"]:
        s = np.repeat(s, qc["block_size"], axis=qc["block_axis"])
    if f"{name}_scale_2" in t:
        s = s * t[f"{name}_scale_2"]  # the scale product, rounded to f32 first
    return w.astype(np.float32) * s


@pytest.mark.parametrize("spec", EXPORTERS)
def test_round_trip_is_bit_exact(tmp_path, spec):
    params = init_params(LOOPED, jax.random.PRNGKey(0))
    served = _export(spec, params)
    assert write_served(tmp_path, served, LOOPED, exporter=spec, info={"step": 3}) == [
        "config.json", "model.safetensors"]
    back = read_served(tmp_path)
    assert_served_equal(back, served)
    assert_served_equal(served_params_for_forward(back), served_params_for_forward(served))
    assert read_hf_config(tmp_path).replace(exit_rule="full") == LOOPED
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["jaxrl_lp_export"] == {"exporter": spec, "step": 3}
    quantized = any(is_qarray(x) for x in flatten_served(served).values())
    assert ("quantization_config" in cfg) == quantized
    if not quantized:
        return
    qc, t = cfg["quantization_config"], _raw(tmp_path)
    q = served["layers"]["down_proj"]
    for i in range(LOOPED.num_layers):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        want = np.asarray(dequantize(q))[i].T
        np.testing.assert_array_equal(_rebuild(t, name, qc), want)


@pytest.mark.parametrize("spec", ["fmt:nvfp4", "bf16:nearest"])
def test_dense_tied_model(tmp_path, spec):
    params = init_params(DENSE_TIED, jax.random.PRNGKey(1))
    served = _export(spec, params)
    write_served(tmp_path, served, DENSE_TIED, exporter=spec)
    assert_served_equal(read_served(tmp_path), served)
    assert "lm_head.weight" not in _raw(tmp_path)


def test_quantized_lm_head(tmp_path):
    cfg = LOOPED.replace(vocab_size=48)
    params = init_params(cfg, jax.random.PRNGKey(2))
    served, _ = quantize("mxfp8", include_lm_head=True).apply(params, EmptyState())
    write_served(tmp_path, served, cfg, exporter="fmt:mxfp8 (lm_head included)")
    back = read_served(tmp_path)
    assert_served_equal(back, served)
    t = _raw(tmp_path)
    assert t["lm_head.weight"].shape == (48, 64) and t["lm_head.weight_scale"].shape == (48, 2)


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a served directory"):
        read_served(tmp_path)
    params = init_params(LOOPED, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="does not describe"):
        write_served(tmp_path, {**params, "extra": params["embed"]}, LOOPED, exporter="none")
    assert not (tmp_path / "config.json").exists()
