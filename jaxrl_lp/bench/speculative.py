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

Workload: `--prompts` held-out problems, decoded greedily `--batch` rows per
call (default 1: one problem per call), each call stopping at EOS, as the
sampler of a training run does. The answers are what the model learned, so
the acceptance measures how often the drafter agrees with the target where
the target's output means something. (`--past-eos` decodes exactly
`--new-tokens` tokens past EOS instead, the regime of a long rollout; there
the continuation was never trained and the acceptance measures agreement on
noise.) One timed run of an arm decodes every prompt;
runs of the two arms alternate (so a change in load falls on both), each
arm calls its jitted program (`speculative_program`, `sampler_program`: what
`speculative_generate` and `generate` run after their host-side checks and
padding, a cost both pay alike: docs/design/speculative.md, "Benchmark") on
the same padded device arrays after a warm-up call (compile excluded), and
`speedup_vs_plain` is the ratio of the median run times (the fastest runs'
ratio beside it).
`prefill_only_s` and `speculative_prefill_only_s` are each arm's calls at
`max_new_tokens=1` (dispatch, prefill, first token, set-up: what speculation
cannot shorten); `decode_speedup_vs_plain` is the ratio after subtracting
them.
`round_cost_in_plain_steps` is what one speculative iteration (k draft
steps, the verification forward, the acceptance) costs in plain decode
steps: speculation pays when `tokens_per_target_forward` exceeds it.
Greedy speculative output equals plain output token for token (checked,
`same_tokens`). `drafter_cache_bytes` is the dense drafter's cache at two
context lengths (it does not grow), against the target's.
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
from jaxrl_lp.numerics.policy import FP32
from jaxrl_lp.rollout import LoopSpec, SamplingConfig
from jaxrl_lp.rollout.generate import call_inputs, one_device, pad_prompts, sampler_program
from jaxrl_lp.rollout.rows import cache_bytes
from jaxrl_lp.rollout.speculative import SpecConfig, drafter_cache_bytes, speculative_program
from jaxrl_lp.rollout.step import decode_layout

__all__ = ["add_arguments", "run", "warm_start"]


def add_arguments(parser) -> None:
    parser.add_argument("--k", type=int, default=2, help="tokens drafted per verification")
    parser.add_argument("--loops", type=int, default=1, help="the self-drafter's loop steps")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded per call")
    parser.add_argument("--prompts", type=int, default=16,
                        help="held-out problems decoded per timed run (batch rows per call)")
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="tokens generated per row at most (0: the task's longest answer)")
    parser.add_argument("--past-eos", action="store_true",
                        help="decode exactly --new-tokens tokens, past EOS (untrained output)")
    parser.add_argument("--sft-steps", type=int, default=300,
                        help="warm-start steps of the target and the dense drafter")
    parser.add_argument("--drafter-context", type=int, default=32,
                        help="the dense drafter's trained length (max_position_embeddings)")
    parser.add_argument("--sink", type=int, default=4, help="the dense drafter's sink tokens")
    parser.add_argument("--window", type=int, default=16, help="the dense drafter's window")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per arm at least")
    parser.add_argument("--min-time", type=float, default=2.0,
                        help="seconds each arm is timed for at least")
    parser.add_argument("--seed", type=int, default=0)


def warm_start(mcfg: ModelConfig, task, steps: int, seq_len: int, seed: int = 0) -> dict:
    """`steps` supervised steps (Adam 3e-3, batch 64) of a random `mcfg` model on `task`."""
    from jaxrl_lp.data.pipeline import sft_loader
    from jaxrl_lp.rl.train_step import make_sft_step

    opt = optax.adam(3e-3)
    step = make_sft_step(mcfg, FP32, opt)
    params = init_params(mcfg, jax.random.PRNGKey(seed))
    state = opt.init(params)
    it = iter(sft_loader(task.train, task.sft_example, 64, seed, task.tokenizer.pad_id,
                         seq_len=seq_len))
    for _ in range(steps):
        b = next(it)
        params, state, _ = step(params, state, jnp.asarray(b.tokens_BxL),
                                jnp.asarray(b.loss_mask_BxL))
    return params


def _arm(params, cfg, batches, spec, drafter, args, new_tokens, eos_id, pad_id):
    """Times plain against speculative decoding of `batches` (lists of prompts), alternating.

    Both arms run their jitted program (`sampler_program`, `speculative_program`: what `generate` and
    `speculative_generate` call after validating and padding on the host) on the same
    padded device arrays, so the times are the programs' (prefill and decode), not the
    host wrappers' (the same for both).
    """
    sampling = SamplingConfig(greedy=True)
    policy = FP32
    loop = LoopSpec().resolve(cfg)
    dparams, dcfg = drafter if drafter is not None else (None, None)
    spec = spec.resolve(cfg, dcfg)
    key = jax.random.PRNGKey(0)
    inputs = [tuple(jnp.asarray(a) for a in pad_prompts(
        ps, pad_id, max_len=cfg.max_position_embeddings - new_tokens - spec.k)) for ps in batches]
    # The decode layout `generate` and `speculative_generate` pick for these weights.
    kw = dict(cfg=cfg, policy=policy, loop=loop, sampling=sampling, eos_id=eos_id, pad_id=pad_id,
              layout=decode_layout(params, policy))

    def placed(x, n, counts):  # the inputs as the samplers place them, nothing forced
        zeros = np.zeros((x[0].shape[0], n), np.int32)
        return call_inputs(*x, key, 0, zeros, zeros, False, device=one_device(params),
                           counts_BxN=zeros if counts else None)

    def spec_call(n):
        held = None if dparams is None else jax.device_put(dparams, one_device(params))
        ready = [placed(x, n, True) for x in inputs]
        return lambda: [jax.block_until_ready(speculative_program(
            params, held, *a, dcfg=dcfg, spec=spec, max_new_tokens=n, **kw)) for a in ready]

    def plain_call(n):
        ready = [placed(x, n, False) for x in inputs]
        return lambda: [jax.block_until_ready(sampler_program(
            params, *a, max_new_tokens=n, **kw)) for a in ready]

    calls = {"speculative": spec_call(new_tokens), "plain": plain_call(new_tokens),
             "prefill_only": plain_call(1), "speculative_prefill_only": spec_call(1)}
    firsts, times, outs = _race(calls, args.repeats, args.min_time)
    med = {m: float(np.median(t)) for m, t in times.items()}
    best = {m: min(t) for m, t in times.items()}
    stats = [st for _, st in outs["speculative"]]
    total = lambda f: sum(int(getattr(st, f)) for st in stats)  # noqa: E731
    tokens = sum(float(np.asarray(ro.completion_mask).sum()) for ro in outs["plain"])
    # Each program's own fixed part (dispatch, prefill, first token, set-up) is its time at
    # max_new_tokens=1; what is left is decoding.
    fixed = {"plain": "prefill_only", "speculative": "speculative_prefill_only"}
    decode = lambda m: med[m] - med[fixed[m]]  # noqa: E731
    plain_forwards = sum(int(np.asarray(ro.completion_mask).sum(1).max()) for ro in outs["plain"])
    return {
        "spec": str(spec),
        "acceptance_rate": round(total("accepted") / max(total("proposed"), 1), 4),
        "tokens_per_target_forward": round(
            total("committed") / max(sum(int(st.iterations) * len(ps)
                                         for st, ps in zip(stats, batches, strict=True)), 1), 4),
        "target_forwards": sum(int(st.iterations) + 1 for st in stats),
        "plain_target_forwards": plain_forwards,
        "speedup_vs_plain": round(med["plain"] / med["speculative"], 4),
        "speedup_vs_plain_fastest": round(best["plain"] / best["speculative"], 4),
        "decode_speedup_vs_plain": round(decode("plain") / max(decode("speculative"), 1e-9), 4),
        # Speculation pays when a row commits more tokens per verification than a round
        # (k draft steps, the verification, the acceptance) costs in plain decode steps.
        "round_cost_in_plain_steps": round(
            decode("speculative") / max(sum(int(st.iterations) for st in stats), 1)
            / max(decode("plain") / max(plain_forwards - len(batches), 1), 1e-12), 3),
        "speculative_s": round(med["speculative"], 5),
        "plain_s": round(med["plain"], 5),
        "prefill_only_s": round(med["prefill_only"], 5),
        "speculative_prefill_only_s": round(med["speculative_prefill_only"], 5),
        "plain_s_per_decode_step": round(decode("plain") / max(plain_forwards - len(batches), 1),
                                         7),
        "speculative_s_per_round": round(
            decode("speculative") / max(sum(int(st.iterations) for st in stats), 1), 7),
        "speculative_tokens_per_s": round(tokens / med["speculative"], 1),
        "plain_tokens_per_s": round(tokens / med["plain"], 1),
        "tokens": int(tokens),
        "compile_s": {m: round(t, 2) for m, t in firsts.items()},
        "runs": len(times["plain"]),
        "same_tokens": all(bool((np.asarray(ro.completion_tokens)
                                 == np.asarray(pl.completion_tokens)).all())
                           for (ro, _), pl in zip(outs["speculative"], outs["plain"], strict=True)),
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
               for i in rng.choice(len(task.heldout), args.prompts, replace=False)]
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    # Stopping at EOS decodes the learned answers; past EOS every call runs the same number
    # of steps, on output the model was never trained on.
    new_tokens = args.new_tokens or task.max_completion_tokens
    eos_id = None if args.past_eos else tok.eos_id
    self_spec = SpecConfig("self", k=args.k, loops=args.loops)
    dense_spec = SpecConfig("dense", k=args.k, sink=args.sink, window=args.window)
    out = {
        "target": {"model": "default looped (2 layers x 2 loop steps)",
                   "params": mcfg.param_count(), "sft_steps": args.sft_steps},
        "drafter": {"params": dcfg.param_count(), "trained_length": args.drafter_context},
        "batch": args.batch, "prompts": args.prompts, "new_tokens": new_tokens,
        "stop_at_eos": eos_id is not None, "k": args.k,
        "prompt_tokens": max(len(p) for p in prompts),
        "self": _arm(target, mcfg, batches, self_spec, None, args, new_tokens, eos_id,
                     tok.pad_id),
        "dense": _arm(target, mcfg, batches, dense_spec, (drafter, dcfg), args, new_tokens,
                      eos_id, tok.pad_id),
    }
    spec = dense_spec.resolve(mcfg, dcfg)
    lengths = (64, 65536)
    target_cache = {n: cache_bytes(jax.eval_shape(lambda n=n: init_cache(
        dataclasses.replace(mcfg, max_position_embeddings=n), FP32, args.batch,
        n))) for n in lengths}
    out["drafter_cache_bytes"] = {str(n): drafter_cache_bytes(spec, dcfg, FP32, args.batch)
                                  for n in lengths}
    out["target_cache_bytes"] = {str(n): b for n, b in target_cache.items()}
    out["train_s"] = round(train_s, 1)
    out["backend"] = jax.default_backend()
    return out
