"""The GRPO phase's configuration (`grpo.*`) and the two policies it names, parsed once.

Part of `train.config`'s `TrainConfig` (which re-exports both); validated on construction.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Literal, NamedTuple

from jaxrl_lp.fields import check_bool, check_choice, check_int, check_number
from jaxrl_lp.numerics.invariant import InvariantForm
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.sampling import DRAWS

__all__ = ["GRPOConfig", "RunPolicies"]


class RunPolicies(NamedTuple):
    """The learner's and the sampler's `Policy`, parsed once from a `GRPOConfig`."""

    learner: Policy
    sampler: Policy

    @property
    def matched(self) -> bool:
        """Whether the two are the same policy (replay == sampler is then promised)."""
        return self.learner == self.sampler


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
      logprobs: learner log-probs, `dense`, `hybrid`, `invariant` or `auto`. `invariant`:
        the sampler decodes in the batch-invariant forms (`numerics.invariant`, the decode
        layout `invariant`) and every update's value is its own parallel forward in the
        same forms, the sampler's bits without replaying the decode
        (docs/design/invariant.md). XLA:CPU on one device with plain weights; elsewhere
        the updates replay as `hybrid`'s (a warning says so). Not with `speculative`, nor
        under a `ternary` or `binary` policy (the formats it takes:
        `kernels.fake_quant.INVARIANT_FORMATS`).
        `auto`: `invariant` wherever its forms serve the run, `hybrid` otherwise
        (`train.logprobs_choice`); the run says which, and why.
      invariant_tiles: with `logprobs=invariant`, every product of the sampler's decode and
        the learner's forward in `kernels.fixed_tile`'s fixed tiles (`InvariantForm.tiles`):
        `compiled` (Mosaic GPU on a GPU, Mosaic TPU on a TPU; bf16 or f16 products on a
        GPU), `interpret-tpu` (the TPU version interpreted, on any host, for checks; the GPU
        version's interpreter sums a row by its place in a tile, so a run in it would stop
        at its start probe: it is for kernel checks, not runs).
        Where XLA's invariant forms are not proven (a GPU, a TPU) this is how the run takes
        `invariant` rather than replaying; not proven on a GPU yet (the start probe and
        `verify_every` check it, docs/design/invariant.md). '': XLA's forms.
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
      remat: what each layer's backward recomputes instead of saving (`models.remat`):
        `none`, `layers` (each layer's input saved, one more forward of FLOPs) or `dots`
        (the weight products' outputs saved, the attention and element-wise maths
        recomputed). `true`/`false` from older configs read as `layers`/`none`.
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
    logprobs: Literal["dense", "hybrid", "invariant", "auto"] = "hybrid"
    invariant_tiles: Literal["", "compiled", "interpret-tpu"] = ""
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
    remat: Literal["none", "layers", "dots"] = "none"
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
        if spec is not None and self.logprobs == "invariant":
            raise ValueError(f"grpo.speculative={self.speculative!r} verifies chunks, which the "
                             "invariant forward does not reproduce; set grpo.logprobs=hybrid or "
                             "grpo.speculative=''")
        if spec is not None and self.compute_mode != "dense":
            raise ValueError(f"grpo.speculative={self.speculative!r} verifies drafts in dense "
                             f"compute mode; set grpo.compute_mode=dense (got {self.compute_mode!r})")
        if spec is not None and spec.drafter == "dense" and not Path(spec.path).is_dir():
            raise ValueError(f"grpo.speculative={self.speculative!r}: the dense drafter's "
                             f"checkpoint directory {spec.path!r} does not exist")

    @property
    def invariant_form(self) -> InvariantForm | None:
        """The invariant form `invariant_tiles` names (every product in fixed tiles), or None
        (XLA's forms, `generate` picks this CPU's)."""
        return InvariantForm(0, None, self.invariant_tiles) if self.invariant_tiles else None

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
        check_choice("grpo.logprobs", self.logprobs, ("dense", "hybrid", "invariant", "auto"))
        check_choice("grpo.replay", self.replay, ("auto", "always"))
        check_choice("grpo.invariant_tiles", self.invariant_tiles,
                     ("", "compiled", "interpret-tpu"))
        if self.invariant_tiles and self.logprobs != "invariant":
            raise ValueError(f"grpo.invariant_tiles={self.invariant_tiles!r} is the invariant "
                             f"forms' products; set grpo.logprobs=invariant (got "
                             f"{self.logprobs!r}) or grpo.invariant_tiles=''")
        check_int("grpo.verify_every", self.verify_every, minimum=0, why=" (0: never)")
        check_bool("grpo.start_probe", self.start_probe)
        check_bool("grpo.reuse_products", self.reuse_products)
        if self.reuse_products and (self.logprobs not in ("hybrid", "auto")
                                    or self.replay != "auto"):
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
        if isinstance(self.remat, bool):  # the flag it was
            object.__setattr__(self, "remat", "layers" if self.remat else "none")
        check_choice("grpo.remat", self.remat, ("none", "layers", "dots"))
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
