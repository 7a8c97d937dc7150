"""Which log-probs the learner computes, and which it takes from the sampler (`grpo.replay`).

The hybrid learner's value is the replay of the sampler's computation: with
the sampler's weights and policy it is the sampler's recorded log-probs, bit
for bit (`rl.logprobs`). Where an update computes with exactly the weights
the sampler ran, under the sampler's policy, the replay would recompute
numbers the rollout already holds. `ReplayRule` decides that on the host, per
update: the rollout's `weights_digest` (a fingerprint of the weights the
sampler held, `numerics.fingerprint`) against the fingerprint of the weights
the update computes with, and the policies matched. Where it holds, the
behaviour log-probs and the hybrid's value are the rollout's own (the
gradient is the dense one, as always); elsewhere (a later minibatch, `mu`
> 1, a served copy the loss does not use, unmatched policies) the replay runs.

Nothing here is taken on trust: every `grpo.verify_every` GRPO steps the
training program replays the batch anyway and `check_replay_equal` compares
the bits, raising `ReplayMismatchError` where they differ.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import numpy as np

from jaxrl_lp.numerics.fingerprint import fingerprint_equal, tree_fingerprint
from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rollout.generate import Rollout

__all__ = ["PhaseTimer", "ReplayMismatchError", "ReplayRule", "bit_mismatch",
           "check_replay_equal", "iteration_counts"]


class ReplayMismatchError(RuntimeError):
    """A verification replay of a training batch differed from the sampler's recorded bits."""


@dataclasses.dataclass(frozen=True)
class ReplayRule:
    """When the rollout's recorded log-probs are the learner's replay values.

    Attributes:
      replay: `auto` (take the recorded values where they are the replay's) or
        `always` (replay every update, as before `grpo.replay` existed).
      method: the learner's `grpo.logprobs`; `hybrid` has a replay value, and
        `invariant` log-probs are the replay's bits by their forms: both take the
        recorded values where they are the replay's, and the behaviour log-probs
        may be the rollout's.
      matched: the learner's policy is the sampler's.
    """

    replay: str
    method: str
    matched: bool

    @property
    def can_reuse(self) -> bool:
        return self.replay == "auto" and self.method in ("hybrid", "invariant") and self.matched

    def recorded(self, ro: Rollout, weights) -> bool:
        """Whether `ro.logprobs` are the replay's values under `weights` (a host decision).

        `weights` are the model's params the update's forward computes with
        (the served copy under `sync.loss_on_served`, else the master). False
        where the rollout records no digest.
        """
        if not self.can_reuse or ro.weights_digest is None:
            return False
        return fingerprint_equal(tree_fingerprint(weights), ro.weights_digest)


def bit_mismatch(got, want, mask) -> tuple[int, int, float]:
    """(tokens under `mask` whose f32 values differ in any bit, tokens under `mask`, the
    largest |got - want| there) of two [B, N] log-prob arrays, compared on the host."""
    # `to_host`: across processes the arrays span devices no one process holds.
    mask = np.asarray(to_host(mask)) > 0
    got = np.asarray(to_host(got), np.float32)
    want = np.asarray(to_host(want), np.float32)
    differ = mask & (got.view(np.uint32) != want.view(np.uint32))
    worst = float(np.max(np.abs(np.where(differ, got - want, 0.0)), initial=0.0))
    return int(differ.sum()), int(mask.sum()), worst


def check_replay_equal(replayed, ro: Rollout, step: int, method: str = "hybrid") -> None:
    """Raises `ReplayMismatchError` unless `replayed` equals `ro.logprobs` bit for bit on the
    mask (`method`: the learner's, `invariant` naming its parallel forward in the message)."""
    differ, tokens, worst = bit_mismatch(replayed, ro.logprobs, ro.completion_mask)
    if differ and method == "invariant":
        raise ReplayMismatchError(
            f"grpo.verify_every: at step {step} the learner's invariant forward of the training "
            f"batch under the weights the sampler ran differs from the sampler's recorded "
            f"log-probs on {differ} of {tokens} tokens (max |dlogp| {worst:.3g}): the invariant "
            "forms do not hold for this configuration; run with grpo.logprobs=hybrid (the "
            "updates replay the decode) and report the configuration")
    if differ:
        raise ReplayMismatchError(
            f"grpo.verify_every: at step {step} the learner's replay of the training batch under "
            f"the weights the sampler ran differs from the sampler's recorded log-probs on "
            f"{differ} of {tokens} tokens (max |dlogp| {worst:.3g}). Replay "
            "== sampler does not hold for this configuration, so the recorded log-probs are not "
            "the learner's values; run with grpo.replay=always (every update replays, and the "
            "mismatch metrics measure the difference) and report the configuration")


class PhaseTimer:
    """Wall-clock seconds per phase of a GRPO iteration (`timing_s/<phase>` metrics).

    `with timer("sample"): ...` adds the block's seconds to its phase; call
    `jax.block_until_ready` on the phase's outputs inside the block, or the
    asynchronous dispatch moves its time into the next phase.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out["timing_s/iteration"] = sum(self.seconds.values())
        return out


def iteration_counts(cfg, stale: bool = False) -> dict:
    """Which learner programs one GRPO iteration of `cfg` runs, and how often (host rules).

    As `train.grpo_iteration` decides per update (`ReplayRule`):
    with hybrid log-probs, `grpo.replay=auto` and matched policies, an update
    on the weights the sampler ran takes the rollout's log-probs as its value
    (`recorded`): the first update of the step (the learner on the master with
    no exporter), or every update under `sync.loss_on_served` (the served copy
    the loss reads does not move within a step); a master the sampler did not
    run (an exporter without `loss_on_served`) is never the rollout's. The
    others replay (`replaying`: the later minibatches and epochs). A dense
    learner has no replay (`dense`), nor has an invariant one, whose updates
    take the recorded values as a hybrid's do and run the invariant forward
    where a hybrid's replay (`dense`). Behaviour log-probs (`behaviour`, per
    iteration) are computed where the first update is not recorded, on the
    `grpo.verify_every` steps' verification otherwise (a share of one), and
    for the sync diagnostics' master log-probs under `loss_on_served`.

    With `stale` (a rollout sampled on an earlier export, `grpo.max_staleness`),
    no update is on the weights the sampler ran: the behaviour log-probs run
    every step (plus, on the verification steps, the replay at the rollout's
    own weights, and with an exporter the served copy's log-probs), and under
    `grpo.replay=auto` they are the first update's value (every update's under
    `loss_on_served`): priced as `recorded`, the rest replay.

    Returns:
      `{"recorded", "replaying", "dense", "behaviour"}` (counts per iteration).
    """
    g = cfg.grpo
    if g.logprobs not in ("dense", "hybrid", "invariant"):
        raise ValueError(f"iteration_counts: grpo.logprobs={g.logprobs!r} is not a method; "
                         "resolve `auto` first (train.logprobs_choice.choose_logprobs)")
    updates = g.mu * g.minibatches
    rule = ReplayRule(g.replay, g.logprobs, matched=g.policies.matched)
    exporter = cfg.sync.exporter != "none"
    on_served = exporter and cfg.sync.loss_on_served
    verify = 1.0 / g.verify_every if g.verify_every else 0.0
    if g.logprobs == "dense":
        counts = {"recorded": 0, "replaying": 0, "dense": updates}
    elif stale:
        given = g.replay == "auto"  # the behaviour replay handed to the step as its value
        counts = ({"recorded": updates, "replaying": 0, "dense": 0} if given and on_served else
                  {"recorded": int(given), "replaying": updates - int(given), "dense": 0})
    elif not rule.can_reuse or (exporter and not on_served):
        counts = {"recorded": 0, "replaying": updates, "dense": 0}
    elif on_served:
        counts = {"recorded": updates, "replaying": 0, "dense": 0}
    else:
        counts = {"recorded": 1, "replaying": updates - 1, "dense": 0}
    if g.logprobs == "invariant":  # its forward stands where the hybrid replays
        counts = {**counts, "replaying": 0, "dense": counts["replaying"]}
    if stale:
        counts["behaviour"] = 1.0 + verify + (1.0 if exporter else 0.0)
        return counts
    counts["behaviour"] = (verify if counts["recorded"] > 0 else 1.0) + (1.0 if on_served else 0.0)
    return counts
