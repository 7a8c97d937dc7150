"""Multi-turn sampling against single-turn sampling of the same tokens, and the time in the
environments.

A model preset with random weights (its head biased towards two stop tokens, so turns
end by themselves) samples `--turns`-turn episodes of `--rows` rows
(`rollout.generate_multiturn`): a scripted environment answers every turn with an
observation of `--observation-tokens` tokens after `--env-ms` milliseconds (on host
threads, as `envs.EnvRunner` steps real ones) and ends each episode at its last turn.
Against it, `rollout.generate` samples single-turn completions as long as the
episodes' whole completions (turns and observations) on the same rows: the tokens a
single-turn sampler would decode for the same context. Reported (fastest of
`--repeats` runs after a first, compiling call): seconds, policy tokens per second and
context tokens (policy and observation) per second of each, the multi-turn call's time
in the environment, its prefilled tokens and decode steps, and the replay's equality
with the sampler (`replay_multiturn`, max |dlogp| over the policy tokens).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.numerics.policy import FP32, policy_arg

__all__ = ["add_arguments", "run"]

STOP = (7, 9)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-qwen3", help="model preset (random weights)")
    parser.add_argument("--policy", default=FP32.name, type=policy_arg,
                        help="precision policy (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=8, help="episodes in the batch")
    parser.add_argument("--turns", type=int, default=4, help="model turns per episode")
    parser.add_argument("--turn-tokens", type=int, default=16, help="tokens per turn at most")
    parser.add_argument("--observation-tokens", type=int, default=8,
                        help="tokens of each observation")
    parser.add_argument("--env-ms", type=float, default=5.0,
                        help="milliseconds each environment call takes")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each")
    parser.add_argument("--seed", type=int, default=0)


def _check(args) -> None:
    for name in ("rows", "turns", "turn_tokens", "observation_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.env_ms < 0:
        raise ValueError(f"--env-ms must be >= 0; got {args.env_ms}")


def _scripted(turns: int, obs_tokens: int, env_ms: float, pool):
    """The `step` callback: every turn answered after `env_ms` on `pool`'s threads with
    `obs_tokens` tokens, the episode ended at turn `turns`."""
    from jaxrl_lp.rollout.multiturn import TurnOutcome

    calls: dict[int, int] = {}

    def one(r):
        time.sleep(env_ms / 1000)
        k = calls.get(r, 0)
        calls[r] = k + 1
        done = k + 1 >= turns
        return TurnOutcome(observation=() if done else tuple(range(10, 10 + obs_tokens)),
                           reward=0.0, done=done, info={})

    def step(rows, toks, ended_by):
        return list(pool.map(one, rows))
    return step


def _fastest(fn, repeats: int):
    t = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return first, best, out


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark; returns one JSON-serializable dict."""
    _check(args)
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.rollout.generate import generate
    from jaxrl_lp.rollout.multiturn import TurnLimits, generate_multiturn, replay_multiturn
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.step import LoopSpec

    cfg = get_preset(args.preset)
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    params["lm_head"] = params["lm_head"].at[:, jnp.array(STOP)].multiply(40.0)
    loop = LoopSpec("model", "deferred") if cfg.is_looped else LoopSpec()
    rng = np.random.default_rng(args.seed)
    prompts = [list(rng.integers(3, cfg.vocab_size, rng.integers(4, 12))) for _ in range(args.rows)]
    limits = TurnLimits(max_turns=args.turns, max_turn_tokens=args.turn_tokens,
                        max_observation_tokens=args.observation_tokens, stop_token_ids=STOP,
                        eos_id=None, pad_id=0)
    sampling = SamplingConfig(temperature=1.0)
    key = jax.random.PRNGKey(args.seed + 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(args.rows, 16)) as pool:
        def multi():
            step = _scripted(args.turns, args.observation_tokens, args.env_ms, pool)
            return generate_multiturn(params, cfg, prompts, step, limits, policy=args.policy,
                                      sampling=sampling, loop=loop, key=key)

        mt_first, mt_s, mt = _fastest(multi, args.repeats)
    ro = mt.rollout
    policy_tokens = int(np.asarray(ro.completion_mask).sum())
    env_tokens = int(np.asarray(ro.env_mask).sum())
    width = int((np.asarray(ro.completion_mask) + np.asarray(ro.env_mask)).sum(1).max())

    def single():
        return jax.block_until_ready(generate(
            params, cfg, prompts, policy=args.policy, sampling=sampling, max_new_tokens=width,
            eos_id=None, loop=loop, key=key).logprobs)

    st_first, st_s, _ = _fastest(single, args.repeats)
    replay = np.asarray(replay_multiturn(params, cfg, args.policy, mt))
    mask = np.asarray(ro.completion_mask) > 0
    single_tokens = args.rows * width
    return {
        "target": "multiturn", "preset": args.preset, "policy": args.policy.name,
        "date": datetime.date.today().isoformat(),
        "platform": f"{platform.machine()} {jax.default_backend()}, {os.cpu_count()} cores",
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "rows": args.rows, "turns": args.turns, "turn_tokens": args.turn_tokens,
        "observation_tokens": args.observation_tokens, "env_ms": args.env_ms,
        "multiturn": {
            "first_s": round(mt_first, 4), "seconds": round(mt_s, 4),
            "policy_tokens": policy_tokens, "env_tokens": env_tokens,
            "policy_tokens_per_s": round(policy_tokens / mt_s, 1),
            "context_tokens_per_s": round((policy_tokens + env_tokens) / mt_s, 1),
            "env_seconds": round(mt.env_seconds, 4),
            "env_share": round(mt.env_seconds / mt_s, 3),
            "prefill_tokens": mt.prefill_tokens, "decode_steps": mt.decode_steps,
            "turns_per_episode": float(np.mean(mt.turns)),
            "replay_max_abs_dlogp": float(np.abs(replay - np.asarray(ro.logprobs))[mask].max()),
        },
        "single_turn": {
            "first_s": round(st_first, 4), "seconds": round(st_s, 4),
            "tokens": single_tokens, "tokens_per_s": round(single_tokens / st_s, 1),
        },
        "multiturn_vs_single_context_tokens_per_s": round(
            (policy_tokens + env_tokens) / mt_s / (single_tokens / st_s), 3),
    }
