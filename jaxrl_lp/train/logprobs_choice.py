"""`grpo.logprobs=auto`: the exact learner log-probs that cost a run less, chosen once.

Both exact methods give the learner the sampler's bits. `hybrid` samples with
the plain decode and replays it for every update that cannot take the
rollout's recorded log-probs (a later minibatch or epoch, the KL reference's
log-probs, a verification step); `invariant` samples in the batch-invariant
forms and never replays: each of those values is one parallel forward
(docs/design/invariant.md).

`choose_logprobs` takes `invariant` where its forms serve the run and the
hybrid would replay the decode at least `INVARIANT_REPLAYS` times an
iteration (`replays_per_iteration`): each replay is then one invariant
forward. Below it the two cost about the same (the first update reads the
recorded log-probs under both, and the invariant sampler costs a little
more), and the run keeps `hybrid`, the plain sampler; `hybrid` also wherever
the forms do not serve the run, with the reason. The races behind the rule
are in docs/design/invariant.md (`jaxrl-lp bench iteration` at 1, 2 and 4
minibatches). A run
resolves `auto` before anything is built (`train.program.run_train`), says
which method it took in one line, and records the resolved method in its
`config.json`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jaxrl_lp.kernels.fake_quant import INVARIANT_FORMATS
from jaxrl_lp.numerics.invariant import unsupported
from jaxrl_lp.train.behaviour import iteration_counts

__all__ = ["INVARIANT_REPLAYS", "LogprobsChoice", "choose_logprobs", "replays_per_iteration",
           "with_logprobs"]


# The hybrid's replays an iteration from which `auto` takes `invariant`: between the 0.1 of
# one minibatch (a verification every 10th step), where the hybrid won its race, and the 1.1
# of two, where the invariant won (docs/design/invariant.md).
INVARIANT_REPLAYS = 0.5


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


def _invariant_blocked(cfg, *, multiturn: bool, weights: Any, mesh: Any,
                       platform: str | None) -> str | None:
    """Why the invariant forms do not serve this run, or None (the settings they are
    proven for: one process on XLA:CPU, one device, plain weights or unmerged LoRA, matched
    policies of plain float products or products in a format of
    `kernels.fake_quant.INVARIANT_FORMATS`, synchronous single-turn sampling with the plain
    sampler)."""
    g = cfg.grpo
    lpol, spol = g.policies
    if (why := unsupported(platform or jax.default_backend(), mesh)) is not None:
        return why
    if cfg.run.learner_mesh or cfg.distributed.num_processes > 1:
        return "the sampler runs on devices or processes of its own"
    if cfg.lora.rank > 0 and cfg.lora.serve != "unmerged":
        return "a merged LoRA sampler decodes a copy the learner's forward does not compute"
    if weights is not None and not getattr(weights, "invariant_forms", False):
        return "a weight representation (low-bit codes) has no invariant form"
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
    if lpol.matmul_format is not None and lpol.matmul_format not in INVARIANT_FORMATS:
        return (f"the policy's {lpol.matmul_format} products have no invariant form (its scale "
                "is a mean, summed in each program's order)")
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
    replays = replays_per_iteration(cfg)
    if replays < INVARIANT_REPLAYS:
        return LogprobsChoice("hybrid", f"the hybrid replays the decode {replays:.2g} times an "
                              f"iteration, fewer than {INVARIANT_REPLAYS}: its recorded "
                              "log-probs serve the updates")
    return LogprobsChoice("invariant", f"the hybrid would replay the decode {replays:.2g} times "
                          "an iteration; the invariant forward replaces each replay")


def with_logprobs(cfg, choice: LogprobsChoice):
    """`cfg` with `grpo.logprobs` the chosen method (as it is where the config named one)."""
    import dataclasses

    return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, logprobs=choice.method))
