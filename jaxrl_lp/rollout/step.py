"""The two forward computations a rollout is made of: prefill and one decode step.

The sampler runs them inside its `while_loop`; the learner's `replay` log-probs
run the *same* functions over the recorded tokens and schedule, which is what
makes the two agree bit for bit. Do not re-derive them elsewhere.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics.policy import Policy

__all__ = ["LoopSpec", "decode_step", "prefill"]


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """How a looped model runs in the sampler (ignored for dense models).

    exit_rule: `full`, `fixed:K` or `threshold:T[:MIN_LOOPS]` (see `ExitRule`).
    compute_mode: `dense` (all loop steps, the rule picks the read-out) or
      `deferred` (a token stops at its exit step; steps end when all exited).
    """

    exit_rule: str = "full"
    compute_mode: str = "dense"

    def __post_init__(self):
        from jaxrl_lp.models.looped import ExitRule

        object.__setattr__(self, "exit_rule", str(ExitRule.parse(self.exit_rule)))
        if self.compute_mode not in ("dense", "deferred"):
            raise ValueError(
                f"LoopSpec.compute_mode must be 'dense' or 'deferred'; got {self.compute_mode!r}"
            )


def prefill(params, cfg: ModelConfig, policy: Policy, loop: LoopSpec, prompt_BxP, positions_BxP,
            cache, readout_steps_B=None):
    """Runs the (left-padded) prompts through the model at full depth, writing slots [0, P).

    Returns (logits [B, V] at the last slot, cache, exit step [B] of the last
    slot, loop evaluations). `readout_steps_B` replays a recorded read-out step.
    """
    kwargs = {}
    if cfg.is_looped:
        readout = None
        if readout_steps_B is not None:
            p = prompt_BxP.shape[1]
            readout = jnp.broadcast_to(readout_steps_B[:, None], (prompt_BxP.shape[0], p))
        kwargs = {"exit_rule": loop.exit_rule, "compute_mode": "dense",
                  "readout_steps_BxT": readout}
    logits, cache, out = forward(params, cfg, policy, prompt_BxP, positions_BxP, cache, 0,
                                 **kwargs)
    if out is None:
        return logits[:, -1], cache, jnp.zeros(prompt_BxP.shape[:1], jnp.int32), jnp.int32(1)
    exits = out.exit_steps[:, -1] if readout_steps_B is None else readout_steps_B
    return logits[:, -1], cache, exits, out.loop_evals


def decode_step(params, cfg: ModelConfig, policy: Policy, loop: LoopSpec, tokens_B, positions_B,
                cache, index, exit_steps_B=None, active_B=None):
    """One token per sequence at cache slot `index`.

    Returns (logits [B, V], cache, exit step [B], loop evaluations). With
    `exit_steps_B` the recorded schedule is replayed instead of the exit rule.
    `active_B` (bool) marks the sequences still generating: in deferred mode
    the others are not computed (their outputs are meaningless) and do not
    keep the loop over steps running.
    """
    kwargs = {}
    if cfg.is_looped:
        deferred = loop.compute_mode == "deferred"
        kwargs = {
            "exit_rule": loop.exit_rule,
            "compute_mode": loop.compute_mode,
            "early_stop": deferred,
            "exit_steps_BxT": None if exit_steps_B is None else exit_steps_B[:, None],
            "active_BxT": None if active_B is None else active_B[:, None],
        }
    logits, cache, out = forward(params, cfg, policy, tokens_B[:, None], positions_B[:, None],
                                 cache, index, **kwargs)
    if out is None:
        return logits[:, 0], cache, jnp.zeros(tokens_B.shape, jnp.int32), jnp.int32(1)
    return logits[:, 0], cache, out.exit_steps[:, 0], out.loop_evals
