"""Adapters in the Hugging Face PEFT layout: `adapter_config.json` + `adapter_model.safetensors`.

What `peft.PeftModel.from_pretrained(base_model, DIR)` reads (PEFT's LoRA
format; source: the peft library's `LoraConfig` and its saved key names):

- `adapter_config.json`: `peft_type: "LORA"`, `task_type: "CAUSAL_LM"`, `r`,
  `lora_alpha` (PEFT scales by `lora_alpha / r`, as we do), `target_modules`
  (the module names, `q_proj` ... `down_proj`), no dropout, no bias, no
  rsLoRA or DoRA, and `base_model_name_or_path`.
- `adapter_model.safetensors`: per layer i and target, the module's HF name
  with `base_model.model.` in front and the adapter name dropped:
  `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]`
  (our `A[i].T`) and `...q_proj.lora_B.weight` `[out, r]` (our `B[i].T`),
  f32. PEFT computes `base(x) + lora_B(lora_A(x)) * lora_alpha / r`, the
  unmerged forward of `models.layers.dot`.

`save_peft` writes them, `load_peft` reads them back into our adapters tree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxrl_lp.lora.config import TARGETS, LoraConfig
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.hf_names import hf_tensor_map

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "load_peft", "peft_names", "save_peft"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def peft_names(mcfg: ModelConfig) -> dict[str, str]:
    """`{weight name: PEFT module name with {i}}`, e.g. `q_proj` ->
    `base_model.model.model.layers.{i}.self_attn.q_proj`."""
    out = {}
    for t in hf_tensor_map(mcfg):
        if len(t.path) == 2 and t.path[0] == "layers" and t.path[1] in TARGETS.values():
            out[t.path[1]] = _PREFIX + t.hf_name.removesuffix(".weight")
    return out


def save_peft(out: str | os.PathLike, mcfg: ModelConfig, adapters: dict, spec: LoraConfig,
              base_model: str = "") -> list[str]:
    """Writes `adapters` (`{"layers": {name: {"a", "b"}}}`) as a PEFT adapter directory.

    Args:
      out: the directory (created).
      mcfg: the model adapted (names and layer count).
      adapters: our adapters tree, f32 (`a` [L, in, r], `b` [L, r, out]).
      spec: rank and alpha (`lora.rank`, `lora.alpha`).
      base_model: `base_model_name_or_path` (the base checkpoint's directory).

    Returns:
      The file names written.

    Examples:
      >>> save_peft("out/adapter", cfg, train.adapters, LoraConfig(rank=8), "ckpt/Qwen3-0.6B")
      >>> model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/adapter")
    """
    from safetensors.numpy import save_file

    names = peft_names(mcfg)
    tensors = {}
    for name, ab in adapters["layers"].items():
        a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
        if a.shape[-1] != spec.rank:
            raise ValueError(f"save_peft: {name}'s A has rank {a.shape[-1]}, the spec says "
                             f"{spec.rank}")
        for i in range(mcfg.num_layers):
            module = names[name].format(i=i)
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
        "lora_alpha": float(spec.alpha), "target_modules": sorted(adapters["layers"]),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": str(base_model),
        "revision": None,
    }
    os.makedirs(out, exist_ok=True)
    save_file(tensors, str(Path(out) / WEIGHTS_FILE), metadata={"format": "pt"})
    (Path(out) / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return [CONFIG_FILE, WEIGHTS_FILE]


def load_peft(path: str | os.PathLike, mcfg: ModelConfig) -> tuple[dict, LoraConfig]:
    """Reads a PEFT LoRA directory into `(adapters, spec)` for `mcfg` (its every layer).

    Raises:
      ValueError: naming what this reader does not take (another PEFT type,
        rsLoRA, DoRA, per-module ranks, a module it does not know, a missing
        layer).
    """
    from safetensors.numpy import load_file

    config = json.loads((Path(path) / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, not LORA")
    for key in ("use_rslora", "use_dora"):
        if config.get(key):
            raise ValueError(f"{path}: {key}=true is not the LoRA this library computes")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path}: per-module ranks or alphas (rank_pattern, alpha_pattern) "
                         "are not supported")
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    names = peft_names(mcfg)
    short = {v: k for k, v in TARGETS.items()}
    found = [n for n in TARGETS.values()  # in model order
             if n in names and f"{names[n].format(i=0)}.lora_A.weight" in tensors]
    if not found:
        raise ValueError(f"{path}: no LoRA weights of this model's layer matmuls")
    spec = LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      targets=",".join(short[n] for n in found))
    layers = {}
    for name in found:
        a, b = [], []
        for i in range(mcfg.num_layers):
            module = names[name].format(i=i)
            if f"{module}.lora_A.weight" not in tensors:
                raise ValueError(f"{path}: {module} has no lora_A.weight")
            a.append(tensors[f"{module}.lora_A.weight"].T)
            b.append(tensors[f"{module}.lora_B.weight"].T)
        layers[name] = {"a": np.stack(a).astype(np.float32), "b": np.stack(b).astype(np.float32)}
    return jax.tree.map(np.asarray, {"layers": layers}), spec
