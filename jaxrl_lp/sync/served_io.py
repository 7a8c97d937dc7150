"""The served copy on disk: a Hugging Face-style directory holding codes and scales.

`write_served` writes a served tree (the output of an exporter: arrays and
`QArray`s, in the params layout of docs/design/parameters.md) as `config.json` +
`model.safetensors` under the Hugging Face tensor names; `read_served` reads
it back bit for bit. The layout (docs/served_layout.md):

- a tensor that is not quantized (norms, embeddings, the exit gate, and every
  tensor of a cast export) is stored under its HF name, in HF orientation
  (`[out, in]` for linear weights), in its served dtype, bit-exact;
- a quantized matmul weight `X.weight` (`[out, in]`) is stored as its codes,
  with `X.weight_scale` (the format's scale: per-tensor f32 scalar, or block
  scales `[out, in / block]`) and, for NVFP4, `X.weight_scale_2` (the f32
  tensor scale). Codes: FP8 as `F8_E4M3`/`F8_E5M2`, FP4 (E2M1) packed two per
  byte as `U8` (element `2j` in the low nibble), ternary/binary as `I8`. Block
  scales: MX as `F8_E8M0`, NVFP4 as `F8_E4M3`;
- `config.json` is the model's HF config plus `quantization_config` (format,
  element and scale dtypes, block size and axis, how a value is rebuilt) when
  a tensor is quantized, and `jaxrl_lp_export` (the exporter, and what the
  caller adds: run, step).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import deserialize
from safetensors.numpy import save_file

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.hf_config import config_from_hf, config_to_hf
from jaxrl_lp.models.hf_names import HFTensor, hf_tensor_map
from jaxrl_lp.numerics.qarray import QArray, get_format
from jaxrl_lp.sync.layout import flatten_served, is_qarray

__all__ = ["SERVED_FILE", "quantization_config", "read_served", "write_served"]

SERVED_FILE = "model.safetensors"
_FP4 = np.dtype(ml_dtypes.float4_e2m1fn)
_ST_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I8": np.int8,
    "U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}
_ST_NAMES = {np.dtype(v).name: k for k, v in _ST_DTYPES.items()}
_WEIGHTS_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def quantization_config(fmt: str) -> dict[str, Any]:
    """The `quantization_config` block of `config.json` for number format `fmt`.

    Returns:
      A JSON-serializable dict: format, element dtype and storage, block size
      and the axis blocks run along (1: the input axis of `[out, in]`), scale
      dtypes and shapes, and the rule rebuilding a weight `W[o, i]` in f32.
    """
    spec = get_format(fmt)
    elem = np.dtype(spec.element_dtype)
    storage = ("U8: two E2M1 codes per byte along the input axis, element 2j in the low "
               "nibble, 2j+1 in the high nibble; shape [out, in / 2]" if elem == _FP4
               else f"{_ST_NAMES[elem.name]}; shape [out, in]")
    code = "f32(unpack(weight)[o, i])" if elem == _FP4 else "f32(weight[o, i])"
    out: dict[str, Any] = {"quant_method": "jaxrl_lp", "format": fmt, "element_dtype": elem.name,
                           "element_storage": storage, "block_size": spec.block_size,
                           "block_axis": 1 if spec.is_block else None}
    bs = spec.block_size
    if spec.scale_kind == "block_e8m0":
        out.update(scale_dtype="float8_e8m0fnu", scale_shape=f"[out, in / {bs}]",
                   dequantize=f"W[o, i] = {code} * f32(weight_scale[o, i // {bs}])")
    elif spec.scale_kind == "block_e4m3_tensor_f32":
        out.update(scale_dtype="float8_e4m3fn", scale_shape=f"[out, in / {bs}]",
                   tensor_scale_dtype="float32", tensor_scale_shape="[]",
                   dequantize=f"W[o, i] = {code} * (f32(weight_scale[o, i // {bs}]) * "
                              "weight_scale_2), the product of the scales rounded to f32 first")
    else:
        out.update(scale_dtype="float32", scale_shape="[]",
                   dequantize=f"W[o, i] = {code} * weight_scale")
    return out


def _pack_fp4(codes: np.ndarray) -> np.ndarray:
    bits = codes.view(np.uint8)
    return (bits[..., 0::2] | (bits[..., 1::2] << 4)).astype(np.uint8)


def _unpack_fp4(packed: np.ndarray) -> np.ndarray:
    bits = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    bits[..., 0::2], bits[..., 1::2] = packed & 0xF, packed >> 4
    return bits.view(_FP4)


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            raise ValueError(f"served tree has no tensor {'/'.join(path)!r}")
        tree = tree[key]
    return tree


def _quantized(name: str, q: QArray, i: int | None) -> dict[str, np.ndarray]:
    """One (layer of a) quantized linear weight as `name`, `name_scale`[, `name_scale_2`]."""
    want = (1, (0,)) if i is not None else (0, ())
    if (q.axis, q.batch_axes) != want:
        raise ValueError(f"served tensor {name!r}: quantized along axis {q.axis} with batch axes "
                         f"{q.batch_axes}; the served layout needs {want} (the input axis)")
    take = (lambda a: np.asarray(a)) if i is None else (lambda a: np.asarray(a[i]))
    codes = np.ascontiguousarray(take(q.codes).T)  # [in, out] -> HF [out, in]
    scales = take(q.scales)
    scales = scales.T if q.spec.is_block else scales.reshape(())
    out = {name: _pack_fp4(codes) if codes.dtype == _FP4 else codes,
           f"{name}_scale": np.ascontiguousarray(scales)}
    if q.tensor_scale is not None:
        out[f"{name}_scale_2"] = take(q.tensor_scale).reshape(())
    return out


def _tensors(config: ModelConfig, served: Any) -> tuple[dict[str, np.ndarray], set[str]]:
    """The served tree as HF-named arrays, and the formats of its quantized tensors."""
    entries = hf_tensor_map(config)
    extra = set(flatten_served(served)) - {"/".join(e.path) for e in entries}
    if extra:
        raise ValueError(f"served tree has tensors the {config.family} config does not describe: "
                         f"{sorted(extra)}")
    out, formats = {}, set()
    for e in entries:
        leaf = _get(served, e.path)
        for i in range(config.num_layers) if e.per_layer else [None]:
            name = e.hf_name.format(i=i)
            if is_qarray(leaf):
                formats.add(leaf.format)
                out.update(_quantized(name, leaf, i))
            else:
                x = np.asarray(leaf if i is None else leaf[i])
                out[name] = np.ascontiguousarray(x.T if e.transpose else x)
    return out, formats


def write_served(path: str | os.PathLike, served: Any, config: ModelConfig, *, exporter: str,
                 info: dict | None = None) -> list[str]:
    """Writes a served tree in the served layout (module docstring, docs/served_layout.md).

    Args:
      path: output directory (created if needed; an earlier `model.safetensors` is replaced).
      served: an exporter's output for params of `config`.
      config: the model config (written as its HF `config.json`).
      exporter: the exporter spec that made `served` (recorded).
      info: more JSON-serializable facts for the `jaxrl_lp_export` block (run, step, ...).

    Returns:
      The file names written.

    Examples:
      >>> served, _ = quantize("nvfp4").apply(params, EmptyState())
      >>> write_served("out/served", served, config, exporter="fmt:nvfp4")
    """
    tensors, formats = _tensors(config, served)
    if len(formats) > 1:
        raise ValueError(f"served tree mixes formats {sorted(formats)}; one format per export")
    kept = np.dtype(tensors[hf_tensor_map(config)[0].hf_name].dtype).name
    if kept not in _WEIGHTS_DTYPES:
        raise ValueError(f"served embeddings have dtype {kept}; expected one of "
                         f"{sorted(_WEIGHTS_DTYPES)}")
    hf = config_to_hf(config, "4", _WEIGHTS_DTYPES[kept])
    if formats:
        hf["quantization_config"] = quantization_config(formats.pop())
    hf["jaxrl_lp_export"] = {"exporter": exporter, **(info or {})}
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(path, SERVED_FILE), metadata={"format": "pt"})
    return ["config.json", SERVED_FILE]


def _read_tensors(file: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, FP8/E8M0 included (as `ml_dtypes` arrays)."""
    with open(file, "rb") as f:
        raw = f.read()
    out = {}
    for name, view in deserialize(raw):
        if view["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {view['dtype']}, which the served "
                             f"layout does not use ({sorted(_ST_DTYPES)})")
        out[name] = np.frombuffer(view["data"], _ST_DTYPES[view["dtype"]]).reshape(view["shape"])
    return out


def _read_quantized(t: dict, e: HFTensor, fmt: str, layers: list) -> QArray:
    spec = get_format(fmt)
    codes, scales, tscales = [], [], []
    for i in layers:
        name = e.hf_name.format(i=i)
        c = t[name]
        codes.append((_unpack_fp4(c) if np.dtype(spec.element_dtype) == _FP4 else c).T)
        s = t[f"{name}_scale"]
        scales.append(s.T if spec.is_block else s.reshape(1, 1))
        if spec.scale_kind == "block_e4m3_tensor_f32":
            tscales.append(t[f"{name}_scale_2"].reshape(1, 1))
    stack = (lambda xs: np.stack(xs)) if e.per_layer else (lambda xs: xs[0])
    axis, batch = ((1, (0,)) if e.per_layer else (0, ()))
    return QArray(jnp.asarray(stack(codes)), jnp.asarray(stack(scales)), fmt, axis, batch,
                  jnp.asarray(stack(tscales)) if tscales else None)


def read_served(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a directory written by `write_served` back into the served tree, bit for bit.

    Args:
      path: the served directory.

    Returns:
      The served tree (arrays in their served dtypes, `QArray`s with the codes,
      scales, axis and batch axes the exporter made); the model config is
      `read_hf_config(path)`.

    Raises:
      FileNotFoundError: missing directory or files.
      ValueError: a tensor that is missing or does not match the layout.
    """
    path = os.fspath(path)
    file = os.path.join(path, SERVED_FILE)
    if not os.path.isfile(os.path.join(path, "config.json")) or not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} is not a served directory (config.json + {SERVED_FILE})")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    config = config_from_hf(hf)
    fmt = (hf.get("quantization_config") or {}).get("format")
    t = _read_tensors(file)
    tree: dict[str, Any] = {}
    for e in hf_tensor_map(config):
        layers = list(range(config.num_layers)) if e.per_layer else [None]
        names = [e.hf_name.format(i=i) for i in layers]
        if missing := [n for n in names if n not in t]:
            raise ValueError(f"{file}: tensor {missing[0]!r} is missing")
        if f"{names[0]}_scale" in t:
            if fmt is None:
                raise ValueError(f"{file}: {names[0]}_scale but config.json has no "
                                 "quantization_config")
            leaf = _read_quantized(t, e, fmt, layers)
        else:
            xs = [t[n].T if e.transpose else t[n] for n in names]
            leaf = jnp.asarray(np.stack(xs) if e.per_layer else xs[0])
        node = tree
        for key in e.path[:-1]:
            node = node.setdefault(key, {})
        node[e.path[-1]] = leaf
    return tree
