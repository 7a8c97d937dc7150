"""How a looped model loops: exit rules, loop specs, recorded exit schedules, the exit pdf.

- `ExitRule`: which loop step a token exits at (`full`, `fixed:K`,
  `threshold:T[:MIN_LOOPS]`), decided from the exit distribution.
- `LoopSpec`: an exit rule and a compute mode (`dense` / `deferred`), the
  static part of how a looped forward runs. `exit_rule="model"` means the
  model's own default (`ModelConfig.exit_rule`, which a Hugging Face Ouro
  checkpoint sets from its `early_exit_step` / `early_exit_threshold`).
- `ExitSchedule`: the per-token part, arrays: a recorded exit schedule to
  replay, the read-out steps, which sequences are still live.
- `exit_distribution`: the exit pdf, in the reference code's order of operations.

The exit distribution from per-step gate probabilities `lambda_r` is

    p_r = lambda_r * remaining_r,  remaining_{r+1} = remaining_r * (1 - lambda_r)   (r < R - 1)
    p_{R-1} = remaining_{R-1}                                   (the remaining mass)

with `remaining_0 = 1`, each product taken in that order in f32, and the
cumulative probability is the running f32 sum `p_0 + p_1 + ...` (the Ouro
code's `torch.cumsum`). A `threshold:T` token exits at the first step whose
cumulative probability is >= T, the last step if none is. With saturated
gates the f32 sum reaches 1.0 before the last step, so `threshold:1.0` is not
`full`. Loop steps are 0-based in schedules: exit step e means e + 1 steps ran.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["MODEL_DEFAULT", "ExitRule", "ExitSchedule", "LoopSpec", "exit_distribution",
           "exit_rule_from_hf", "exit_rule_to_hf"]

MODEL_DEFAULT = "model"
ComputeMode = Literal["dense", "deferred"]


@dataclasses.dataclass(frozen=True)
class ExitRule:
    """Which loop step a token exits at.

    kind: `full` (the last step), `fixed` (after `steps` loop steps, 1..R) or
      `threshold` (the first step whose cumulative exit probability reaches
      `threshold`, once at least `min_loops` steps have run; the last step if
      none does). A threshold above 1 is allowed: the f32 cumulative sum can
      exceed 1.0 by rounding, and a checkpoint may ask for it.
    String forms: `full`, `fixed:2`, `threshold:0.9`, `threshold:0.9:2`.
    """

    kind: Literal["full", "fixed", "threshold"] = "full"
    steps: int = 0
    threshold: float = 1.0
    min_loops: int = 1

    def __post_init__(self):
        if self.kind not in ("full", "fixed", "threshold"):
            raise ValueError(f"ExitRule.kind must be 'full', 'fixed' or 'threshold'; got {self.kind!r}")
        if self.kind == "fixed" and self.steps < 1:
            raise ValueError(f"ExitRule fixed(k) needs k >= 1 loop steps; got {self.steps}")
        if self.kind == "threshold" and not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"ExitRule threshold must be a finite number > 0; got {self.threshold}")
        if self.min_loops < 1:
            raise ValueError(f"ExitRule.min_loops must be >= 1; got {self.min_loops}")

    @classmethod
    def parse(cls, spec: str | ExitRule) -> ExitRule:
        """Reads `full`, `fixed:K` or `threshold:T[:MIN_LOOPS]`."""
        if isinstance(spec, ExitRule):
            return spec
        parts = str(spec).split(":")
        try:
            if parts[0] == "full" and len(parts) == 1:
                return cls("full")
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", steps=int(parts[1]))
            if parts[0] == "threshold" and len(parts) in (2, 3):
                ml = int(parts[2]) if len(parts) == 3 else 1
                return cls("threshold", threshold=float(parts[1]), min_loops=ml)
        except ValueError as e:
            raise ValueError(f"bad exit rule {spec!r}: {e}") from None
        raise ValueError(
            f"bad exit rule {spec!r}; use 'full', 'fixed:K' or 'threshold:T[:MIN_LOOPS]'"
        )

    def __str__(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "fixed":
            return f"fixed:{self.steps}"
        return f"threshold:{self.threshold}:{self.min_loops}"

    def check(self, loop_steps: int) -> None:
        """Raises when the rule asks for more loop steps than the model has."""
        if self.kind == "fixed" and self.steps > loop_steps:
            raise ValueError(f"exit rule fixed:{self.steps} exceeds the model's {loop_steps} loop steps")
        if self.kind == "threshold" and self.min_loops > loop_steps:
            raise ValueError(f"exit rule {self} asks for min_loops={self.min_loops} but the model "
                             f"has {loop_steps} loop steps")


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """How a looped model runs (static; dense models ignore it).

    Attributes:
      exit_rule: `model` (the model config's own `exit_rule`), `full`,
        `fixed:K` or `threshold:T[:MIN_LOOPS]` (see `ExitRule`).
      compute_mode: `dense` (all loop steps; the rule picks the read-out) or
        `deferred` (a token stops at its exit step; steps end when all exited).

    `str(spec)` is `exit_rule/compute_mode`, and `LoopSpec.parse` reads it back.
    A rollout records its spec resolved (`resolve`), never as `model`.
    """

    exit_rule: str = MODEL_DEFAULT
    compute_mode: ComputeMode = "dense"

    def __post_init__(self):
        if self.exit_rule != MODEL_DEFAULT:
            object.__setattr__(self, "exit_rule", str(ExitRule.parse(self.exit_rule)))
        if self.compute_mode not in ("dense", "deferred"):
            raise ValueError(
                f"LoopSpec.compute_mode must be 'dense' or 'deferred'; got {self.compute_mode!r}"
            )

    @classmethod
    def parse(cls, spec: str | LoopSpec) -> LoopSpec:
        """Reads `exit_rule/compute_mode` (the form `str` writes)."""
        if isinstance(spec, LoopSpec):
            return spec
        rule, sep, mode = str(spec).rpartition("/")
        if not sep:
            raise ValueError(f"bad loop spec {spec!r}; expected EXIT_RULE/COMPUTE_MODE, e.g. "
                             "'full/dense' or 'threshold:0.9:1/deferred'")
        return cls(rule, mode)

    def __str__(self) -> str:
        return f"{self.exit_rule}/{self.compute_mode}"

    @property
    def rule(self) -> ExitRule:
        """The exit rule (a resolved spec only)."""
        if self.exit_rule == MODEL_DEFAULT:
            raise ValueError("LoopSpec(exit_rule='model') is not resolved: call .resolve(cfg)")
        return ExitRule.parse(self.exit_rule)

    def resolve(self, cfg: Any) -> LoopSpec:
        """This spec with `model` replaced by `cfg.exit_rule`, checked against `cfg`.

        Dense models have no loop: for them every spec resolves to `full/dense`
        (one spec can then serve both model kinds).
        """
        if not cfg.is_looped:
            return LoopSpec("full", "dense")
        rule = cfg.exit_rule if self.exit_rule == MODEL_DEFAULT else self.exit_rule
        spec = dataclasses.replace(self, exit_rule=rule)
        spec.rule.check(cfg.loop_steps)
        return spec


class ExitSchedule(NamedTuple):
    """Per-token schedule data for a looped forward (every field optional).

    depth_BxT: int32, a recorded schedule to replay instead of the exit rule:
      the 0-based step at which each token exits (in deferred mode, the last
      step it computes).
    readout_BxT: int32, the step each token is read out at when it differs
      from its exit step (a prompt's last token runs at full depth in deferred
      mode, but the sampler read it out where the rule said).
    active_BxT: bool, False for tokens of sequences that have finished. In
      deferred mode such a token counts as exited before step 0: it is never
      computed and does not hold the batch's loop over steps.
    forced_BxT: bool, where `depth_BxT` and `readout_BxT` apply; elsewhere the
      exit rule decides as if they were not given. None: they apply to every
      token. The sampler's program takes a recorded schedule this way, so
      that sampling (False) and its replay (True) run one compiled program
      (`rollout.replay`).
    """

    depth_BxT: jax.Array | None = None
    readout_BxT: jax.Array | None = None
    active_BxT: jax.Array | None = None
    forced_BxT: jax.Array | None = None


def exit_distribution(lambdas_RxBxT: jax.Array) -> jax.Array:
    """The exit distribution p [B, T, R] from per-step gate probabilities [R, B, T].

    Computed step by step in the reference's order (module docstring), the
    same operations the looped forward performs as it runs.
    """
    r = lambdas_RxBxT.shape[0]
    remaining = jnp.ones_like(lambdas_RxBxT[0])
    pdf = []
    for i in range(r):
        lam = lambdas_RxBxT[i]
        pdf.append(lam * remaining if i < r - 1 else remaining)
        remaining = remaining * (1.0 - lam)
    return jnp.stack(pdf, axis=-1)


def exit_rule_from_hf(cfg: dict, loop_steps: int) -> str:
    """The default exit rule of an Ouro `config.json`, as its reference forward reads out.

    The reference reads out at `early_exit_step` (0-based) when it is set and
    within `[0, R)`; otherwise at the first step whose cumulative exit
    probability reaches `early_exit_threshold` (`OuroConfig`'s default 1.0).
    """
    step = cfg.get("early_exit_step")
    if step is not None and 0 <= int(step) < loop_steps:
        return "full" if int(step) == loop_steps - 1 else f"fixed:{int(step) + 1}"
    threshold = cfg.get("early_exit_threshold", 1.0)
    if threshold is None:  # the reference then reads out after the last step
        return "full"
    threshold = float(threshold)
    if threshold <= 0:  # every cumulative probability is >= it: the first step
        return "fixed:1"
    return str(ExitRule("threshold", threshold=threshold))


def exit_rule_to_hf(rule: str | ExitRule, loop_steps: int) -> dict:
    """The `config.json` keys that make the reference Ouro code read out like `rule`."""
    rule = ExitRule.parse(rule)
    rule.check(loop_steps)
    if rule.kind == "full":
        return {"early_exit_step": loop_steps - 1, "early_exit_threshold": 1.0}
    if rule.kind == "fixed":
        return {"early_exit_step": rule.steps - 1, "early_exit_threshold": 1.0}
    if rule.min_loops != 1:
        raise NotImplementedError(
            f"exit rule {rule}: the Ouro config has no min_loops; save a rule without it "
            f"(threshold:{rule.threshold}) or a fixed step")
    return {"early_exit_step": None, "early_exit_threshold": rule.threshold}
