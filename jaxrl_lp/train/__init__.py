"""The training programs: config, checkpoints, metrics and the GRPO/SFT run loop."""

from jaxrl_lp.train.config import (
    GRPOConfig,
    RunConfig,
    SFTConfig,
    TaskConfig,
    TrainConfig,
    apply_overrides,
    load_config,
)
from jaxrl_lp.train.defaults import default_config
from jaxrl_lp.train.program import NonFiniteError, evaluate, run_train

__all__ = [
    "GRPOConfig",
    "NonFiniteError",
    "RunConfig",
    "SFTConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "default_config",
    "evaluate",
    "load_config",
    "run_train",
]
