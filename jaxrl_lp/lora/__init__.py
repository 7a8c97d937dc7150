"""LoRA: low-rank adapters trained beside a frozen, optionally low-precision base.

- `config`: `LoraConfig`, the `lora` section of a training config (`lora.rank`,
  `lora.alpha`, `lora.targets`, `lora.base_format`, `lora.serve`).
- `adapters`: `LoraParams(base, adapters)`, the adapters' shapes and init, the
  base as held (f32, bf16, or FP8/MX/NVFP4 codes), `with_adapters` (the tree
  a forward reads: `models.lora.LoraWeight` leaves, computed by
  `models.layers.dot` as `x W + ((x A) B) * alpha/r`) and `merge_adapters`.
- `weights`: `LoraWeights`, LoRA as a representation of the learner steps
  (gradient, optimizer state and updates for the adapters only).
- `export`: the merged served copy (`merged_exporter`).
- `peft`: the PEFT adapter directory (`adapter_config.json`,
  `adapter_model.safetensors`) that Hugging Face `peft` loads onto the base.
"""

from jaxrl_lp.lora.adapters import (
    LoraParams,
    adapter_shapes,
    count_params,
    hold_base,
    init_adapters,
    matmul_shapes,
    merge_adapters,
    with_adapters,
)
from jaxrl_lp.lora.config import BASE_FORMATS, TARGETS, LoraConfig
from jaxrl_lp.lora.export import merged_exporter, served_format_exporter
from jaxrl_lp.lora.peft import load_peft, peft_names, save_peft
from jaxrl_lp.lora.weights import LoraWeights

__all__ = [
    "BASE_FORMATS",
    "TARGETS",
    "LoraConfig",
    "LoraParams",
    "LoraWeights",
    "adapter_shapes",
    "count_params",
    "hold_base",
    "init_adapters",
    "load_peft",
    "matmul_shapes",
    "merge_adapters",
    "merged_exporter",
    "peft_names",
    "save_peft",
    "served_format_exporter",
    "with_adapters",
]
