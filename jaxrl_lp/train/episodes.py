"""Multi-turn episodes in the training program: environments stepped by the sampler, measured.

A multi-turn task (`envs.CalculatorTask`, `envs.PythonCalculatorTask`) makes one
environment per episode (`task.make_env()`, reset from a record); `sample_episodes`
runs them through `rollout.generate_multiturn`, the environments stepped on host
threads by an `envs.EnvRunner` (a per-call timeout; an environment that raises or
hangs ends its episode with the runner's reason and `failure_reward`, and the run goes
on). `episode_metrics` measures what happened; `evaluate_episodes` is the held-out
score (greedy episodes); `replay_episodes` replays episodes gathered from several calls
(dynamic sampling's rounds) and `turn_credit_advantages` gives their tokens advantages by
turn (`grpo.turn_credit=reward_to_go`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.envs import EnvRunner, Turn
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.advantages import turn_advantages
from jaxrl_lp.rollout.multiturn import (
    MultiTurnRollout,
    TurnLimits,
    TurnOutcome,
    generate_multiturn,
    replay_multiturn,
)
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec

__all__ = ["episode_metrics", "evaluate_episodes", "is_multiturn", "replay_episodes",
           "sample_episodes", "turn_credit_advantages", "turn_limits", "turn_step"]


def is_multiturn(task: Any) -> bool:
    """Whether `task` runs episodes of several turns (it makes environments)."""
    return hasattr(task, "make_env")


def turn_limits(task: Any) -> TurnLimits:
    """The sampler's `TurnLimits` of a multi-turn task."""
    tok = task.tokenizer
    return TurnLimits(max_turns=task.max_turns, max_turn_tokens=task.max_turn_tokens,
                      max_observation_tokens=task.max_observation_tokens,
                      stop_token_ids=tuple(task.stop_token_ids), eos_id=tok.eos_id,
                      pad_id=tok.pad_id)


def turn_step(envs: Sequence[Any], runner: EnvRunner, tokenizer: Any):
    """The `step` callback of `generate_multiturn` over `envs` (one per row): turns decoded
    to text, stepped by `runner`, observations encoded with `tokenizer`."""
    def step(rows, turns, ended_by):
        # A `Turn` holds its stop token, not the EOS that ended it.
        turns = [t[:-1] if e == "eos" else t for t, e in zip(turns, ended_by, strict=True)]
        asked = [Turn(tokens=tuple(t), text=tokenizer.decode(list(t)), ended_by=e)
                 for t, e in zip(turns, ended_by, strict=True)]
        results = runner.step([envs[r] for r in rows], asked)
        return [TurnOutcome(
            observation=() if res.done or not res.observation
            else tuple(tokenizer.encode(res.observation)),
            reward=float(res.reward), done=bool(res.done), info=dict(res.info))
            for res in results]
    return step


def sample_episodes(params, mcfg, task, records: Sequence[Any], *, group_size: int,
                    policy: Policy, sampling: SamplingConfig, loop: LoopSpec, key: jax.Array,
                    runner: EnvRunner, weights_version: int = 0) -> MultiTurnRollout:
    """`group_size` episodes of each record (rows grouped as `generate`'s samples are)."""
    rows = [rec for rec in records for _ in range(group_size)]
    envs = [task.make_env() for _ in rows]
    prompts = [env.reset(rec) for env, rec in zip(envs, rows, strict=True)]
    return generate_multiturn(params, mcfg, prompts, turn_step(envs, runner, task.tokenizer),
                              turn_limits(task), policy=policy, sampling=sampling, loop=loop,
                              key=key, weights_version=weights_version)


def replay_episodes(params, mcfg, policy: Policy,
                    parts: Sequence[tuple[MultiTurnRollout, np.ndarray | None]]) -> jax.Array:
    """The log-probs [B, N] of episodes gathered from several calls (dynamic sampling's
    rounds, in `concat_rollouts`' order): each call `(mt, rows)` replayed whole by its own
    programs (`rollout.multiturn.replay_multiturn`), its `rows` taken (None: all), right-
    padded with 0 to the widest call's slots and concatenated."""
    outs = [replay_multiturn(params, mcfg, policy, mt) for mt, _ in parts]
    outs = [o if rows is None else o[jnp.asarray(rows)]
            for o, (_, rows) in zip(outs, parts, strict=True)]
    if len(outs) == 1:
        return outs[0]
    n = max(o.shape[1] for o in outs)
    return jnp.concatenate([jnp.pad(o, ((0, 0), (0, n - o.shape[1]))) for o in outs])


def turn_credit_advantages(parts: Sequence[tuple[MultiTurnRollout, np.ndarray | None]],
                           group_size: int, kind: str, discount: float,
                           width: int) -> np.ndarray:
    """Per-token advantages [B, width] f32 of episodes gathered from calls, by turn
    (`grpo.turn_credit=reward_to_go`): each call's per-turn advantages
    (`rl.advantages.turn_advantages`, its groups' rows within the call) on its turns'
    tokens (0 on observations and padding), its `rows` taken (None: all; whole groups),
    right-padded to `width` slots and concatenated in `replay_episodes`' order."""
    outs = []
    for mt, rows in parts:
        adv_BxT = np.asarray(turn_advantages(mt.turn_rewards, mt.turns, group_size, kind,
                                             discount))
        turns_BxN = mt.token_turns()
        adv_BxN = np.where(turns_BxN >= 0,
                           np.take_along_axis(adv_BxT, np.maximum(turns_BxN, 0), axis=1), 0.0)
        adv_BxN = adv_BxN if rows is None else adv_BxN[np.asarray(rows)]
        outs.append(np.pad(adv_BxN, ((0, 0), (0, width - adv_BxN.shape[1]))))
    return np.concatenate(outs).astype(np.float32)


def episode_metrics(*mts: MultiTurnRollout) -> dict[str, float]:
    """Per-episode means of what the episodes of one or several calls did (`metrics.jsonl`
    keys; `prefill_tokens`, `decode_steps` and `timing_s/env` summed over the calls).

    `turns_per_episode`; `tool_calls` per episode, `tool_success` (the share of
    calls the tool answered), `tool_use` (the share of episodes that called a tool) and
    `tool_solved` (the share of those that were solved: reward at least 1);
    `env_failed` (episodes a failing environment ended: raised or timed out) and
    `episode_overflow` (an observation over the limit);
    `policy_tokens` and `env_tokens` per episode (tokens by origin); `prefill_tokens`
    and `decode_steps` of the calls; `timing_s/env` (seconds in the environments).
    """
    rows = [row for mt in mts for row in mt.infos]
    reasons = [r for mt in mts for r in mt.reasons]
    rewards = np.concatenate([mt.rewards for mt in mts])
    infos = [i for row in rows for i in row if isinstance(i, dict)]
    calls = sum(1 for i in infos if i.get("tool_call"))
    ok = sum(1 for i in infos if i.get("tool_call") and i.get("tool_ok"))
    b = len(reasons)
    used = np.array([any(isinstance(i, dict) and i.get("tool_call") for i in row)
                     for row in rows], bool)
    tokens = lambda f: sum(np.asarray(getattr(mt.rollout, f)).sum() for mt in mts)
    return {
        "turns_per_episode": float(np.mean(np.concatenate([mt.turns for mt in mts]))),
        "tool_calls": calls / b,
        "tool_success": ok / calls if calls else 0.0,
        "tool_use": float(used.mean()),
        "tool_solved": float((rewards[used] >= 1.0).mean()) if used.any() else 0.0,
        "env_failed": float(sum(r.startswith(("error", "timeout")) for r in reasons)),
        "episode_overflow": float(sum(r == "observation_overflow" for r in reasons)),
        "policy_tokens": float(tokens("completion_mask") / b),
        "env_tokens": float(tokens("env_mask") / b),
        "prefill_tokens": float(sum(mt.prefill_tokens for mt in mts)),
        "decode_steps": float(sum(mt.decode_steps for mt in mts)),
        "timing_s/env": float(sum(mt.env_seconds for mt in mts)),
    }


def evaluate_episodes(params, mcfg, task, policy: Policy, loop: LoopSpec, size: int,
                      runner: EnvRunner | None = None) -> dict[str, float]:
    """Greedy episodes on the first `size` held-out records: `accuracy` (episodes whose
    reward is at least 1: solved) and the `episode_metrics`."""
    records = [task.heldout[i] for i in range(min(size, len(task.heldout)))]
    own = runner is None
    runner = runner or EnvRunner()
    try:
        mt = sample_episodes(params, mcfg, task, records, group_size=1, policy=policy,
                             sampling=SamplingConfig(greedy=True), loop=loop,
                             key=jax.random.PRNGKey(0), runner=runner)
    finally:
        if own:
            runner.close()
    return {"accuracy": float(np.mean(mt.rewards >= 1.0)), **episode_metrics(mt)}
