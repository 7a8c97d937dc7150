"""Training configuration: the frozen dataclasses a run is described by, validated on construction.

Reading them from files and `--set a.b=c` overrides is `train.config_files`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Literal, NamedTuple

from jaxrl_lp.fields import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_str,
)
from jaxrl_lp.lora.config import LoraConfig
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.parallel.distributed import DistributedConfig
from jaxrl_lp.rl.loss import LossConfig
from jaxrl_lp.rollout.sampling import DRAWS
from jaxrl_lp.train.sync_hooks import SyncConfig

__all__ = ["DistributedConfig", "GRPOConfig", "LoraConfig", "RunConfig", "RunPolicies", "SFTConfig",
           "SyncConfig", "TaskConfig", "TrainConfig"]


class RunPolicies(NamedTuple):
    """The learner's and the sampler's `Policy`, parsed once from a `GRPOConfig`."""

    learner: Policy
    sampler: Policy

    @property
    def matched(self) -> bool:
        """Whether the two are the same policy (replay == sampler is then promised)."""
        return self.learner == self.sampler


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
class GRPOConfig:
    """The RL phase.

    Attributes:
      steps: GRPO steps (each: sample, score, `mu` passes over `minibatches`).
      prompts_per_step: prompts sampled per step; the batch is prompts_per_step * group_size.
      group_size: completions per prompt, >= 2 (a group of 1 has no advantage signal).
      max_new_tokens: completion budget; 0 means the task's answer length + EOS. For
        task.kind=gsm8k_tools, the tokens of one model turn (0: 128).
      lr: Adam learning rate (gradients clipped to global norm 1).
      mu: passes over each step's batch.
      minibatches: optimizer updates per pass (the batch is split into this many).
      micro_batches: gradient-accumulation slices per minibatch (same result, less memory).
      advantage: `grpo`, `drgrpo` or `rloo`.
      logprobs: learner log-probs, `dense` or `hybrid`.
      replay: `auto`: where an update computes with the weights the sampler ran, under
        its policy, the hybrid's value and the behaviour log-probs are the rollout's
        recorded ones and the replay is not run (`train.behaviour`); `always`: every
        update replays (the behaviour before this key existed).
      verify_every: every this many GRPO steps (from the first) the batch is replayed
        anyway and must equal the sampler's recorded bits where `auto` would take them
        (else the run stops with `ReplayMismatchError`); 0: never.
      start_probe: before anything is written, where the run takes the sampler's
        recorded log-probs as the replay's (`replay=auto`, hybrid, matched
        policies), sample a batch at the run's shapes on its devices and replay
        it whole and in the run's minibatch and micro-batch slices; a bit that
        differs stops the run with one line (`train.probe`). false: skip it.
      reuse_products: the sampler also keeps its weight products and logits
        (`models.recorded`), and an update that computes with the weights the sampler
        ran (where `replay=auto` takes the recorded log-probs) reads them instead of
        computing its forward's matmuls: the same values, the gradient of the
        computation that sampled the tokens (the dense one up to matmul rounding), about
        a third of the update's FLOPs saved. Memory: every layer's products for every
        token and the [B, N, V] logits (0.27 GB for the small preset's 8 x 128 tokens;
        tens of GB for a billion-parameter model's batch). A dense model on one device,
        `logprobs=hybrid`, `replay=auto`, plain weights, a plain synchronous sampler (not
        speculative, `max_staleness=0`). Metric `reused_forward_updates`.
      learner_policy: the learner's precision policy, e.g. `fp32`, `bf16`, `p=f32,c=bf16`.
      sampler_policy: the sampler's precision policy (matched when equal to the learner's).
      exit_rule: the looped sampler's exit rule: `model` (the model's own default:
        `model.exit_rule`, or an Ouro checkpoint's early-exit keys), `full`, `fixed:K`
        or `threshold:T[:MIN_LOOPS]`.
      compute_mode: `dense` (every loop step runs) or `deferred` (a token stops at its exit).
      temperature: sampling temperature.
      draw: how the sampler draws a token from the filtered, tempered distribution
        (`rollout.sampling.draw_categorical`): `gumbel` (`jax.random.categorical`, the
        default) or `inverse_cdf` (one uniform per row against the cumulative
        probabilities: the same distribution, other tokens for the same key, a
        faster sampler on CPU). The recorded log-probs score the drawn tokens either
        way, so the replay is the sampler's bits under both. Not with `speculative`
        (its drafter and residual draws are Gumbel-max).
      dynamic_sampling: DAPO dynamic sampling: a group whose rewards (after overlong
        shaping) are all equal has no gradient, so each step draws further batches of
        `prompts_per_step` prompts from the run's prompt stream (the same sampler weights
        and weights version; a fresh sampling key per round) until the batch holds
        `prompts_per_step` informative groups, taken in the order drawn
        (`rl.dynamic_sampling`). The recorded log-probs stay the sampler's own, so the
        replay rule and `verify_every` (the replay runs each row in the sampler call
        that drew it, `rollout.replay`) apply unchanged. Metrics `refill_rounds`,
        `refilled_groups`, `masked_groups`, `informative_groups`.
      max_refill_rounds: with dynamic_sampling, at most this many further batches per
        step; where they do not find enough informative groups the batch is completed
        with the first batch's zero-variance groups, masked out of the loss, and
        `masked_groups` counts them. 0: no refill, zero-variance groups are masked.
      overlong_buffer: DAPO soft overlong punishment, in tokens: a completion of L tokens
        (EOS included) longer than max_new_tokens - overlong_buffer has
        `-overlong_penalty * (L - (max_new_tokens - overlong_buffer)) / overlong_buffer`
        added to its reward before the advantages (and before dynamic sampling's
        zero-variance test); `rl.advantages.overlong_penalty`. At most the completion
        budget (max_new_tokens, or the task's answer length when that is 0). 0: off.
        Metrics `overlong_penalty_mean` (the batch's mean penalty, <= 0; 0 when off)
        and `overlong_frac` (completions penalized); `reward_mean` stays the task's.
      overlong_penalty: the penalty at the full budget (>= 0), with overlong_buffer.
      remat: recompute layer activations in the backward pass (less memory, more time).
      max_nonfinite_in_row: stop the run after this many skipped steps in a row.
      speculative: speculative rollouts (`rollout.SpecConfig`): '' (off), `self:loops=1,k=4`
        (the looped model drafts for itself at fewer loop steps) or
        `dense:PATH,k=4,sink=4,window=256` (a dense drafter checkpoint). Same samples,
        fewer target forwards; needs `compute_mode=dense`.
      turn_credit: a multi-turn task's advantages: `episode` (one per episode, from the
        sum of its turns' rewards) or `reward_to_go` (one per model turn, from the
        discounted rewards of that turn and the later ones, baselined by the group's
        episodes that reached the same turn: `rl.advantages.turn_advantages`).
      turn_discount: with `turn_credit=reward_to_go`, the weight in [0, 1] of a reward
        one turn later (1: every later reward counts in full).
      max_staleness: off-policy GRPO (`train.rollout_queue`): the rollout of GRPO step n
        is sampled on the weights exported at step max(0, n - K), so the sampler can
        sample step n + K's batch while the learner updates on step n's (on their own
        devices: `run.learner_mesh`, `run.sampler_mesh`; on shared ones they take
        turns, with the same numbers). The ratio's numerator is the replay under the
        current weights, its denominator the sampler's recorded log-probs: exactly the
        policy change with matched policies. 0: the synchronous loop, bit for bit.
        Metric `rollout_staleness`; `offpolicy_*` measure the current policy against
        the behaviour one, `mismatch_*` the numerics alone.
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
    replay: Literal["auto", "always"] = "auto"
    verify_every: int = 10
    start_probe: bool = True
    reuse_products: bool = False
    learner_policy: str = "fp32"
    sampler_policy: str = "fp32"
    exit_rule: str = "model"
    compute_mode: Literal["dense", "deferred"] = "dense"
    temperature: float = 1.0
    draw: Literal["gumbel", "inverse_cdf"] = "gumbel"
    dynamic_sampling: bool = False
    max_refill_rounds: int = 4
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_nonfinite_in_row: int = 5
    remat: bool = False
    speculative: str = ""
    max_staleness: int = 0
    turn_credit: Literal["episode", "reward_to_go"] = "episode"
    turn_discount: float = 1.0

    def _check_speculative(self):
        from jaxrl_lp.rollout.spec_config import SpecConfig

        try:
            spec = SpecConfig.parse(self.speculative)
        except (ValueError, TypeError) as e:
            raise ValueError(f"grpo.speculative={self.speculative!r}: {e}") from None
        if spec is not None and self.draw != "gumbel":
            raise ValueError(f"grpo.speculative={self.speculative!r} draws by Gumbel-max (its "
                             f"drafter and residual draws); set grpo.draw=gumbel (got "
                             f"{self.draw!r}) or grpo.speculative=''")
        if spec is not None and self.compute_mode != "dense":
            raise ValueError(f"grpo.speculative={self.speculative!r} verifies drafts in dense "
                             f"compute mode; set grpo.compute_mode=dense (got {self.compute_mode!r})")
        if spec is not None and spec.drafter == "dense" and not Path(spec.path).is_dir():
            raise ValueError(f"grpo.speculative={self.speculative!r}: the dense drafter's "
                             f"checkpoint directory {spec.path!r} does not exist")

    @functools.cached_property
    def policies(self) -> RunPolicies:
        """The learner's and the sampler's policy strings, parsed (once: the config's boundary)."""
        return RunPolicies(Policy.parse(self.learner_policy), Policy.parse(self.sampler_policy))

    def __post_init__(self):
        check_int("grpo.steps", self.steps, minimum=0)
        check_int("grpo.group_size", self.group_size, minimum=2,
                  why=": GRPO advantages compare samples within a group, and a group of 1 has "
                      "no signal")
        for f in ("prompts_per_step", "mu", "minibatches", "micro_batches", "max_nonfinite_in_row"):
            check_int(f"grpo.{f}", getattr(self, f), minimum=1)
        check_int("grpo.max_new_tokens", self.max_new_tokens, minimum=0,
                  why=" (0: the task's answer length)")
        check_number("grpo.lr", self.lr, gt=0)
        check_number("grpo.temperature", self.temperature, gt=0,
                     why=" (it divides the logits; the sampler records log-probs at it)")
        check_choice("grpo.draw", self.draw, DRAWS)
        check_choice("grpo.advantage", self.advantage, ("grpo", "drgrpo", "rloo"))
        check_choice("grpo.logprobs", self.logprobs, ("dense", "hybrid"))
        check_choice("grpo.replay", self.replay, ("auto", "always"))
        check_int("grpo.verify_every", self.verify_every, minimum=0, why=" (0: never)")
        check_bool("grpo.start_probe", self.start_probe)
        check_bool("grpo.reuse_products", self.reuse_products)
        if self.reuse_products and (self.logprobs, self.replay) != ("hybrid", "auto"):
            raise ValueError(
                "grpo.reuse_products=true gives the sampler's products to the updates whose "
                "recorded log-probs grpo.replay=auto takes; set grpo.logprobs=hybrid and "
                f"grpo.replay=auto (got {self.logprobs!r}, {self.replay!r}) or "
                "grpo.reuse_products=false")
        check_choice("grpo.compute_mode", self.compute_mode, ("dense", "deferred"))
        check_bool("grpo.dynamic_sampling", self.dynamic_sampling)
        check_int("grpo.max_refill_rounds", self.max_refill_rounds, minimum=0,
                  why=" (further prompt batches a dynamic-sampling step may draw; 0: mask the "
                      "zero-variance groups without refilling)")
        check_int("grpo.overlong_buffer", self.overlong_buffer, minimum=0,
                  why=" (tokens before the completion budget where the overlong penalty "
                      "ramps up; 0: off)")
        if self.max_new_tokens and self.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"grpo.overlong_buffer={self.overlong_buffer} is longer than the completion "
                f"budget grpo.max_new_tokens={self.max_new_tokens}; set it to at most "
                f"{self.max_new_tokens} (0: no overlong shaping)")
        check_number("grpo.overlong_penalty", self.overlong_penalty, ge=0,
                     why=" (the reward taken off a completion that uses the whole budget)")
        check_bool("grpo.remat", self.remat)
        check_int("grpo.max_staleness", self.max_staleness, minimum=0,
                  why=" (how many weight versions the sampler may run behind the learner; 0: "
                      "synchronous)")
        check_choice("grpo.turn_credit", self.turn_credit, ("episode", "reward_to_go"))
        check_number("grpo.turn_discount", self.turn_discount, ge=0,
                     why=" (the weight of a reward one turn later, in [0, 1])")
        if self.turn_discount > 1:
            raise ValueError(f"grpo.turn_discount={self.turn_discount!r} weights a later "
                             "turn's reward above the turn's own; set it in [0, 1]")
        if self.turn_discount != 1 and self.turn_credit == "episode":
            raise ValueError(f"grpo.turn_discount={self.turn_discount!r} discounts the turns of "
                             "grpo.turn_credit=reward_to_go; set that too, or "
                             "grpo.turn_discount=1.0")
        self._check_speculative()
        from jaxrl_lp.models.loop import LoopSpec

        for key, parse, value in (
                ("grpo.learner_policy", Policy.parse, self.learner_policy),
                ("grpo.sampler_policy", Policy.parse, self.sampler_policy),
                ("grpo.exit_rule", lambda v: LoopSpec(v, self.compute_mode), self.exit_rule)):
            if key.endswith("_policy") and not isinstance(value, str):
                raise ValueError(f"{key}={value!r}: a policy string such as 'bf16' (the config "
                                 "keeps the string; GRPOConfig.policies holds the parsed Policy)")
            try:
                parse(value)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{key}={value!r}: {e}") from None
        n = self.prompts_per_step * self.group_size
        if n % self.minibatches or (n // self.minibatches) % self.micro_batches:
            raise ValueError(
                f"grpo.minibatches={self.minibatches} / grpo.micro_batches={self.micro_batches}: "
                f"the batch of {n} sequences (prompts_per_step x group_size) must split into "
                "minibatches of micro_batches equal slices")


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
