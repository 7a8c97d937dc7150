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
    apply_overrides,
    load_config,
)
from jaxrl_lp.train.defaults import default_config
from jaxrl_lp.train.program import NonFiniteError, evaluate, evaluate_run, run_train
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
    "default_config",
    "evaluate",
    "evaluate_run",
    "load_config",
    "run_train",
    "validate",
]
