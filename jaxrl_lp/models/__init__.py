"""Dense (Qwen3) and looped (Ouro) decoders, their configs, caches and checkpoints."""

import importlib

# The package spans three floors (docs/design/parameters.md, "Floors"): `config` and `loop` sit
# below `parallel`, `attention` below `kernels`, the rest above both. So its names
# load on first use (PEP 562): importing `jaxrl_lp.models.config` runs nothing else.
_WHERE = {
    "unstack_layers": "blocks", "init_cache": "cache", "unstack_cache": "cache",
    "PRESETS": "config", "ModelConfig": "config", "get_preset": "config",
    "dense_forward": "dense", "save_hf_checkpoint": "hf_io", "ExitRule": "loop",
    "ExitSchedule": "loop", "LoopSpec": "loop", "exit_distribution": "loop",
    "LoopedOutput": "looped", "looped_forward": "looped", "CausalLM": "model",
    "forward": "model", "init_params": "model", "param_shapes": "model",
    "Packing": "packing", "make_packing": "packing", "pack": "packing", "unpack": "packing",
    "LoraWeight": "lora", "Products": "recorded", "RecordedWeight": "recorded",
    "Remat": "remat",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"jaxrl_lp.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'jaxrl_lp.models' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


__all__ = [
    "PRESETS",
    "CausalLM",
    "ExitRule",
    "ExitSchedule",
    "LoopSpec",
    "LoraWeight",
    "LoopedOutput",
    "ModelConfig",
    "Packing",
    "Products",
    "RecordedWeight",
    "Remat",
    "dense_forward",
    "exit_distribution",
    "forward",
    "from_pretrained",
    "get_preset",
    "init_cache",
    "init_params",
    "looped_forward",
    "make_packing",
    "pack",
    "param_shapes",
    "save_hf_checkpoint",
    "unstack_cache",
    "unpack",
    "unstack_layers",
]


def from_pretrained(path, policy="fp32", *, strict=True):
    """Loads a Hugging Face safetensors directory (Qwen3/Qwen2/Ouro) as a `CausalLM`.

    `strict=False` warns about (instead of refusing) tensors the config does not use.
    """
    from jaxrl_lp.models.hf_io import from_pretrained as _load

    return _load(path, policy=policy, strict=strict)
