"""Dense (Qwen3) and looped (Ouro) decoders, their configs, caches and checkpoints."""

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import PRESETS, ModelConfig, get_preset
from jaxrl_lp.models.dense import dense_forward
from jaxrl_lp.models.hf_io import save_hf_checkpoint
from jaxrl_lp.models.loop import ExitRule, ExitSchedule, LoopSpec, exit_distribution
from jaxrl_lp.models.looped import LoopedOutput, looped_forward
from jaxrl_lp.models.model import CausalLM, forward, init_params, param_shapes
from jaxrl_lp.models.packing import Packing, make_packing, pack, unpack

__all__ = [
    "PRESETS",
    "CausalLM",
    "ExitRule",
    "ExitSchedule",
    "LoopSpec",
    "LoopedOutput",
    "ModelConfig",
    "Packing",
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
