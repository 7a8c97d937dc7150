"""Weight export, diagnostics and sync checks inside `jaxrl-lp train`.

The design: docs/design/sync.md, "Weight export and sync".

The learner keeps f32 master weights; each GRPO step exports the served copy
the sampler runs on. This module turns the `sync` config section into an
exporter, keeps the diagnostics' state (part of the checkpoint, so a resumed
run logs the same figures) and runs the seven sync checks at a cadence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_lp.fields import check_bool, check_int, check_str
from jaxrl_lp.models.lora import merge_adapters
from jaxrl_lp.sync import (
    SamplerState,
    cast,
    expected_layout,
    hash_served,
    kl_from_logprobs,
    progress_init,
    progress_update,
    quantize,
    run_sync_checks,
    served_params_for_forward,
    staleness_init,
    staleness_update,
    ulp_distance,
)
from jaxrl_lp.sync.ternary import ternary

__all__ = ["SyncCheckError", "SyncConfig", "SyncHooks", "make_exporter"]


class SyncCheckError(RuntimeError):
    """A sync check failed: the sampler does not hold what the learner exported."""


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How the served copy is made and watched.

    Attributes:
      exporter: `none` (the sampler runs on the master), `bf16:ROUNDING` or
        `f16:ROUNDING` (ROUNDING: nearest, stochastic, error_feedback), `fmt:FORMAT`
        (fp8, fp8_e5m2, mxfp8, mxfp4, nvfp4, ternary, binary) or `ternary:PATH`
        (bf16_then_quantize, direct_codes, bf16_fixed_point).
      loss_on_served: Fair Cast: the learner's loss is computed on the served
        copy, with a straight-through gradient to the master.
      check_every: run the seven sync checks every this many GRPO steps (0: never).
      bf16_start: round the master to bf16 values when GRPO starts, as an RL run
        from a released bf16 checkpoint starts.
      seed: the exporter's randomness (stochastic rounding).
    """

    exporter: str = "none"
    loss_on_served: bool = False
    check_every: int = 0
    bf16_start: bool = False
    seed: int = 0

    def __post_init__(self):
        check_str("sync.exporter", self.exporter, nonempty=True, what="an exporter spec")
        for f in ("loss_on_served", "bf16_start"):
            check_bool(f"sync.{f}", getattr(self, f))
        check_int("sync.check_every", self.check_every, minimum=0, why=" (0: never)")
        check_int("sync.seed", self.seed, minimum=0)
        make_exporter(self.exporter, self.seed)  # validates the spec
        # Settings that only act on a served copy would be silently ignored without one. A
        # LoRA run serving its merged copy has one without an exporter: `TrainConfig` checks
        # these two against the `lora` section (`check_served_copy`).

    def check_served_copy(self, merged_lora: bool = False) -> None:
        """Raises where `loss_on_served` or `check_every` is set without a served copy (an
        exporter, or a LoRA run's merged copy: `merged_lora`)."""
        for f, on in (("loss_on_served", self.loss_on_served), ("check_every", self.check_every)):
            if on and self.exporter == "none" and not merged_lora:
                raise ValueError(f"sync.{f}={str(getattr(self, f)).lower()} needs a served copy; set "
                                 "sync.exporter (e.g. bf16:stochastic), or lora.serve=merged in a "
                                 "LoRA run, or leave it off")


def make_exporter(spec: str, seed: int = 0):
    """The `Exporter` for a `SyncConfig.exporter` string, or None for `none`."""
    if spec == "none":
        return None
    kind, _, arg = spec.partition(":")
    if kind in ("bf16", "f16") and arg in ("nearest", "stochastic", "error_feedback"):
        return cast(kind, arg, seed=seed)
    if kind == "fmt" and arg:
        return quantize(arg)
    if kind == "ternary" and arg in ("bf16_then_quantize", "direct_codes", "bf16_fixed_point"):
        return ternary(arg)
    raise ValueError(
        f"sync.exporter={spec!r} is not one of: none, bf16:ROUNDING, f16:ROUNDING "
        "(nearest|stochastic|error_feedback), fmt:FORMAT (fp8|fp8_e5m2|mxfp8|mxfp4|nvfp4|"
        "ternary|binary), ternary:PATH (bf16_then_quantize|direct_codes|bf16_fixed_point)")


class SyncHooks:
    """Exports, measures and checks the served copy for the training program."""

    def __init__(self, cfg: SyncConfig, mcfg, learner_policy, sampler_policy, exporter=None):
        """`exporter`: an `Exporter` to use instead of `cfg.exporter`'s (a LoRA run's merged
        copy, `lora.export.merged_exporter`)."""
        self.cfg = cfg
        self.mcfg = mcfg
        self.lpol, self.spol = learner_policy, sampler_policy
        self.exporter = exporter if exporter is not None else make_exporter(cfg.exporter, cfg.seed)
        if self.exporter is not None:
            self._apply = jax.jit(self.exporter.apply)
            # One compiled program for the per-step diagnostics (op by op they cost
            # hundreds of small compiles on the first GRPO step).
            self._measure = jax.jit(lambda stale, prog, served, params: (
                staleness_update(stale, served), progress_update(prog, served, params),
                ulp_distance(params, served)))

    @property
    def active(self) -> bool:
        return self.exporter is not None

    def init_state(self, params) -> dict:
        """The checkpointed sync state: exporter state and diagnostics' state."""
        if not self.active:
            return {}
        # Copies: the diagnostics keep start points, and the learner step donates the master.
        # A LoRA forward tree is measured merged (`W + A B s`), as the served copy is made.
        params = jax.tree.map(jnp.copy, merge_adapters(params))
        served, _ = self.exporter.apply(params, self.exporter.init(params))
        served = jax.tree.map(jnp.copy, served)
        return {"exporter": self.exporter.init(params), "staleness": staleness_init(served),
                "progress": progress_init(served, params)}

    def start(self, state: dict, params) -> tuple[dict, Any]:
        """At the first GRPO step: optionally round the master to bf16, reset diagnostics."""
        if self.cfg.bf16_start:
            params = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
        if self.active:
            state = self.init_state(params)
        return state, params

    def export(self, state: dict, params) -> tuple[Any, Any, dict]:
        """Returns (served tree, f32 params the sampler runs on, new sync state)."""
        if not self.active:
            return params, params, state
        served, exp_state = self._apply(params, state["exporter"])
        # Kept tensors may alias the master's buffers, which the learner step donates.
        served = jax.tree.map(jnp.copy, served)
        return served, served_params_for_forward(served), dict(state, exporter=exp_state)

    def diagnostics(self, state: dict, params, served, ro, master_logp) -> tuple[dict, dict]:
        """Retention, staleness, ulp distance, served progress and lag, served-vs-master KL."""
        if not self.active:
            return state, {}
        params = merge_adapters(params)  # a LoRA master: its merged f32 weights
        (stale, m), (prog, progress), ulps = self._measure(
            state["staleness"], state["progress"], served, params)
        kl = kl_from_logprobs(ro.logprobs, master_logp, ro.completion_mask)
        metrics = {
            "update_retention": m["retention"], "staleness_mean": m["staleness_mean"],
            "staleness_max": m["staleness_max"], "ulp_distance_mean": ulps["mean"],
            "ulp_distance_max": ulps["max"], "served_progress": progress, "lag": prog.lag,
            "served_master_k1": kl["k1"], "served_master_k3": kl["k3"],
        }
        return dict(state, staleness=stale, progress=prog), metrics

    def check(self, step: int, params, served, probe_tokens) -> dict:
        """Runs the seven checks; raises `SyncCheckError` with the report on a failure."""
        params = merge_adapters(params)  # a LoRA master: its merged f32 weights
        report = run_sync_checks(
            served, hash_served(served),
            SamplerState(params=served, version=step, cache_version=step, policy=self.spol),
            expected_layout(self.exporter, params), step, master=params, cfg=self.mcfg,
            probe_tokens=probe_tokens, learner_policy=self.lpol,
            matched=self.lpol == self.spol)
        if not report.passed:
            raise SyncCheckError(f"sync checks failed at step {step}:\n{report}")
        return report.metrics()
