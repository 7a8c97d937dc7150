"""The iteration bench's update inputs on a preset.

Imported by `profile_update.py` (run as a script, so this folder is on `sys.path`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class UpdateInputs(NamedTuple):
    cfg: object  # models.config.ModelConfig
    policy: object  # numerics.policy.Policy
    params: dict
    rollout: object  # rollout.Rollout
    advantages: jax.Array
    optimizer: optax.GradientTransformation


def update_inputs(size: str, *, full: bool = True, policy: str = "fp32", batch: int = 8,
                  prompt_len: int = 16, seq_len: int = 128) -> UpdateInputs:
    """`bench.learner.grpo_batch`'s batch for `size` (`tiny`, `small` or a preset name;
    by default B = 8 as 2 prompts x G = 4, 16 + 112 tokens, f32, random weights from key 0)
    with the bench's optimizer (clip_by_global_norm(1.0) + adam(1e-6)). `full`: every
    completion runs to the end, as the iteration bench's no-EOS rollouts do."""
    from jaxrl_lp.bench.learner import SIZES, grpo_batch
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics.policy import Policy

    cfg, policy = get_preset(SIZES.get(size, size)), Policy.parse(policy)
    params = init_params(cfg, jax.random.PRNGKey(0))
    ro, adv = grpo_batch(cfg, policy, params, batch=batch, prompt_len=prompt_len,
                         seq_len=seq_len, group=4, seed=0)
    if full:
        ro = dataclasses.replace(ro, completion_mask=jnp.ones_like(ro.completion_mask))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-6))
    return UpdateInputs(cfg, policy, params, ro, adv, opt)


def alternate_updates(steps: dict, states: dict, batch: tuple, rounds: int,
                      patch: Callable[[str], AbstractContextManager]) -> dict[str, list[float]]:
    """Seconds of each named update step in `rounds` alternating calls, after two warm-ups.

    `steps[name](params, opt_state, *batch)` updates `states[name] = [params, opt_state]`
    in place; each call runs inside `patch(name)` (what the step reads when it is traced).
    """
    def call(name):
        s = states[name]
        with patch(name):
            t = time.perf_counter()
            s[0], s[1], m = steps[name](s[0], s[1], *batch)
            jax.block_until_ready(m["loss"])
            return time.perf_counter() - t

    for name in steps:
        call(name)
        call(name)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name in steps:
            times[name].append(call(name))
    return times
