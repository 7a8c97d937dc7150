"""The two forward computations a rollout is made of: prefill and one decode step.

The sampler runs them inside its `while_loop`; the learner's `replay` log-probs
run the *same* functions over the recorded tokens and schedule, which is what
makes the two agree bit for bit. Do not re-derive them elsewhere.

Neither is jitted itself: both are traced inside `generate`'s and the
learner's jitted programs, where `cfg`, `policy` and `loop` are static.

The sampled tokens' log-probs come from a step's output by `step_logprobs`,
which the sampler and the replay both call. Where the policy lets the fused
log-prob kernel run (`kernels.logprob.fused_readout`: kernels not off, no
matmul format) the steps are run with `hidden=True` and return the final
hidden state: the sampler takes its logits from it (`step_logits`) to choose
a token, and both take the log-prob by `kernels.readout_logprobs`: the fused
kernel of the platform the program is lowered for, or, where none runs (CPU),
`token_logprobs` of those same logits. Elsewhere the steps return logits and
the log-prob is `token_logprobs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.kernels.logprob import fused_readout, readout_logprobs
from jaxrl_lp.models.blocks import lm_head, lm_logits
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.loop import ExitSchedule, LoopSpec
from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.sampling import token_logprobs

__all__ = ["LoopSpec", "decode_step", "fused_readout", "prefill", "step_logits", "step_logprobs"]


def step_logits(params, cfg: ModelConfig, policy: Policy, out_BxX) -> jax.Array:
    """The logits [B, V] of a step's output (the lm head applied when it is the hidden state)."""
    return lm_logits(params, out_BxX, cfg, policy) if fused_readout(policy) else out_BxX


def step_logprobs(params, cfg: ModelConfig, policy: Policy, out_BxX, tokens_B,
                  temperature: float, logits_BxV: jax.Array | None = None) -> jax.Array:
    """Log-probs [B] f32 of `tokens_B` from a step's output (the sampler's and the replay's).

    `out_BxX` is what `prefill` / `decode_step` returned with
    `hidden=fused_readout(policy)`: from the hidden state, the fused kernel's
    log-prob where one runs, else `token_logprobs` of `logits_BxV` (the
    step's `step_logits`, computed here when not given: the sampler passes
    the ones it sampled from); from logits, `token_logprobs` of them.
    """
    if not fused_readout(policy):
        return token_logprobs(out_BxX, tokens_B, temperature)
    if logits_BxV is None:
        logits_BxV = step_logits(params, cfg, policy, out_BxX)
    return readout_logprobs(out_BxX, lm_head(params, cfg), tokens_B, temperature, policy,
                            plain=lambda: token_logprobs(logits_BxV, tokens_B, temperature),
                            entropy=False)


def prefill(params, cfg: ModelConfig, policy: Policy, loop: LoopSpec, prompt_BxP, positions_BxP,
            cache, readout_steps_B=None, *, hidden: bool = False):
    """Runs the (left-padded) prompts through the model at full depth, writing slots [0, P).

    Returns (logits [B, V] at the last slot, cache, exit step [B] of the last
    slot, loop evaluations). `readout_steps_B` replays a recorded read-out step.
    With `hidden` the first output is the final hidden state [B, D] instead.
    """
    if not cfg.is_looped:
        logits, cache, _ = forward(params, cfg, policy, prompt_BxP, positions_BxP, cache, 0,
                                   hidden=hidden)
        return logits[:, -1], cache, jnp.zeros(prompt_BxP.shape[:1], jnp.int32), jnp.int32(1)
    schedule = None
    if readout_steps_B is not None:
        schedule = ExitSchedule(readout_BxT=jnp.broadcast_to(readout_steps_B[:, None],
                                                             prompt_BxP.shape))
    # A prompt runs at full depth in either compute mode; the rule picks its read-out.
    logits, cache, out = forward(params, cfg, policy, prompt_BxP, positions_BxP, cache, 0,
                                 loop=LoopSpec(loop.exit_rule, "dense"), schedule=schedule,
                                 hidden=hidden)
    exits = out.exit_steps[:, -1] if readout_steps_B is None else readout_steps_B
    return logits[:, -1], cache, exits, out.loop_evals


def decode_step(params, cfg: ModelConfig, policy: Policy, loop: LoopSpec, tokens_B, positions_B,
                cache, index, exit_steps_B=None, active_B=None, *, hidden: bool = False):
    """One token per sequence at cache slot `index`.

    Returns (logits [B, V] or, with `hidden`, the final hidden state [B, D],
    cache, exit step [B], loop evaluations). With
    `exit_steps_B` the recorded schedule is replayed instead of the exit rule.
    `active_B` (bool) marks the sequences still generating: in deferred mode
    the others are not computed (their outputs are meaningless) and do not
    keep the loop over steps running.
    """
    if not cfg.is_looped:
        logits, cache, _ = forward(params, cfg, policy, tokens_B[:, None], positions_B[:, None],
                                   cache, index, hidden=hidden)
        return logits[:, 0], cache, jnp.zeros(tokens_B.shape, jnp.int32), jnp.int32(1)
    schedule = ExitSchedule(
        depth_BxT=None if exit_steps_B is None else exit_steps_B[:, None],
        active_BxT=None if active_B is None else active_B[:, None])
    logits, cache, out = forward(params, cfg, policy, tokens_B[:, None], positions_B[:, None],
                                 cache, index, loop=loop, schedule=schedule,
                                 early_stop=loop.compute_mode == "deferred", hidden=hidden)
    return logits[:, 0], cache, out.exit_steps[:, 0], out.loop_evals
