"""A run's own GRPO update with and without the padding-free learner, on its own batches.

    python benchmarks/run_packing.py --run runs/default [--batches 8] [--repeats 3] > out.json

Reads a finished (or warm-started) `jaxrl-lp train` run directory: its
config, and the params of its latest checkpoint (`--step` another). Samples
`--batches` GRPO batches as the training program does (`prompts_per_step`
prompts of the task's training set, `group_size` samples each, the run's
sampler, temperature and exit rule), then times the update the program runs
at mu = 1 with one minibatch (`make_grpo_step` with the run's loss, optimizer
and log-prob method, the rollout's recorded log-probs as the hybrid's value)
two ways, alternating batch by batch:

- `packed`: `pack_buckets=16` (`models.packing`: the dense forward on the real
  tokens only; a looped model with its recorded schedule);
- `unpacked`: `pack_buckets=0`, every slot of the `[B, P + N]` grid.

Each first call on a new shape compiles (a packed step compiles once per
bucket of rows it meets: `buckets`, with its seconds in `compile_s`); the
timed calls are the later ones, each on its own copy of the params. It also
reports how far apart the two updates are (the same update up to matmul
rounding: `max_rel_param_diff`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a jaxrl-lp train run directory")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the batches")
    args = ap.parse_args()

    from jaxrl_lp.numerics.policy import Policy
    from jaxrl_lp.rl.advantages import group_advantages
    from jaxrl_lp.rl.logprobs import packed_rows_of
    from jaxrl_lp.rl.train_step import make_grpo_step
    from jaxrl_lp.rollout import LoopSpec, SamplingConfig, generate
    from jaxrl_lp.train.checkpoint import Checkpointer
    from jaxrl_lp.train.optimizers import make_optimizers
    from jaxrl_lp.train.run_io import run_config
    from jaxrl_lp.train.validate import build_task, model_config

    cfg = run_config(args.run)
    task = build_task(cfg)
    mcfg = model_config(cfg, task)
    ckpt = Checkpointer(cfg.run.out_dir, create=False)
    try:
        step = ckpt.resolve_step(args.step)
        params, _ = ckpt.restore_params(step, mcfg)
    finally:
        ckpt.close()
    g, tok = cfg.grpo, task.tokenizer
    lpol, spol = Policy.parse(g.learner_policy), Policy.parse(g.sampler_policy)
    loop = LoopSpec(g.exit_rule, g.compute_mode).resolve(mcfg)
    opt = make_optimizers(cfg)[1]
    batches = []
    for i in range(args.batches):
        problems = [task.train[(i * g.prompts_per_step + j) % len(task.train)]
                    for j in range(g.prompts_per_step)]
        ro = generate(params, mcfg, [task.prompt_ids(p) for p in problems], policy=spol,
                      sampling=SamplingConfig(temperature=g.temperature, draw=g.draw),
                      max_new_tokens=g.max_new_tokens or task.max_completion_tokens,
                      num_samples=g.group_size, eos_id=tok.eos_id, pad_id=tok.pad_id, loop=loop,
                      key=jax.random.PRNGKey(i))
        rewards = task.rewards(np.asarray(ro.completion_tokens),
                               [p for p in problems for _ in range(g.group_size)])
        adv = group_advantages(jnp.asarray(rewards), g.group_size, kind=g.advantage)
        batches.append((ro, adv))
    steps = {name: make_grpo_step(mcfg, lpol, cfg.loss, opt, loop=loop, sampler_policy=spol,
                                  method=g.logprobs, micro_batches=g.micro_batches,
                                  pack_buckets=buckets)
             for name, buckets in (("packed", 16), ("unpacked", 0))}
    recorded = g.logprobs == "hybrid"

    def update(name, ro, adv):
        p = jax.tree.map(jnp.copy, params)
        t = time.perf_counter()
        new, _, m = steps[name](p, opt.init(params), ro, adv, ro.logprobs, None, None,
                                ro.logprobs if recorded else None)
        jax.block_until_ready((new, m))
        return time.perf_counter() - t, new

    times = {name: [] for name in steps}
    compile_s = {name: 0.0 for name in steps}
    seen: dict[str, set] = {name: set() for name in steps}
    diffs = []
    load0 = os.getloadavg()
    for rep in range(args.repeats + 1):
        for ro, adv in batches:
            rows = packed_rows_of(ro, micro_batches=g.micro_batches)
            out = {}
            for name in steps:
                key = rows if name == "packed" else None
                first = key not in seen[name]
                seen[name].add(key)
                t, out[name] = update(name, ro, adv)
                if first:
                    compile_s[name] += t
                elif rep:
                    times[name].append(t)
            if rep == 0:
                diffs.append(max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                          / (np.max(np.abs(np.asarray(b))) + 1e-30))
                    for a, b in zip(jax.tree.leaves(out["packed"]),
                                    jax.tree.leaves(out["unpacked"]), strict=True)))
    ro = batches[0][0]
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    res = {"run": str(args.run), "step": step, "model": mcfg.family,
           "loop": str(loop), "method": g.logprobs, "recorded_value": recorded,
           "rows": b, "grid": [b * (p + n), b * n],
           "packed_rows": sorted(list(r) for r in seen["packed"]),
           "buckets": len(seen["packed"]), "batches": args.batches, "repeats": args.repeats,
           "loadavg_start": [round(x, 2) for x in load0],
           "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "max_rel_param_diff": max(diffs)}
    for name, ts in times.items():
        res[name] = {"median_s": round(statistics.median(ts), 4), "min_s": round(min(ts), 4),
                     "calls": len(ts), "compile_s": round(compile_s[name], 2)}
    res["unpacked_over_packed_median"] = round(res["unpacked"]["median_s"]
                                               / res["packed"]["median_s"], 3)
    return res


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
