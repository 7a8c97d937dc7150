"""The training programs: config, checkpoints, metrics and the GRPO/SFT run loop.

`run_train(cfg)` is `jaxrl-lp train`; `validate(cfg)` builds what a run of
`cfg` needs (task, model, policies, loop spec, optimizers) without running it;
`Checkpointer(run_dir, create=False).restore_params()` reads a run's weights back.
"""

from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import (
    GRPOConfig,
    RunConfig,
    SFTConfig,
    TaskConfig,
    TrainConfig,
)
from jaxrl_lp.train.config_files import apply_overrides, config_from_dict, load_config
from jaxrl_lp.train.defaults import default_config
from jaxrl_lp.train.evaluation import evaluate, evaluate_run
from jaxrl_lp.train.program import NonFiniteError, run_train
from jaxrl_lp.train.rollout_queue import RolloutQueue, SamplerSide
from jaxrl_lp.train.validate import RunPlan, validate

__all__ = [
    "Checkpointer",
    "GRPOConfig",
    "NonFiniteError",
    "RunConfig",
    "RolloutQueue",
    "RunPlan",
    "SFTConfig",
    "SamplerSide",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "default_config",
    "evaluate",
    "evaluate_run",
    "load_config",
    "run_train",
    "validate",
]
