"""Training configuration: the frozen dataclasses a run is described by, validated on construction.

Reading them from files and `--set a.b=c` overrides is `train.config_files`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl_lp.fields import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_str,
)
from jaxrl_lp.lora.config import LoraConfig
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.parallel.distributed import DistributedConfig
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.train.grpo_config import GRPOConfig, RunPolicies
from jaxrl_lp.train.sync_hooks import SyncConfig

__all__ = ["DistributedConfig", "GRPOConfig", "LoraConfig", "RunConfig", "RunPolicies", "SFTConfig",
           "SyncConfig", "TaskConfig", "TrainConfig"]


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The task: `arithmetic` (generated) or `gsm8k` (a local JSONL/parquet file at `path`);
    multi-turn with a calculator tool: `calculator` (generated) or `gsm8k_tools` (a file).

    Attributes:
      kind: `arithmetic` (generated problems), `gsm8k` (a local file; needs init_from),
        `calculator` (multi-turn arithmetic with a calculator the model may call,
        `envs.CalculatorTask`) or `gsm8k_tools` (GSM8K with a Python-expression
        calculator, `envs.PythonCalculatorTask`; a local file, needs init_from).
      ops: arithmetic, calculator: the operations, distinct characters from `+-*`.
      max_digits: arithmetic: operands have up to this many digits (1..9); calculator:
        the first operand's digits.
      second_digits: calculator: the second operand's digits.
      reverse_answer: arithmetic answers are written least significant digit first.
      pad_operands: arithmetic operands are zero-padded to max_digits.
      path: gsm8k, gsm8k_tools: the local JSONL or parquet file (question, answer with
        `#### final`).
      seed: the order of the task's train and held-out splits.
      max_turns: multi-turn: model turns per episode at most.
      tool_fraction: calculator: the share of warm-start episodes that call the tool
        (the rest answer at once).
      env_timeout_s: multi-turn: seconds an environment call may take; a slower one
        ends its episode (reason `timeout`).
      failure_reward: multi-turn: the reward of an episode a failing environment ended.
    """

    kind: Literal["arithmetic", "gsm8k", "calculator", "gsm8k_tools"] = "arithmetic"
    ops: str = "+"
    max_digits: int = 2
    reverse_answer: bool = False
    pad_operands: bool = False
    path: str = ""
    seed: int = 0
    second_digits: int = 2
    max_turns: int = 3
    tool_fraction: float = 0.3
    env_timeout_s: float = 10.0
    failure_reward: float = 0.0

    @property
    def multiturn(self) -> bool:
        """Whether the task's episodes take several turns (with an environment)."""
        return self.kind in ("calculator", "gsm8k_tools")

    def __post_init__(self):
        check_choice("task.kind", self.kind, ("arithmetic", "gsm8k", "calculator", "gsm8k_tools"))
        check_int("task.second_digits", self.second_digits, minimum=1)
        check_int("task.max_turns", self.max_turns, minimum=1)
        check_number("task.tool_fraction", self.tool_fraction, ge=0,
                     why=" (a share of the warm-start episodes, at most 1)")
        if self.tool_fraction > 1:
            raise ValueError(f"task.tool_fraction={self.tool_fraction}: a share of the warm-start "
                             "episodes, in [0, 1]")
        check_number("task.env_timeout_s", self.env_timeout_s, gt=0)
        check_number("task.failure_reward", self.failure_reward)
        check_str("task.ops", self.ops, nonempty=True, what="operations from '+-*', e.g. '+-'")
        check_int("task.max_digits", self.max_digits, minimum=1)
        check_bool("task.reverse_answer", self.reverse_answer)
        check_bool("task.pad_operands", self.pad_operands)
        check_str("task.path", self.path)
        check_int("task.seed", self.seed, minimum=0)
        if self.kind in ("gsm8k", "gsm8k_tools") and not self.path:
            raise ValueError("task.path must name a local GSM8K JSONL or parquet file "
                             f"(task.kind={self.kind})")
        if self.kind == "calculator" and self.path:
            raise ValueError(f"task.path={self.path!r} is read by task.kind=gsm8k or "
                             "gsm8k_tools only; leave it empty for task.kind=calculator")
        if self.kind == "arithmetic":
            if self.path:
                raise ValueError(f"task.path={self.path!r} is read by task.kind=gsm8k only; "
                                 "set task.kind=gsm8k or leave task.path empty")
            from jaxrl_lp.data.arithmetic import ArithmeticTask

            try:  # the task's own rules for ops and max_digits (it builds nothing yet)
                ArithmeticTask(ops=self.ops, max_digits=self.max_digits, seed=self.seed)
            except ValueError as e:
                raise ValueError(str(e).replace("ArithmeticTask: ", "task.")) from None


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The supervised warm-start.

    Attributes:
      steps: warm-start steps (0: start GRPO from the initial weights).
      batch_size: sequences per warm-start step.
      lr: peak AdamW learning rate (linear warmup, then cosine decay to 0).
      warmup_steps: learning-rate warmup steps (at most half of steps).
      optimizer: how the run holds and trains its weights, for the whole run (GRPO
        continues with the same weights): `adamw` (f32 params), `error_diffusion:binary:k=8`
        or `error_diffusion:ternary:k=4` (int8 codes with a k-bit residual, k in 2..8,
        optional `:lr=X`; Adam on the rest), `latent_ste:binary` / `latent_ste:ternary`
        (f32 latents, straight-through). See jaxrl_lp.optim.
    """

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    optimizer: str = "adamw"

    def __post_init__(self):
        check_int("sft.steps", self.steps, minimum=0)
        check_int("sft.batch_size", self.batch_size, minimum=1)
        check_number("sft.lr", self.lr, gt=0)
        check_int("sft.warmup_steps", self.warmup_steps, minimum=0)
        check_str("sft.optimizer", self.optimizer, nonempty=True,
                  what="e.g. adamw or error_diffusion:binary:k=8")
        from jaxrl_lp.optim.spec import OptimizerSpec

        OptimizerSpec.parse(self.optimizer, "sft.optimizer")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how the run is recorded.

    Attributes:
      out_dir: the run directory (created; an existing run there is resumed).
      seed: initial weights, data order and sampling keys.
      eval_every: greedy held-out evaluation every this many GRPO steps.
      eval_size: held-out problems per evaluation.
      checkpoint_every: save a checkpoint every this many steps (and at the end).
      keep_checkpoints: how many of the newest checkpoints to keep.
      progress: show progress bars (warm-start and GRPO).
      mesh: the device mesh, e.g. fsdp=8 or data=2,fsdp=2,tensor=2 (axes data,
        fsdp, tensor; the product is the device count of all processes); '' runs
        on one device.
      save_on_signal: on SIGTERM or SIGINT finish the step, save a checkpoint and
        exit with status 75 (a second signal exits at once); false: the signals'
        usual effect.
      learner_mesh: the learner's own devices, as `MESH` or `MESH@FIRST` (e.g. `fsdp=4`,
        `data=2@6`: FIRST is an index into jax.devices()), with `sampler_mesh`; the two
        groups must not overlap. Without '@' the learner's starts at device 0 and the
        sampler's right after it. A one-device group (`data=1`) runs that side as a
        single-device program. '' (with sampler_mesh ''): both share `run.mesh`.
      sampler_mesh: the sampler's own devices (as learner_mesh). With
        `grpo.max_staleness > 0` it samples the next batch while the learner updates.
    """

    out_dir: str = "runs/default"
    seed: int = 0
    eval_every: int = 10
    eval_size: int = 256
    checkpoint_every: int = 20
    keep_checkpoints: int = 2
    progress: bool = True
    mesh: str = ""
    save_on_signal: bool = True
    learner_mesh: str = ""
    sampler_mesh: str = ""

    def __post_init__(self):
        check_str("run.out_dir", self.out_dir, nonempty=True, what="a directory path")
        check_bool("run.save_on_signal", self.save_on_signal)
        check_int("run.seed", self.seed, minimum=0)
        for f in ("eval_every", "eval_size", "checkpoint_every", "keep_checkpoints"):
            check_int(f"run.{f}", getattr(self, f), minimum=1)
        check_bool("run.progress", self.progress)
        check_str("run.mesh", self.mesh, what="a mesh spec such as fsdp=8")
        if self.mesh:
            from jaxrl_lp.parallel.mesh import MeshSpec

            try:
                MeshSpec.parse(self.mesh)
            except ValueError as e:
                raise ValueError(f"run.mesh: {e}") from None
        for f in ("learner_mesh", "sampler_mesh"):
            check_str(f"run.{f}", getattr(self, f), what="a mesh spec such as fsdp=4 or data=4@4")
        if bool(self.learner_mesh) != bool(self.sampler_mesh):
            given, other = (("learner_mesh", "sampler_mesh") if self.learner_mesh
                            else ("sampler_mesh", "learner_mesh"))
            raise ValueError(f"run.{given}={getattr(self, given)!r} needs run.{other} too: the "
                             "learner and the sampler each get their own devices (or set neither "
                             "and use run.mesh)")
        if self.learner_mesh and self.mesh:
            raise ValueError(f"run.mesh={self.mesh!r} lays one mesh for both the learner and the "
                             f"sampler; with run.learner_mesh={self.learner_mesh!r} and "
                             f"run.sampler_mesh={self.sampler_mesh!r} set run.mesh=''")
        if self.learner_mesh:
            from jaxrl_lp.parallel.placement import parse_placement

            parse_placement(self.learner_mesh, self.sampler_mesh)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a `jaxrl-lp train` run needs.

    Attributes:
      model: the model (ignored when init_from is set: the checkpoint's config is used).
      task: the task and its data.
      sft: the supervised warm-start.
      grpo: the RL phase.
      loss: the policy loss.
      sync: the served copy the sampler runs on.
      lora: low-rank adapters on a frozen base (rank 0: the full model trains).
      run: where and how the run is recorded.
      distributed: how the processes of a multi-process run join (jax.distributed).
      init_from: a Hugging Face checkpoint directory to start from ('': random weights).
    """

    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    grpo: GRPOConfig = GRPOConfig()
    loss: LossConfig = LossConfig()
    sync: SyncConfig = SyncConfig()
    lora: LoraConfig = LoraConfig()
    run: RunConfig = RunConfig()
    distributed: DistributedConfig = DistributedConfig()
    init_from: str = ""

    def __post_init__(self):
        check_str("init_from", self.init_from, what="a checkpoint directory or ''")
        if self.run.learner_mesh and self.distributed.coordinator:
            # Every process runs every program of a run; a device group that some processes
            # hold none of would need the sampler and the learner as programs of their own.
            raise ValueError(
                f"run.learner_mesh={self.run.learner_mesh!r} / run.sampler_mesh="
                f"{self.run.sampler_mesh!r} place the learner and the sampler in one process; "
                f"with distributed.coordinator={self.distributed.coordinator!r} use run.mesh "
                "(they share the devices and take turns) or run one process")
        if self.lora.enabled and self.grpo.max_staleness:
            # A LoRA checkpoint holds the adapters and the base's identity; the rollouts in
            # flight and the sampler's weights of an off-policy run are not part of it yet.
            raise ValueError(
                f"lora.rank={self.lora.rank} with grpo.max_staleness={self.grpo.max_staleness}: "
                "off-policy GRPO does not train LoRA adapters yet; set grpo.max_staleness=0 "
                "(synchronous) or lora.rank=0 (full fine-tuning)")
        self.sync.check_served_copy(merged_lora=self.lora.enabled and self.lora.serve == "merged")
