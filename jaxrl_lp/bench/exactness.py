"""The exactness benchmark: learner log-probs (replay, dense, hybrid) against the sampler's, and their cost.

For each precision policy (`fp32`, `bf16`) and model kind (`dense`: a random
tiny Qwen3; `looped_dense` / `looped_deferred`: a random tiny Ouro in either
compute mode, exiting by `threshold:0.5`), one batch of rollouts is sampled
(ragged prompts, G samples each, temperature 0.8, EOS in play) and the learner
recomputes the log-probs of the sampled tokens with the sampler's weights and
policy. Per entry:

- `max_abs_diff_replay`: max |replay - sampler| over the completion mask, the
  replay (`rollout.replay.replay_logprobs`: the sampler's own compiled program
  with the tokens forced). 0.0 by construction.
- `max_abs_diff_dense`: max |dense - sampler|, the dense log-probs as the
  dense learner step computes them (one parallel teacher-forced forward:
  small, nonzero kernel-shape rounding).
- `max_abs_diff_hybrid`: the same for the hybrid log-probs as the hybrid
  learner step computes them (its value is the replay's, passed in as
  `make_grpo_step` passes it: 0.0).
- `hybrid_over_dense_time`: seconds of one hybrid learner step (value and
  gradient of a GRPO-like loss, `grpo_like_loss`) plus its replay, over the
  same step with dense log-probs: the median of `repeats` timed calls each,
  after a warm-up call, in one process. Compile times are not included.
- `completion_lengths`, `exit_step_counts`, `decode_loop_evals`: evidence that
  the rollouts are not trivial (the random head makes EOS likely enough that
  some sequences end early; the random exit gate is set so the rule exits at
  every loop step; see `exactness_model`).

The entries' rollouts and programs are prepared first, several at a time in
threads (`prepare_s`: mostly XLA compiles), then measured one at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.config import ModelConfig, get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import PRESETS, Policy, policy_list_arg
from jaxrl_lp.rl.logprobs import learner_logprobs, replay_logprobs
from jaxrl_lp.rollout.generate import Rollout, generate
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec

__all__ = [
    "EXIT_RULE",
    "KINDS",
    "POLICIES",
    "add_arguments",
    "exactness_model",
    "exactness_rollout",
    "grpo_like_loss",
    "learner_step",
    "masked_max_abs_diff",
    "run",
    "run_exactness",
]

KINDS: tuple[str, ...] = ("dense", "looped_dense", "looped_deferred")
POLICIES: tuple[Policy, ...] = (PRESETS["fp32"], PRESETS["bf16"])
EXIT_RULE = "threshold:0.5"
EOS_ID = 3
TEMPERATURE = 0.8
# Log-ratios are clipped to +-this before exp (STYLE.md; the value of rl.metrics).
LOG_RATIO_CLIP = 20.0
# Ragged prompts (bucketed to P = 8), each sampled G times.
PROMPTS: tuple[tuple[int, ...], ...] = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (12, 13, 14, 15))


def exactness_model(kind: str, *, loop_steps: int = 4, seed: int = 0, gate_scale: float = 20.0,
                    gate_bias: float = 2.0, eos_id: int = EOS_ID,
                    eos_scale: float = 6.0) -> tuple[ModelConfig, dict, LoopSpec]:
    """A random tiny model (`tiny-qwen3` or `tiny-ouro`) and the `LoopSpec` of `kind`.

    From the random init (kernel std 0.02, bias 0) the exit gate reads lambda
    ~ 0.5 at every step, so `threshold:0.5` exits every token at step 0. The
    gate kernel is multiplied by `gate_scale` and `gate_bias` is added: gate
    logits then spread over several units and exits fall at every loop step,
    most of them early, so that in deferred mode some decode steps stop before
    the last loop step. The `eos_id` column of the output head is multiplied
    by `eos_scale` so EOS is likely at some positions only: some sequences end
    early, others run to the token limit.
    """
    if kind not in KINDS:
        raise ValueError(f"model kind must be one of {KINDS}; got {kind!r}")
    if kind == "dense":
        cfg, loop = get_preset("tiny-qwen3"), LoopSpec()
    else:
        cfg = get_preset("tiny-ouro").replace(loop_steps=loop_steps)
        loop = LoopSpec(EXIT_RULE, kind.removeprefix("looped_"))
    params = init_params(cfg, jax.random.PRNGKey(seed))
    params["lm_head"] = params["lm_head"].at[:, eos_id].multiply(eos_scale)
    if cfg.is_looped:
        params["exit_gate"] = {"kernel": params["exit_gate"]["kernel"] * gate_scale,
                               "bias": params["exit_gate"]["bias"] + gate_bias}
    return cfg, params, loop


def exactness_rollout(params: dict, cfg: ModelConfig, policy: Policy, loop: LoopSpec, *,
                      prompts: Sequence[Sequence[int]] = PROMPTS, num_samples: int = 2,
                      max_new_tokens: int = 12, eos_id: int = EOS_ID,
                      temperature: float = TEMPERATURE,
                      seed: int = 1) -> Rollout:
    """Samples `num_samples` completions of every prompt at `temperature` (not greedy)."""
    return generate(params, cfg, prompts, policy=policy,
                    sampling=SamplingConfig(temperature=temperature), max_new_tokens=max_new_tokens,
                    num_samples=num_samples, eos_id=eos_id, loop=loop,
                    key=jax.random.PRNGKey(seed))


def masked_max_abs_diff(a_BxN: jax.Array, b_BxN: jax.Array, mask_BxN: jax.Array) -> float:
    """max |a - b| over the entries where `mask_BxN` is 1, as a Python float."""
    return float(jnp.max(jnp.where(mask_BxN > 0, jnp.abs(a_BxN - b_BxN), 0.0)))


def grpo_like_loss(logp_BxN: jax.Array, ro: Rollout, adv_B: jax.Array, eps: float = 0.2) -> jax.Array:
    """PPO-clip against the sampler's log-probs, token mean over the completion mask.

    Self-contained rather than `rl.loss.policy_loss`, so the timing compares
    log-prob methods and not loss configurations.
    """
    ratio = jnp.exp(jnp.clip(logp_BxN - ro.logprobs, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))
    a = adv_B[:, None]
    per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - eps, 1.0 + eps) * a)
    mask = ro.completion_mask
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def learner_step(cfg: ModelConfig, policy: Policy, loop: LoopSpec, method: str):
    """A jitted `(params, ro, adv_B, replay_BxN=None) -> ((loss, logp_BxN), grads)` with
    `method` log-probs; `replay_BxN` is a hybrid's value (`replay_logprobs`), computed outside
    as the training program does (None: traced into the step)."""

    def loss_fn(params, ro, adv_B, replay_BxN=None):
        logp, _ = learner_logprobs(params, cfg, policy, ro, method, loop=loop,
                                   replay_BxN=replay_BxN)
        return grpo_like_loss(logp, ro, adv_B), logp

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # warm-up: compiled already, this run allocates
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _prepare(policy: Policy, kind: str, *, loop_steps: int, max_new_tokens: int, num_samples: int,
             seed: int) -> dict:
    """Samples one entry's rollouts and compiles its three learner programs (thread-safe)."""
    cfg, params, loop = exactness_model(kind, loop_steps=loop_steps, seed=seed)
    ro = exactness_rollout(params, cfg, policy, loop, max_new_tokens=max_new_tokens,
                           num_samples=num_samples, seed=seed + 1)
    adv = jax.random.normal(jax.random.PRNGKey(seed + 2), ro.logprobs.shape[:1])
    # Compiled ahead of time: the static arguments are bound, calls take the rest. The
    # replay is the sampler's program (compiled by the sampling above).
    replay = functools.partial(replay_logprobs, cfg=cfg, policy=policy)
    value = replay(params, ro=ro)
    steps = {"hybrid": learner_step(cfg, policy, loop, "hybrid").lower(params, ro, adv,
                                                                       value).compile(),
             "dense": learner_step(cfg, policy, loop, "dense").lower(params, ro, adv).compile()}
    return {"cfg": cfg, "params": params, "ro": ro, "adv": adv, "replay": replay, "steps": steps}


def _measure(e: dict, repeats: int) -> dict:
    params, ro, adv = e["params"], e["ro"], e["adv"]
    mask = ro.completion_mask
    replay = e["replay"](params, ro=ro)
    (_, hybrid), _ = e["steps"]["hybrid"](params, ro, adv, replay)
    (_, dense), _ = e["steps"]["dense"](params, ro, adv)
    t_hybrid = _median_seconds(lambda *a: e["steps"]["hybrid"](*a, e["replay"](a[0], ro=ro)),
                               params, ro, adv, repeats=repeats)
    t_dense = _median_seconds(e["steps"]["dense"], params, ro, adv, repeats=repeats)
    m = np.asarray(mask) > 0
    return {
        "max_abs_diff_replay": masked_max_abs_diff(replay, ro.logprobs, mask),
        "max_abs_diff_dense": masked_max_abs_diff(dense, ro.logprobs, mask),
        "max_abs_diff_hybrid": masked_max_abs_diff(hybrid, ro.logprobs, mask),
        "hybrid_over_dense_time": t_hybrid / t_dense,
        "step_s_hybrid": t_hybrid,
        "step_s_dense": t_dense,
        "tokens": int(m.sum()),
        "completion_lengths": [int(x) for x in m.sum(axis=1)],
        "exit_step_counts": [int(x) for x in np.bincount(np.asarray(ro.exit_steps)[m],
                                                         minlength=e["cfg"].loop_steps)],
        "decode_loop_evals": int(ro.loop_evals),
    }


def run_exactness(*, policies: Sequence[Policy] = POLICIES, kinds: Sequence[str] = KINDS,
                  loop_steps: int = 4, max_new_tokens: int = 32, num_samples: int = 2,
                  repeats: int = 5, seed: int = 0, jobs: int | None = None) -> dict:
    """Measures every (policy, kind): learner-vs-sampler log-prob differences and step times.

    Two phases. First every entry's rollouts are sampled and its programs
    compiled, `jobs` entries at a time in threads (XLA:CPU compiles a program
    on one core, and compiling is most of this benchmark's time). Then the
    entries are measured one after the other, nothing else running, so the
    timings do not compete with compiles.

    Args:
      jobs: entries prepared concurrently (default: the number of CPUs, at most 6).

    Returns:
      `{"config": {...}, "results": {policy: {kind: {...}}}, "prepare_s": ...,
      "wall_s": ...}` with the fields of the module docstring per entry.

    Examples:
      >>> out = run_exactness(policies=[FP32], kinds=["dense"], repeats=3)
      >>> out["results"]["fp32"]["dense"]["max_abs_diff_replay"]
      0.0
    """
    t_start = time.perf_counter()
    jobs = jobs or min(6, os.cpu_count() or 1)
    entries = [(pol, kind) for pol in policies for kind in kinds]
    prepare = functools.partial(_prepare, loop_steps=loop_steps, max_new_tokens=max_new_tokens,
                                num_samples=num_samples, seed=seed)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        prepared = list(pool.map(lambda e: prepare(*e), entries))
    t_prepared = time.perf_counter()
    results: dict = {pol.name: {} for pol in policies}
    for (pol, kind), e in zip(entries, prepared, strict=True):
        results[pol.name][kind] = _measure(e, repeats)
    config = {
        "models": {"dense": "tiny-qwen3", "looped": f"tiny-ouro, loop_steps={loop_steps}"},
        "exit_rule": EXIT_RULE, "prompts": len(PROMPTS), "num_samples": num_samples,
        "max_new_tokens": max_new_tokens, "temperature": TEMPERATURE, "repeats": repeats,
        "loss": "PPO-clip token mean (grpo_like_loss)", "backend": jax.default_backend(),
        "jobs": jobs,
    }
    return {"config": config, "results": results, "prepare_s": t_prepared - t_start,
            "wall_s": time.perf_counter() - t_start}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench exactness`."""
    parser.add_argument("--policies", default=",".join(p.name for p in POLICIES),
                        type=policy_list_arg,
                        help="comma-separated precision policies (default: %(default)s)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="comma-separated model kinds (default: %(default)s)")
    parser.add_argument("--loop-steps", type=int, default=4,
                        help="loop steps R of the looped model (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--num-samples", type=int, default=2,
                        help="G samples per prompt (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed learner steps per method (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=None,
                        help="entries sampled and compiled concurrently (default: CPUs, at most 6)")


def run(args: argparse.Namespace) -> dict:
    """`jaxrl-lp bench exactness`: validates the options, then `run_exactness`."""
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"--kinds: unknown model kind(s) {bad}; allowed: {', '.join(KINDS)}")
    policies = args.policies
    for name in ("loop_steps", "max_new_tokens", "num_samples", "repeats", "jobs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return run_exactness(policies=policies, kinds=kinds, loop_steps=args.loop_steps,
                         max_new_tokens=args.max_new_tokens, num_samples=args.num_samples,
                         repeats=args.repeats, seed=args.seed, jobs=args.jobs)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    print(json.dumps(run(_parser.parse_args()), indent=2))
