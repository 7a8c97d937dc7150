"""Training configuration: frozen dataclasses, Python config files, `--set a.b=c` overrides."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from pathlib import Path
from typing import Any, Literal

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.train.sync_hooks import SyncConfig

__all__ = ["GRPOConfig", "RunConfig", "SFTConfig", "SyncConfig", "TaskConfig", "TrainConfig",
           "apply_overrides", "load_config"]


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The task: `arithmetic` (generated) or `gsm8k` (a local JSONL/parquet file at `path`).

    `reverse_answer`: arithmetic answers are written least significant digit first.
    """

    kind: Literal["arithmetic", "gsm8k"] = "arithmetic"
    ops: str = "+"
    max_digits: int = 2
    reverse_answer: bool = False
    pad_operands: bool = False
    path: str = ""
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("arithmetic", "gsm8k"):
            raise ValueError(f"task.kind must be 'arithmetic' or 'gsm8k'; got {self.kind!r}")
        if self.kind == "gsm8k" and not self.path:
            raise ValueError("task.path must name a local GSM8K JSONL or parquet file")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The supervised warm-start."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The RL phase.

    Attributes:
      steps: GRPO steps (each: sample, score, `mu` passes over `minibatches`).
      prompts_per_step / group_size: the batch is prompts_per_step * group_size
        sequences; group_size >= 2 (a group of 1 has no advantage signal).
      max_new_tokens: completion budget; 0 means the task's answer length + EOS.
      lr, mu, minibatches, micro_batches: optimizer and batch structure.
      advantage: `grpo`, `drgrpo` or `rloo`.
      logprobs: learner log-probs, `dense` or `hybrid`.
      learner_policy / sampler_policy: precision policies (matched when equal).
      exit_rule / compute_mode: the looped sampler's schedule.
      temperature: sampling temperature.
      dynamic_sampling: drop zero-variance groups from the loss.
      max_nonfinite_in_row: stop the run after this many skipped steps in a row.
    """

    steps: int = 60
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 0
    lr: float = 1e-3
    mu: int = 1
    minibatches: int = 1
    micro_batches: int = 1
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    logprobs: Literal["dense", "hybrid"] = "hybrid"
    learner_policy: str = "fp32"
    sampler_policy: str = "fp32"
    exit_rule: str = "full"
    compute_mode: Literal["dense", "deferred"] = "dense"
    temperature: float = 1.0
    dynamic_sampling: bool = False
    max_nonfinite_in_row: int = 5

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(
                f"grpo.group_size must be >= 2 (got {self.group_size}): GRPO advantages compare "
                "samples within a group, and a group of 1 has no signal")
        if self.logprobs not in ("dense", "hybrid"):
            raise ValueError(f"grpo.logprobs must be 'dense' or 'hybrid'; got {self.logprobs!r}")
        if self.compute_mode not in ("dense", "deferred"):
            raise ValueError(f"grpo.compute_mode must be 'dense' or 'deferred'; got "
                             f"{self.compute_mode!r}")
        n = self.prompts_per_step * self.group_size
        if n % self.minibatches or (n // self.minibatches) % self.micro_batches:
            raise ValueError(
                f"grpo batch of {n} sequences must split into minibatches={self.minibatches} "
                f"of micro_batches={self.micro_batches} equal slices")
        for f in ("steps", "prompts_per_step", "mu", "minibatches", "micro_batches"):
            if getattr(self, f) < (0 if f == "steps" else 1):
                raise ValueError(f"grpo.{f} must be positive; got {getattr(self, f)}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how the run is recorded."""

    out_dir: str = "runs/default"
    seed: int = 0
    eval_every: int = 10
    eval_size: int = 256
    checkpoint_every: int = 20
    keep_checkpoints: int = 2
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a `jaxrl-lp train` run needs. `init_from`: an HF checkpoint dir, else random."""

    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    grpo: GRPOConfig = GRPOConfig()
    loss: LossConfig = LossConfig()
    sync: SyncConfig = SyncConfig()
    run: RunConfig = RunConfig()
    init_from: str = ""


def _convert(value: str, current: Any, hint: Any, key: str) -> Any:
    """Parses an override string to the type of the field it replaces."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ValueError(f"--set {key}={value}: allowed values are {list(allowed)}")
        return value
    args = typing.get_args(hint)
    if value in ("None", "none", "null") and (type(None) in args or current is None):
        return None
    kinds = [a for a in args if a is not type(None)] if origin in (typing.Union, types.UnionType) \
        else [hint]
    kind = kinds[0] if kinds else type(current)
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError("expected true or false")
            return value.lower() in ("true", "1")
        if kind in (int, float, str):
            return kind(value)
    except ValueError as e:
        raise ValueError(f"--set {key}={value}: {e}") from None
    raise ValueError(f"--set {key}: cannot override a field of type {kind}")


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Applies `a.b=c` overrides to nested frozen dataclasses; unknown keys are errors.

    All overrides of a section are applied together, so fields that are
    validated against each other (e.g. `task.kind` and `task.path`) can be set
    in any order.
    """
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. grpo.lr=1e-3)")
        key, value = (x.strip() for x in item.split("=", 1))
        node = tree
        *parents, leaf = key.split(".")
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"config key {key!r} conflicts with another override")
        node[leaf] = (key, value)
    return _apply(cfg, tree)


def _apply(obj: Any, tree: dict) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    changes = {}
    for name, sub in tree.items():
        if name not in fields:
            key = sub[0] if isinstance(sub, tuple) else name
            raise ValueError(f"unknown config key {key!r}: {type(obj).__name__} has no field "
                             f"{name!r}; valid: {sorted(fields)}")
        current = getattr(obj, name)
        if isinstance(sub, dict):
            if not dataclasses.is_dataclass(current):
                raise ValueError(f"unknown config key: {name!r} is not a section")
            changes[name] = _apply(current, sub)
        else:
            key, value = sub
            if dataclasses.is_dataclass(current):
                raise ValueError(f"config key {key!r} is a section; set one of its fields")
            changes[name] = _convert(value, current, hints[name], key)
    return dataclasses.replace(obj, **changes)


def load_config(path: str | None) -> TrainConfig:
    """Loads `CONFIG` from a Python config file (see `configs/`), or the default config."""
    if not path:
        from jaxrl_lp.train.defaults import default_config

        return default_config()
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"jaxrl_lp_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = getattr(module, "CONFIG", None)
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"config file {path!r} must define CONFIG = TrainConfig(...)")
    return cfg
