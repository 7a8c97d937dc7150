"""The speculative-rollout benchmark: acceptance, tokens per target forward, speed-up over plain decoding.

Target: the looped default model of `jaxrl-lp train` (2 layers, 2 loop steps,
the arithmetic task's vocabulary), warm-started in-process for `--sft-steps`
supervised steps so that its predictions are not noise (a random model's
shallow loop agrees with its full depth by chance only). Drafters:

- `self`: the target itself at `--loops` loop steps (`self:loops=1,k=K`),
  sharing its weights and KV cache;
- `dense`: a 1-layer dense model trained the same way on the same data, with
  a short trained length (`--drafter-context`), a bounded cache (`sink` +
  `window`) and re-based positions.

Each arm decodes the same prompts greedily (batch `--batch`, default 1),
speculative and plain alternating call by call so that a change in load falls
on both; `speedup_vs_plain` is plain's fastest time over speculative's fastest
(compile excluded). Greedy speculative output equals plain output token for
token (checked, `same_tokens`). `drafter_cache_bytes` is the dense drafter's
cache at two context lengths (it does not grow), against the target's.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_lp.bench.sampler import _race
from jaxrl_lp.models.cache import init_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout import SamplingConfig, generate
from jaxrl_lp.rollout.rows import cache_bytes
from jaxrl_lp.rollout.speculative import SpecConfig, drafter_cache_bytes, speculative_generate

__all__ = ["add_arguments", "run", "warm_start"]


def add_arguments(parser) -> None:
    parser.add_argument("--k", type=int, default=4, help="tokens drafted per verification")
    parser.add_argument("--loops", type=int, default=1, help="the self-drafter's loop steps")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded at once")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens generated per row")
    parser.add_argument("--sft-steps", type=int, default=300,
                        help="warm-start steps of the target and the dense drafter")
    parser.add_argument("--drafter-context", type=int, default=32,
                        help="the dense drafter's trained length (max_position_embeddings)")
    parser.add_argument("--sink", type=int, default=4, help="the dense drafter's sink tokens")
    parser.add_argument("--window", type=int, default=16, help="the dense drafter's window")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per arm at least")
    parser.add_argument("--min-time", type=float, default=2.0,
                        help="seconds each arm is timed for at least")
    parser.add_argument("--seed", type=int, default=0)


def warm_start(mcfg: ModelConfig, task, steps: int, seq_len: int, seed: int = 0) -> dict:
    """`steps` supervised steps (Adam 3e-3, batch 64) of a random `mcfg` model on `task`."""
    from jaxrl_lp.data.pipeline import sft_loader
    from jaxrl_lp.rl.train_step import make_sft_step

    opt = optax.adam(3e-3)
    step = make_sft_step(mcfg, Policy.parse("fp32"), opt)
    params = init_params(mcfg, jax.random.PRNGKey(seed))
    state = opt.init(params)
    it = iter(sft_loader(task.train, task.sft_example, 64, seed, task.tokenizer.pad_id,
                         seq_len=seq_len))
    for _ in range(steps):
        b = next(it)
        params, state, _ = step(params, state, jnp.asarray(b.tokens_BxL),
                                jnp.asarray(b.loss_mask_BxL))
    return params


def _arm(name, params, cfg, prompts, spec, drafter, args, eos_id, pad_id):
    kw = dict(sampling=SamplingConfig(greedy=True), max_new_tokens=args.new_tokens,
              eos_id=eos_id, pad_id=pad_id)
    calls = {
        "speculative": lambda: jax.block_until_ready(speculative_generate(
            params, cfg, prompts, spec, drafter=drafter, with_stats=True, **kw)),
        "plain": lambda: jax.block_until_ready(generate(params, cfg, prompts, **kw)),
    }
    firsts, times, outs = _race(calls, args.repeats, args.min_time)
    (ro, st), plain = outs["speculative"], outs["plain"]
    best_spec, best_plain = min(times["speculative"]), min(times["plain"])
    tokens = float(np.asarray(plain.completion_mask).sum())
    return {
        "spec": str(spec),
        "acceptance_rate": round(st.acceptance_rate, 4),
        "tokens_per_target_forward": round(st.tokens_per_target_forward(len(prompts)), 4),
        "target_forwards": int(st.iterations) + 1,
        "plain_target_forwards": int(np.asarray(plain.completion_mask).sum(1).max()),
        "speedup_vs_plain": round(best_plain / best_spec, 4),
        "speculative_s": round(best_spec, 5),
        "plain_s": round(best_plain, 5),
        "speculative_tokens_per_s": round(tokens / best_spec, 1),
        "plain_tokens_per_s": round(tokens / best_plain, 1),
        "compile_s": {m: round(t, 2) for m, t in firsts.items()},
        "runs": len(times["plain"]),
        "same_tokens": bool((np.asarray(ro.completion_tokens)
                             == np.asarray(plain.completion_tokens)).all()),
    }


def run(args) -> dict:
    from jaxrl_lp.train.defaults import default_config
    from jaxrl_lp.train.validate import build_task, model_config

    t0 = time.time()
    cfg = default_config()
    task = build_task(cfg)
    mcfg = model_config(cfg, task)
    tok = task.tokenizer
    seq_len = task.max_sequence_length
    target = warm_start(mcfg, task, args.sft_steps, seq_len, args.seed)
    dcfg = ModelConfig(family="qwen3", vocab_size=mcfg.vocab_size, hidden_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                       max_position_embeddings=args.drafter_context, rope_theta=10_000.0,
                       bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    drafter = warm_start(dcfg, task, args.sft_steps, seq_len, args.seed + 1)
    train_s = time.time() - t0
    rng = np.random.RandomState(args.seed)
    prompts = [task.prompt_ids(task.heldout[int(i)])
               for i in rng.choice(len(task.heldout), args.batch, replace=False)]
    # The answer is a handful of tokens: decode past EOS (eos_id None) so every arm runs
    # the same number of steps, as a long reasoning rollout would.
    self_spec = SpecConfig("self", k=args.k, loops=args.loops)
    dense_spec = SpecConfig("dense", k=args.k, sink=args.sink, window=args.window)
    out = {
        "target": {"model": "default looped (2 layers x 2 loop steps)",
                   "params": mcfg.param_count(), "sft_steps": args.sft_steps},
        "drafter": {"params": dcfg.param_count(), "trained_length": args.drafter_context},
        "batch": args.batch, "new_tokens": args.new_tokens, "k": args.k,
        "prompt_tokens": max(len(p) for p in prompts),
        "self": _arm("self", target, mcfg, prompts, self_spec, None, args, None, tok.pad_id),
        "dense": _arm("dense", target, mcfg, prompts, dense_spec, (drafter, dcfg), args, None,
                      tok.pad_id),
    }
    spec = dense_spec.resolve(mcfg, dcfg)
    lengths = (64, 65536)
    target_cache = {n: cache_bytes(jax.eval_shape(lambda n=n: init_cache(
        dataclasses.replace(mcfg, max_position_embeddings=n), Policy.parse("fp32"), args.batch,
        n))) for n in lengths}
    out["drafter_cache_bytes"] = {str(n): drafter_cache_bytes(spec, dcfg, "fp32", args.batch)
                                  for n in lengths}
    out["target_cache_bytes"] = {str(n): b for n, b in target_cache.items()}
    out["train_s"] = round(train_s, 1)
    out["backend"] = jax.default_backend()
    return out
