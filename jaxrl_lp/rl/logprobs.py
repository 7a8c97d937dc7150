"""The learner's log-probs of sampled tokens, three ways: dense, replay and hybrid.

- `dense`: one parallel teacher-forced forward over prompt + completion that
  applies the recorded looped schedule (deferred: token s presents its K/V at
  step min(d, e_s); every position reads out at its recorded exit step).
  Differentiable; differs from the sampler by kernel-shape rounding.
- `replay`: the sampler's own `prefill` and `decode_step` run over the
  recorded tokens and schedule (a `lax.scan` instead of the sampler's
  `while_loop`), so with the same weights and policy its values are the
  sampler's bit for bit.
- `hybrid`: `stop_gradient(replay) + (dense - stop_gradient(dense))`. The
  bracket is exactly 0.0 in value, so the value is replay's bits; its gradient
  is exactly the dense gradient.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.generate import Rollout
from jaxrl_lp.rollout.sampling import token_logprobs
from jaxrl_lp.rollout.step import LoopSpec, decode_step, prefill

__all__ = ["LogprobMethod", "dense_logprobs", "learner_logprobs", "prompt_positions",
           "replay_logprobs"]

LogprobMethod = Literal["dense", "replay", "hybrid"]


def prompt_positions(prompt_BxP: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Positions of left-padded prompts: -1 on padding, 0..n-1 on the n real tokens."""
    p = prompt_BxP.shape[1]
    pos = jnp.arange(p, dtype=jnp.int32)[None] - (p - lengths_B[:, None])
    return jnp.where(pos >= 0, pos, -1).astype(jnp.int32)


def _entropy(logits_xV: jax.Array, temperature: float) -> jax.Array:
    lp = jax.nn.log_softmax(logits_xV.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(lp) * lp, axis=-1)


def dense_logprobs(params: dict, cfg: ModelConfig, policy: Policy, loop: LoopSpec,
                   ro: Rollout, *, remat: bool = False):
    """Teacher-forced log-probs and entropies [B, N] from one parallel forward (differentiable)."""
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    tokens = jnp.concatenate([ro.prompt_tokens, ro.completion_tokens], axis=1)
    positions = jnp.concatenate(
        [prompt_positions(ro.prompt_tokens, ro.prompt_lengths),
         ro.prompt_lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]], axis=1)
    kwargs = {"remat": remat}
    if cfg.is_looped:
        full = jnp.full((b, p + n), cfg.loop_steps - 1, jnp.int32)
        # Position P-1+j reads out completion token j at its recorded exit step.
        readout = jax.lax.dynamic_update_slice(full, ro.exit_steps, (0, p - 1))
        # Compute depth: prompt tokens run at full depth; completion token j-1
        # (at position P+j-1) stopped where the step that produced token j did.
        depth = jax.lax.dynamic_update_slice(full, ro.exit_steps[:, 1:], (0, p))
        kwargs.update(compute_mode=loop.compute_mode, exit_steps_BxT=depth,
                      readout_steps_BxT=readout)
    logits, _, _ = forward(params, cfg, policy, tokens, positions, **kwargs)
    logits = logits[:, p - 1:p - 1 + n]
    t = ro.temperature
    return token_logprobs(logits, ro.completion_tokens, t), _entropy(logits, t)


def replay_logprobs(params: dict, cfg: ModelConfig, policy: Policy, loop: LoopSpec,
                    ro: Rollout) -> jax.Array:
    """The sampler's computation replayed over the recorded tokens and schedule: [B, N].

    Bit-equal to `ro.logprobs` on the completion mask when `params` and
    `policy` are the sampler's. Differentiable except in deferred mode (its
    early-stopping loop is a `while_loop`); use `hybrid` for gradients there.
    """
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    params = unstack_layers(params)  # as the sampler (`generate`) decodes
    cache = unstack_cache(init_cache(cfg, policy, b, p + n), cfg)
    positions = prompt_positions(ro.prompt_tokens, ro.prompt_lengths)
    logits, cache, _, _ = prefill(params, cfg, policy, loop, ro.prompt_tokens, positions, cache,
                                  readout_steps_B=ro.exit_steps[:, 0] if cfg.is_looped else None)
    lp0 = token_logprobs(logits, ro.completion_tokens[:, 0], ro.temperature)

    def body(cache, j):
        logits, cache, _, _ = decode_step(
            params, cfg, policy, loop, ro.completion_tokens[:, j - 1],
            ro.prompt_lengths + j - 1, cache, p + j - 1,
            exit_steps_B=ro.exit_steps[:, j] if cfg.is_looped else None,
            active_B=ro.completion_mask[:, j] > 0)  # as the sampler ran it
        return cache, token_logprobs(logits, ro.completion_tokens[:, j], ro.temperature)

    _, rest = jax.lax.scan(body, cache, jnp.arange(1, n, dtype=jnp.int32))
    return jnp.concatenate([lp0[:, None], rest.T], axis=1)


def learner_logprobs(params: dict, cfg: ModelConfig, policy: Policy, loop: LoopSpec,
                     ro: Rollout, method: LogprobMethod = "hybrid", *, remat: bool = False):
    """Log-probs [B, N] (and entropies [B, N], from the dense forward; zeros for replay).

    Args:
      method: `dense`, `replay` or `hybrid` (module docstring).
    """
    if method == "replay":
        return replay_logprobs(params, cfg, policy, loop, ro), jnp.zeros(ro.logprobs.shape)
    dense, entropy = dense_logprobs(params, cfg, policy, loop, ro, remat=remat)
    if method == "dense":
        return dense, entropy
    if method != "hybrid":
        raise ValueError(f"log-prob method must be 'dense', 'replay' or 'hybrid'; got {method!r}")
    # stop_gradient on the *input*: a JVP-traced replay compiles differently (1 ulp off the sampler).
    replay = jax.lax.stop_gradient(replay_logprobs(jax.lax.stop_gradient(params), cfg, policy, loop, ro))
    return replay + (dense - jax.lax.stop_gradient(dense)), entropy
