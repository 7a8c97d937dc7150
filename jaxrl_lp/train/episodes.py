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

from jaxrl_lp.envs import EnvRunner, StepResult, Turn
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
from jaxrl_lp.tasks.protocol import ObservationEncoder, is_multiturn

__all__ = ["episode_metrics", "evaluate_episodes", "is_multiturn", "replay_episodes",
           "sample_episodes", "turn_credit_advantages", "turn_limits", "turn_step"]


def turn_limits(task: Any) -> TurnLimits:
    """The sampler's `TurnLimits` of a multi-turn task."""
    tok = task.tokenizer
    return TurnLimits(max_turns=task.max_turns, max_turn_tokens=task.max_turn_tokens,
                      max_observation_tokens=task.max_observation_tokens,
                      stop_token_ids=tuple(task.stop_token_ids), eos_id=tok.eos_id,
                      pad_id=tok.pad_id)


def _observation(task: Any, result: StepResult, ended_by: str,
                 runner: EnvRunner) -> tuple[tuple[int, ...], StepResult]:
    """The observation's tokens of `result` (rendered by the task where it is an
    `ObservationEncoder`, else its text encoded), and the result; an observation that
    cannot be encoded (a character the tokenizer lacks, messages without a template) ends
    the episode as a failed environment call, as the runner records one."""
    if result.done or not (result.observation or result.messages):
        return (), result
    try:
        if isinstance(task, ObservationEncoder):
            ids = task.observation_ids(result, ended_by)
        elif result.messages:
            raise ValueError(f"{type(task).__name__} renders no chat messages (it has no "
                             "observation_ids); answer with observation text")
        else:
            ids = task.tokenizer.encode(result.observation)
        return tuple(int(i) for i in ids), result
    except Exception as e:  # noqa: BLE001 - a user's observation fails its episode, not the run
        runner.failures["error"] += 1
        why = f"error: observation: {type(e).__name__}: {e}"[:300]
        return (), StepResult(reward=runner.failure_reward, done=True,
                              info={**result.info, "failed": why})


def turn_step(envs: Sequence[Any], runner: EnvRunner, task: Any):
    """The `step` callback of `generate_multiturn` over `envs` (one per row): turns decoded
    to text with the task's tokenizer, stepped by `runner`, observations made tokens
    (`_observation`)."""
    tokenizer = task.tokenizer

    def step(rows, turns, ended_by):
        # A `Turn` holds its stop token, not the EOS that ended it.
        turns = [t[:-1] if e == "eos" else t for t, e in zip(turns, ended_by, strict=True)]
        asked = [Turn(tokens=tuple(t), text=tokenizer.decode(list(t)), ended_by=e)
                 for t, e in zip(turns, ended_by, strict=True)]
        results = runner.step([envs[r] for r in rows], asked)
        out = []
        for res, e in zip(results, ended_by, strict=True):
            ids, res = _observation(task, res, e, runner)
            out.append(TurnOutcome(observation=ids, reward=float(res.reward),
                                   done=bool(res.done), info=dict(res.info)))
        return out
    return step


def sample_episodes(params, mcfg, task, records: Sequence[Any], *, group_size: int,
                    policy: Policy, sampling: SamplingConfig, loop: LoopSpec, key: jax.Array,
                    runner: EnvRunner, weights_version: int = 0) -> MultiTurnRollout:
    """`group_size` episodes of each record (rows grouped as `generate`'s samples are)."""
    rows = [rec for rec in records for _ in range(group_size)]
    envs = [task.make_env() for _ in rows]
    prompts = [env.reset(rec) for env, rec in zip(envs, rows, strict=True)]
    return generate_multiturn(params, mcfg, prompts, turn_step(envs, runner, task),
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
    and `decode_steps` of the calls; `timing_s/env` (seconds in the environments);
    `reward/<name>` and `reward_failed/<name>` where the task's reward functions scored
    the episodes.
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
    # A task's reward functions, scored when each episode ended (`tasks.EnvDatasetTask`).
    scored = [i for i in infos if isinstance(i.get("reward_parts"), dict)]
    by_function = {}
    for name in sorted({n for i in scored for n in i["reward_parts"]}):
        values = np.asarray([i["reward_parts"].get(name, np.nan) for i in scored], np.float64)
        by_function[f"reward/{name}"] = (float(np.nanmean(values)) if np.isfinite(values).any()
                                         else 0.0)
        by_function[f"reward_failed/{name}"] = float(sum(
            i.get("reward_failed", {}).get(name, 0) for i in scored))
    return by_function | {
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
