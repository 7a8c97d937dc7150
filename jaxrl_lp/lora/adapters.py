"""Adapters as a pytree beside the frozen base: shapes, init, the held base, composing, merging.

A LoRA run holds `LoraParams(base, adapters)`:

- `base`: the model's params tree (docs/design/parameters.md) as `hold_base` holds it:
  f32 as given, every tensor bf16, or the layer matmuls as `QArray` codes and
  scales (`fp8`, `mxfp8`, `mxfp4`, `nvfp4`, along the reduction axis, one
  per-tensor scale per layer, as the quantizing exporter does) with the rest
  bf16. It is never differentiated, optimized or written by a checkpoint.
- `adapters`: `{"layers": {"q_proj": {"a": [L, in, r], "b": [L, r, out]}, ...}}`
  for the targeted layer matmuls, f32: what is trained and checkpointed.

`with_adapters(base, adapters, scale)` is the params tree a forward reads:
each targeted weight becomes a `models.lora.LoraWeight` (references, no
copy), which `models.layers.dot` computes as `x W + ((x A) B) * scale`.
`merge_adapters` is the dense f32 tree `W + A B scale` (the merged copy the
exporter rounds to the served format, and what Hugging Face gets).

Init (PEFT's default): `A ~ U(-1/sqrt(in), 1/sqrt(in))` (kaiming-uniform with
`a = sqrt(5)`), `B = 0`, so the adapted model starts as the base, exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.lora.config import LoraConfig
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.lora import LoraWeight, merge_adapters
from jaxrl_lp.models.model import param_shapes
from jaxrl_lp.numerics.formats import quantize
from jaxrl_lp.numerics.qarray import get_format
from jaxrl_lp.sync.layout import MATMUL_WEIGHTS

__all__ = ["LoraParams", "adapter_shapes", "count_params", "hold_base", "init_adapters",
           "matmul_shapes", "merge_adapters", "with_adapters"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraParams:
    """A LoRA run's weights: the frozen base and the trained adapters (module docstring)."""

    base: Any      # the model's params tree as held (`hold_base`)
    adapters: Any  # {"layers": {name: {"a": [L, in, r], "b": [L, r, out]}}}, f32


def matmul_shapes(mcfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """`{name: (in, out)}` of the model's layer matmuls (`q_proj`, ..., `down_proj`)."""
    layers = param_shapes(mcfg)["layers"]
    return {n: tuple(layers[n][1:]) for n in MATMUL_WEIGHTS}


def adapter_shapes(mcfg: ModelConfig, spec: LoraConfig) -> dict:
    """The adapters' shapes: `{"layers": {name: {"a": (L, in, r), "b": (L, r, out)}}}`."""
    shapes, L, r = matmul_shapes(mcfg), mcfg.num_layers, spec.rank
    return {"layers": {n: {"a": (L, shapes[n][0], r), "b": (L, r, shapes[n][1])}
                       for n in spec.target_weights()}}


def init_adapters(mcfg: ModelConfig, spec: LoraConfig, key: jax.Array) -> dict:
    """Fresh f32 adapters: A uniform in +-1/sqrt(in) (PEFT's init), B zeros."""
    shapes = adapter_shapes(mcfg, spec)["layers"]
    keys = jax.random.split(key, len(shapes))
    out = {}
    for k, (name, s) in zip(keys, shapes.items(), strict=True):
        bound = 1.0 / math.sqrt(s["a"][1])
        out[name] = {"a": jax.random.uniform(k, s["a"], jnp.float32, -bound, bound),
                     "b": jnp.zeros(s["b"], jnp.float32)}
    return {"layers": out}


def _bf16(x):
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x


def hold_base(params: dict, base_format: str) -> dict:
    """The base as a LoRA run holds it (module docstring); `f32` returns `params` itself.

    Raises:
      ValueError: naming the weight and the block size where a block format's
        block does not divide a matmul's reduction axis.
    """
    if base_format == "f32":
        return params
    if base_format == "bf16":
        return jax.tree.map(_bf16, params)
    bs = get_format(base_format).block_size
    layers = dict(params["layers"])
    for name in MATMUL_WEIGHTS:
        w = layers[name]
        if bs is not None and w.shape[1] % bs:
            raise ValueError(f"lora.base_format={base_format}: layers/{name} has a reduction axis "
                             f"of {w.shape[1]}, not a multiple of the format's block size {bs}; "
                             "choose a per-tensor format (fp8) or bf16")
        layers[name] = quantize(w, base_format, axis=1, batch_axes=(0,))
    rest = jax.tree.map(_bf16, {k: v for k, v in params.items() if k != "layers"})
    rest["layers"] = {k: v if k in MATMUL_WEIGHTS else _bf16(v) for k, v in layers.items()}
    return rest


def with_adapters(base: dict, adapters: dict, scale: float) -> dict:
    """The params tree a forward reads: targeted weights as `LoraWeight`s (no copies)."""
    layers = dict(base["layers"])
    for name, ab in adapters["layers"].items():
        layers[name] = LoraWeight(layers[name], ab["a"], ab["b"], float(scale))
    return {**base, "layers": layers}


def count_params(tree: Any) -> int:
    """Elements of every array leaf of `tree`."""
    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))
