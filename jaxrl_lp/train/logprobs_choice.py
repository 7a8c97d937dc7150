"""`grpo.logprobs=auto`: the exact learner log-probs that cost a run less, chosen once.

Both exact methods give the learner the sampler's bits. `hybrid` samples with
the plain decode and replays it for every update that cannot take the
rollout's recorded log-probs (a later minibatch or epoch, the KL reference's
log-probs, a verification step); `invariant` samples in the batch-invariant
forms, which cost the decode more, and never replays: each of those values is
one parallel forward (docs/design/invariant.md).

`choose_logprobs` takes `invariant` where its forms hold for the run and the
hybrid would replay the decode more often an iteration (`replays_per_iteration`)
than the invariant sampler's extra cost is worth in replays
(`invariant_threshold`); `hybrid` otherwise, with the reason. That cost grows
with the padding of the decode's rows to the CPU's column tile
(`numerics.invariant.column_tile`). The races behind the threshold, by CPU,
are in docs/design/invariant.md (`jaxrl-lp bench iteration` at 1, 2 and 4
minibatches). A run resolves `auto` before anything is built
(`train.program.run_train`), says which method it took in one line, and
records the resolved method in its `config.json`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jaxrl_lp.numerics.invariant import column_tile, unsupported
from jaxrl_lp.train.behaviour import iteration_counts

__all__ = ["LogprobsChoice", "choose_logprobs", "invariant_threshold", "replays_per_iteration",
           "with_logprobs"]

# `invariant_threshold`'s terms: a replay costs about one decode; the invariant sampler costs
# a decode and part of one more, growing with the padded rows' share (fitted to the races in
# docs/design/invariant.md: 8 rows on a 16-column tile give 1.0 replay, on a 64-column
# tile 2.5).
BASE_REPLAYS, PADDED_SHARE_REPLAYS = 0.5, 0.25


class LogprobsChoice(NamedTuple):
    """The learner log-prob method a run uses, and why `auto` took it."""

    method: str  # `dense`, `hybrid` or `invariant`
    why: str     # for `auto`: why this method (empty when the config named it)


def replays_per_iteration(cfg) -> float:
    """How many times, on average, one iteration of `cfg` with `grpo.logprobs=hybrid` replays
    the decode: its replaying updates (`train.behaviour.iteration_counts`), the KL reference's
    log-probs (one replay under the reference's weights a step) and the verification
    steps' replay (one every `grpo.verify_every` steps)."""
    counts = iteration_counts(with_logprobs(cfg, LogprobsChoice("hybrid", "")))
    return counts["replaying"] + counts["behaviour"] + (1.0 if cfg.loss.kl_beta > 0 else 0.0)


def invariant_threshold(cfg, tile: int | None = None) -> float:
    """The hybrid's replays per iteration from which `invariant` costs a run of `cfg` less:
    `BASE_REPLAYS` plus `PADDED_SHARE_REPLAYS` per padded decode row per row, the sampler's
    `prompts_per_step x group_size` rows padded to `tile` (default: this CPU's column tile)."""
    rows = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    tile = tile or column_tile() or 1
    padded = -(-rows // tile) * tile
    return BASE_REPLAYS + PADDED_SHARE_REPLAYS * padded / rows


def _invariant_blocked(cfg, *, multiturn: bool, weights: Any, mesh: Any,
                       platform: str | None) -> str | None:
    """Why the invariant forms do not serve this run, or None (the settings they are
    proven for: one process on XLA:CPU, one device, plain weights, matched policies of
    plain float products, synchronous single-turn sampling with the plain sampler)."""
    g = cfg.grpo
    lpol, spol = g.policies
    if (why := unsupported(platform or jax.default_backend(), mesh)) is not None:
        return why
    if cfg.run.learner_mesh or cfg.distributed.num_processes > 1:
        return "the sampler runs on devices or processes of its own"
    if weights is not None or cfg.lora.rank > 0:
        return "a weight representation (LoRA, low-bit codes) has no invariant form"
    if multiturn:
        return "multi-turn episodes replay each call by their own programs"
    if g.speculative:
        return "speculative decoding verifies chunks the invariant forward does not reproduce"
    if g.reuse_products:
        return "grpo.reuse_products hands the sampler's products to the hybrid's updates"
    if g.max_staleness:
        return "off-policy steps (grpo.max_staleness) take the replay"
    if lpol != spol:
        return "the learner and the sampler compute under other policies"
    if lpol.matmul_format is not None:
        return f"the policy's {lpol.matmul_format} products have no invariant form"
    return None


def choose_logprobs(cfg, *, multiturn: bool = False, weights: Any = None, mesh: Any = None,
                    platform: str | None = None) -> LogprobsChoice:
    """The learner log-prob method a run of `cfg` uses: `grpo.logprobs` where it names one,
    else (`auto`) `invariant` or `hybrid` by the rule of this module.

    Args:
      cfg: the run's `TrainConfig`.
      multiturn: the task's episodes are multi-turn (`tasks.is_multiturn`).
      weights: the GRPO phase's weight representation (`RunPlan.weights`, LoRA's), or None.
      mesh: the learner's mesh, or None (one device).
      platform: the backend (default: JAX's).
    """
    if cfg.grpo.logprobs != "auto":
        return LogprobsChoice(cfg.grpo.logprobs, "")
    blocked = _invariant_blocked(cfg, multiturn=multiturn, weights=weights, mesh=mesh,
                                 platform=platform)
    if blocked is not None:
        return LogprobsChoice("hybrid", blocked)
    replays, threshold = replays_per_iteration(cfg), invariant_threshold(cfg)
    if replays < threshold:
        return LogprobsChoice("hybrid", f"the hybrid replays the decode {replays:.2g} times an "
                              f"iteration, fewer than the {threshold:.2g} the invariant "
                              "sampler's extra cost is worth here")
    return LogprobsChoice("invariant", f"the hybrid would replay the decode {replays:.2g} times "
                          f"an iteration, at least the {threshold:.2g} the invariant sampler's "
                          "extra cost is worth here; the invariant forward replaces each replay")


def with_logprobs(cfg, choice: LogprobsChoice):
    """`cfg` with `grpo.logprobs` the chosen method (as it is where the config named one)."""
    import dataclasses

    return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, logprobs=choice.method))
