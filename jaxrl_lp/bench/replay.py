"""Replay == sampler at model sizes, at every batch shape a run replays, and what it costs.

For each preset and policy: random weights (`init_params`, the f32 master a
training run holds), ragged random prompts sampled G times at temperature 1
with an EOS some rows reach (its output column scaled), a looped model in
deferred mode with `threshold:0.5` exits that fall at every loop step (the
exit gate scaled, as `bench exactness` does). Then, against the sampler's
recorded log-probs over the completion mask (bits compared, `differ` counts
tokens):

- `whole`: `replay_logprobs` of the whole rollout (the sampler's program,
  tokens forced; `rollout.replay`);
- `slices_2`, `slices_4`: each row slice of a 2- and 4-way split replayed on
  its own (minibatches, micro-batches), and `rows_shuffled`: a permuted
  subset;
- `stale_1`: a rollout sampled on weights v, then another sampled on weights
  v + 1 (`max_staleness` 1), then the first replayed on weights v; and
  `other_weights_max_abs_diff`, the first replayed on weights v + 1 (not 0:
  the replay computes with the weights it is given);
- `traced` (with `--traced`): the former construction, the sampler's steps
  traced into a program of their own (`traced_replay_logprobs`, jitted).

With `--cost`, for the first preset and policy, seconds (median of
`--repeats` calls after a warm-up, the compile excluded): the sampler with the forcing input (`generate`) and
without it (`sampler_program(forced=None)`), and a whole-batch replay by the
sampler's program against the traced replay. `sampled_tokens_per_s` counts
the rows' generated tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.config import ModelConfig, get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy, policy_list_arg
from jaxrl_lp.rl.logprobs import traced_replay_logprobs
from jaxrl_lp.rollout.generate import (
    Rollout,
    call_inputs,
    generate,
    one_device,
    pad_prompts,
    sampler_program,
    take_rows,
)
from jaxrl_lp.rollout.replay import replay_logprobs
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.step import LoopSpec
from jaxrl_lp.train.behaviour import bit_mismatch

__all__ = ["add_arguments", "replay_cell", "run", "run_replay"]

EXIT_RULE = "threshold:0.5"
EOS_SCALE = 4.0
GATE_SCALE = 20.0
GATE_BIAS = 2.0


def _model(preset: str, seed: int) -> tuple[ModelConfig, dict, LoopSpec, int]:
    """(cfg, params, loop spec, EOS id) of a random `preset` set up for the cells."""
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.PRNGKey(seed))
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else 3
    if cfg.tie_embeddings:  # the head is the embedding: scale EOS's row
        params["embed"] = params["embed"].at[eos].multiply(EOS_SCALE)
    else:
        params["lm_head"] = params["lm_head"].at[:, eos].multiply(EOS_SCALE)
    loop = LoopSpec()
    if cfg.is_looped:
        params["exit_gate"] = {"kernel": params["exit_gate"]["kernel"] * GATE_SCALE,
                               "bias": params["exit_gate"]["bias"] + GATE_BIAS}
        loop = LoopSpec(EXIT_RULE, "deferred")
    return cfg, params, loop, eos


def _compare(got: jax.Array, want: jax.Array, mask: np.ndarray) -> dict:
    differ, tokens, worst = bit_mismatch(got, want, mask)
    return {"differ": differ, "tokens": tokens, "max_abs_diff": worst}


def _seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def replay_cell(preset: str, policy: Policy, *, prompts: int, samples: int, prompt_len: int,
                new_tokens: int, seed: int = 0, traced: bool = False, cost: bool = False,
                repeats: int = 3) -> dict:
    """One preset and policy: the module docstring's cells (and seconds with `cost`)."""
    t0 = time.perf_counter()
    cfg, params, loop, eos = _model(preset, seed)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, prompts)
    batch = [list(rng.integers(10, cfg.vocab_size, n)) for n in lengths]
    sampling = SamplingConfig(temperature=1.0)
    kw = dict(policy=policy, sampling=sampling, max_new_tokens=new_tokens, num_samples=samples,
              eos_id=eos, loop=loop)
    key = jax.random.PRNGKey(seed + 1)
    sample = lambda p, k, v=0: generate(p, cfg, batch, key=k, weights_version=v, **kw)
    ro: Rollout = jax.block_until_ready(sample(params, key))
    t_sampled = time.perf_counter()
    mask = np.asarray(ro.completion_mask) > 0
    b = ro.completion_tokens.shape[0]
    replay = lambda p, r: replay_logprobs(p, cfg, policy, r)
    out = {"rows": b, "prompt_slots": ro.prompt_tokens.shape[1], "new_tokens": new_tokens,
           "completion_lengths_min_max": [int(mask.sum(1).min()), int(mask.sum(1).max())],
           "whole": _compare(replay(params, ro), ro.logprobs, mask)}
    if cfg.is_looped:
        out["exit_step_counts"] = [int(x) for x in np.bincount(
            np.asarray(ro.exit_steps)[mask], minlength=cfg.loop_steps)]
    for k in (2, 4):
        size = b // k
        parts = [replay(params, take_rows(ro, np.arange(i * size, (i + 1) * size)))
                 for i in range(k)]
        out[f"slices_{k}"] = _compare(jnp.concatenate(parts), ro.logprobs, mask)
    pick = rng.permutation(b)[: max(1, b // 2)]
    out["rows_shuffled"] = _compare(replay(params, take_rows(ro, pick)), ro.logprobs[pick],
                                    mask[pick])
    # max_staleness 1: the next weights sample before the first rollout is replayed.
    newer = jax.tree.map(lambda x: x * (1 + 1e-2) if jnp.issubdtype(x.dtype, jnp.floating)
                         else x, params)
    jax.block_until_ready(sample(newer, jax.random.fold_in(key, 1), 1))
    out["stale_1"] = _compare(replay(params, ro), ro.logprobs, mask)
    out["other_weights_max_abs_diff"] = _compare(replay(newer, ro), ro.logprobs,
                                                 mask)["max_abs_diff"]
    traced_fn = jax.jit(traced_replay_logprobs, static_argnums=(1, 2))
    if traced:
        out["traced"] = _compare(traced_fn(params, cfg, policy, ro), ro.logprobs, mask)
    if cost:
        zeros = np.zeros((b, new_tokens), np.int32)
        toks, pos, lens = pad_prompts(batch, 0)
        toks, pos, lens = (np.repeat(a, samples, axis=0) for a in (toks, pos, lens))
        args = call_inputs(toks, pos, lens, key, 0, zeros, zeros, False, device=one_device(params))
        statics = dict(cfg=cfg, policy=policy, loop=ro.loop, sampling=sampling,
                       max_new_tokens=new_tokens, eos_id=eos, pad_id=0,
                       layout=ro.decode_layout)
        plain = lambda: sampler_program(params, *args[:5], None, **statics).logprobs
        forced = lambda: sampler_program(params, *args, **statics).logprobs
        s_plain, s_forced = _seconds(plain, repeats), _seconds(forced, repeats)
        tokens = int(mask.sum())
        out["cost"] = {
            "sample_s_without_forcing": s_plain, "sample_s_with_forcing": s_forced,
            "sampler_overhead": s_forced / s_plain - 1.0,
            "sampled_tokens_per_s_with_forcing": tokens / s_forced,
            "sampled_tokens_per_s_without_forcing": tokens / s_plain,
            "replay_s_sampler_program": _seconds(lambda: replay(params, ro), repeats),
            "replay_s_traced": _seconds(lambda: traced_fn(params, cfg, policy, ro), repeats),
        }
    out["seconds"] = {"first_sample": t_sampled - t0, "cell": time.perf_counter() - t0}
    return out


def run_replay(*, presets, policies, prompts: int, samples: int, prompt_len: int,
               new_tokens: int, seed: int = 0, traced: bool = False, cost: bool = False,
               repeats: int = 3, progress=None) -> dict:
    """Every (preset, policy) cell, each printed by `progress` as it ends; `{"config": ...,
    "results": {preset: {policy: cell}}}`."""
    results: dict = {}
    # Policies outermost: every preset's first policy (bf16 by default) before the next, so a
    # caller's time limit that ends in a slow cell (fp32 at model size) leaves the others.
    for pol in policies:
        for preset in presets:
            first = preset == presets[0] and pol == policies[0]
            cell = replay_cell(preset, pol, prompts=prompts, samples=samples,
                               prompt_len=prompt_len, new_tokens=new_tokens, seed=seed,
                               traced=traced, cost=cost and first, repeats=repeats)
            results.setdefault(preset, {})[pol.name] = cell
            if progress is not None:
                progress(json.dumps({"preset": preset, "policy": pol.name, **cell}))
    exact = all(c[k]["differ"] == 0 for p in results.values() for c in p.values()
                for k in ("whole", "slices_2", "slices_4", "rows_shuffled", "stale_1"))
    dev = jax.devices()[0]
    return {"config": {"prompts": prompts, "samples": samples, "prompt_len": prompt_len,
                       "new_tokens": new_tokens, "temperature": 1.0, "exit_rule": EXIT_RULE,
                       "seed": seed, "repeats": repeats, "backend": jax.default_backend(),
                       "device": dev.device_kind, "jax": jax.__version__},
            "replay_equals_sampler": exact, "results": results}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench replay`."""
    parser.add_argument("--presets", default="qwen3-0.6b,ouro-1.4b",
                        help="comma-separated model presets (default: %(default)s)")
    parser.add_argument("--policies", default="bf16,fp32", type=policy_list_arg,
                        help="comma-separated precision policies (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--samples", type=int, default=2,
                        help="G samples per prompt (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="longest prompt; lengths are drawn from half that up "
                        "(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traced", action="store_true",
                        help="also the former traced replay's difference")
    parser.add_argument("--cost", action="store_true",
                        help="also time the sampler with and without forcing, and both replays "
                        "(the first preset and policy)")
    parser.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`jaxrl-lp bench replay`: validates the options, then `run_replay`."""
    presets = [p for p in args.presets.split(",") if p]
    for p in presets:
        get_preset(p)  # a clear error before anything compiles
    policies = args.policies
    for name in ("prompts", "samples", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.prompts * args.samples % 4:
        raise ValueError(f"--prompts x --samples = {args.prompts * args.samples} rows must "
                         "divide by 4 (the 4-way slices)")
    return run_replay(presets=presets, policies=policies, prompts=args.prompts,
                      samples=args.samples, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, seed=args.seed, traced=args.traced,
                      cost=args.cost, repeats=args.repeats,
                      progress=lambda line: print(line, flush=True, file=sys.stderr))
