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

__all__ = ["TASK_KINDS", "DistributedConfig", "GRPOConfig", "LoraConfig", "RunConfig", "RunPolicies",
           "SFTConfig", "SyncConfig", "TaskConfig", "TrainConfig"]


# The built-in task kinds; `dataset` reads a user's file (`tasks.DatasetTask`).
TASK_KINDS = ("arithmetic", "gsm8k", "calculator", "gsm8k_tools", "dataset")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The task: a built-in one, or a user's data, reward functions and environment.

    Built in: `arithmetic` (generated) or `gsm8k` (a local JSONL/parquet file at `path`);
    multi-turn with a calculator tool: `calculator` (generated) or `gsm8k_tools` (a file).
    A user's own: `dataset` (a local file or `datasets` directory at `path`, scored by the
    reward functions `rewards`, optionally with an environment `env`: `tasks.DatasetTask`),
    or any task object passed to `run_train(cfg, task=...)` or defined as `TASK` in a
    `--config` file (then this section is not read).

    Attributes:
      kind: `arithmetic` (generated problems), `gsm8k` (a local file; needs init_from),
        `calculator` (multi-turn arithmetic with a calculator the model may call,
        `envs.CalculatorTask`), `gsm8k_tools` (GSM8K with a Python-expression
        calculator, `envs.PythonCalculatorTask`; a local file, needs init_from) or
        `dataset` (a user's records: the keys below).
      ops: arithmetic, calculator: the operations, distinct characters from `+-*`.
      max_digits: arithmetic: operands have up to this many digits (1..9); calculator:
        the first operand's digits.
      second_digits: calculator: the second operand's digits.
      reverse_answer: arithmetic answers are written least significant digit first.
      pad_operands: arithmetic operands are zero-padded to max_digits.
      path: gsm8k, gsm8k_tools: the local JSONL or parquet file (question, answer with
        `#### final`); dataset: a JSONL, JSON or Parquet file, or a directory (a
        `datasets` `save_to_disk` copy, or data files), read with `datasets`, offline.
      seed: the order of the task's train and held-out splits.
      max_turns: multi-turn: model turns per episode at most.
      tool_fraction: calculator: the share of warm-start episodes that call the tool
        (the rest answer at once).
      env_timeout_s: multi-turn: seconds an environment call may take; a slower one
        ends its episode (reason `timeout`).
      failure_reward: the reward of an episode a failing environment ended, and of a
        sample a reward function failed on (raised, timed out, a non-finite value),
        counted as `reward_failed/<name>`.
      prompt_key: dataset: the column holding the prompt, a string or a chat `messages`
        list.
      answer_key: dataset: the column holding the reference answer (passed to the reward
        functions as `answer` too); '' for none.
      completion_key: dataset: the column the warm-start learns from ('': answer_key).
      heldout: dataset: the held-out records: '' (the source's `test` split if it has
        one, else a hash-chosen `heldout_fraction` of the records) or a file like `path`.
      heldout_fraction: dataset: the share of records held out when `heldout` is ''.
      rewards: dataset: the reward functions, comma-separated `NAME[=WEIGHT]`: built-ins
        (`exact_match`, `number_match`, `math_verify`, `think_format`, `regex_format`)
        or import paths `pkg.mod:fn` / `file.py:fn` with TRL's signature; '' is
        `exact_match`.
      format_regex: dataset: the pattern `regex_format` matches a completion against.
      reward_timeout_s: dataset: seconds a reward function may take on a batch.
      system_prompt: dataset: a system message put before each prompt ('' for none).
      chat_template: dataset: `auto` renders prompts with `init_from`'s chat template when
        it has one (else the plain format, said once); `none` always the plain format.
      template_options: dataset: the chat template's variables, `k=v,...` (values read as
        JSON where they parse, e.g. `enable_thinking=false`).
      env: dataset: an environment factory `pkg.mod:make_env` (multi-turn episodes);
        '' for single-turn completions.
      tools: dataset: tool functions `pkg.mod:fn,...` the model calls in the chat
        template's `<tool_call>` format (`tasks.ToolEnv`); exclusive with env.
      stop: dataset, multi-turn: strings that end a model turn, each one token
        (',' separated; '' is `</tool_call>` where the tokenizer has it).
      max_turn_tokens: dataset, multi-turn: tokens of one model turn (0: grpo.max_new_tokens,
        or 128).
      max_observation_tokens: dataset, multi-turn: tokens of one observation at most.
    """

    kind: Literal["arithmetic", "gsm8k", "calculator", "gsm8k_tools", "dataset"] = "arithmetic"
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
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    completion_key: str = ""
    heldout: str = ""
    heldout_fraction: float = 0.1
    rewards: str = ""
    format_regex: str = ""
    reward_timeout_s: float = 60.0
    system_prompt: str = ""
    chat_template: Literal["auto", "none"] = "auto"
    template_options: str = ""
    env: str = ""
    tools: str = ""
    stop: str = ""
    max_turn_tokens: int = 0
    max_observation_tokens: int = 128

    @property
    def multiturn(self) -> bool:
        """Whether the task's episodes take several turns (with an environment)."""
        return self.kind in ("calculator", "gsm8k_tools") or bool(self.env or self.tools)

    def __post_init__(self):
        check_choice("task.kind", self.kind, TASK_KINDS)
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
        for f in ("prompt_key", "answer_key", "completion_key", "heldout", "rewards",
                  "format_regex", "system_prompt", "template_options", "env", "tools", "stop"):
            check_str(f"task.{f}", getattr(self, f))
        check_str("task.prompt_key", self.prompt_key, nonempty=True, what="a column name")
        if self.template_options:
            from jaxrl_lp.tasks.chat import parse_template_options

            parse_template_options(self.template_options)
        check_number("task.heldout_fraction", self.heldout_fraction, gt=0, lt=1)
        check_number("task.reward_timeout_s", self.reward_timeout_s, gt=0)
        check_choice("task.chat_template", self.chat_template, ("auto", "none"))
        check_int("task.max_turn_tokens", self.max_turn_tokens, minimum=0)
        check_int("task.max_observation_tokens", self.max_observation_tokens, minimum=1)
        if self.kind in ("gsm8k", "gsm8k_tools", "dataset") and not self.path:
            what = "GSM8K JSONL or parquet file" if self.kind != "dataset" else \
                "JSONL, JSON or Parquet file, or a datasets directory"
            raise ValueError(f"task.path must name a local {what} (task.kind={self.kind})")
        if self.kind == "calculator" and self.path:
            raise ValueError(f"task.path={self.path!r} is read by task.kind=gsm8k, gsm8k_tools or "
                             "dataset only; leave it empty for task.kind=calculator")
        dataset_keys = {"rewards": "", "env": "", "tools": "", "heldout": "", "stop": "",
                        "system_prompt": "", "template_options": "", "format_regex": ""}
        if self.kind != "dataset":
            given = [k for k, v in dataset_keys.items() if getattr(self, k) != v]
            if given:
                raise ValueError(f"task.{given[0]}={getattr(self, given[0])!r} is read by "
                                 f"task.kind=dataset only (got task.kind={self.kind}); set "
                                 f"task.kind=dataset or leave task.{given[0]} empty")
        if self.env and self.tools:
            raise ValueError(f"task.env={self.env!r} and task.tools={self.tools!r}: an episode "
                             "has one environment; give task.env (your own) or task.tools (the "
                             "tool-calling environment over your functions)")
        if self.kind == "arithmetic":
            if self.path:
                raise ValueError(f"task.path={self.path!r} is read by task.kind=gsm8k or dataset; "
                                 "set one of them or leave task.path empty")
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
      wandb: also log the metrics and the config to Weights & Biases (`pip install
        'jaxrl-lp[wandb]'`), besides metrics.jsonl and TensorBoard.
      wandb_project: the W&B project.
      wandb_mode: `online` (synced as the run goes) or `offline` (written under the run
        directory, no network; `wandb sync` uploads it later).
      xla_gpu_flags: XLA's GPU flags by preset, comma-separated to combine (`none`,
        `decode_graphs`: the decode loop as CUDA graphs, `scheduler`: the latency-hiding
        scheduler; `jaxrl_lp.xla_flags`), added to `XLA_FLAGS` when the run starts, before
        JAX's backend; refused if the backend started already. No effect off a GPU.
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
    wandb: bool = False
    wandb_project: str = "jaxrl-lp"
    wandb_mode: Literal["online", "offline"] = "online"
    xla_gpu_flags: str = "none"

    def __post_init__(self):
        check_bool("run.wandb", self.wandb)
        from jaxrl_lp.xla_flags import parse as parse_xla_gpu_flags

        parse_xla_gpu_flags(self.xla_gpu_flags, "run.xla_gpu_flags")
        check_str("run.wandb_project", self.wandb_project, nonempty=True, what="a W&B project name")
        check_choice("run.wandb_mode", self.wandb_mode, ("online", "offline"))
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
