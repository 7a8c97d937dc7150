"""Optimizers for low-bit weights (docs/design/error_diffusion.md, "Error diffusion").

- `error_diffusion`: an optax transform for int8 binary / ternary codes with a
  k-bit signed residual per weight (k = 2..8) and no f32 latent copy.
- `partition`: `optax.multi_transform` with every parameter's assignment checked
  (error diffusion on the codes, Adam on the high-precision leaves).
- `weights`: the train trees (`CodedWeights`: int8 codes and f32 scales;
  `LatentSTEWeights`: f32 latents with straight-through quantization) and the
  model params they stand for.
- `spec`: `OptimizerSpec`, the config string (`sft.optimizer`) naming both.
"""

from jaxrl_lp.optim.error_diffusion import (
    ErrorDiffusionState,
    check_k,
    error_diffusion,
    flip_threshold,
    residual_range,
)
from jaxrl_lp.optim.partition import param_labels, partition
from jaxrl_lp.optim.spec import DEFAULT_ED_LR, OptimizerSpec
from jaxrl_lp.optim.weights import CodedWeights, LatentSTEWeights, code_bits, is_coded_path

__all__ = [
    "DEFAULT_ED_LR",
    "CodedWeights",
    "ErrorDiffusionState",
    "LatentSTEWeights",
    "OptimizerSpec",
    "check_k",
    "code_bits",
    "error_diffusion",
    "flip_threshold",
    "is_coded_path",
    "param_labels",
    "partition",
    "residual_range",
]
