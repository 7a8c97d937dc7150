"""Where the compiled GRPO update of a preset spends its time, by XLA op (jax.profiler).

    python benchmarks/profile_update.py [--size small] [--full] [--products] [--steps 2] > out.json
    python benchmarks/profile_update.py --size qwen3-0.6b --policy bf16 --batch 32 \
        --prompt-len 128 --seq-len 384 --full --steps 1   # benchmarks/gpu.sh SUITE=profile

The update `jaxrl-lp bench iteration` runs at mu = 1 (`make_grpo_step`,
hybrid given the rollout's log-probs: `grpo.replay=auto`'s first update,
packed rows, the bench's loss and optimizer; `--products`: given the batch's
weight products too, `grpo.reuse_products`' first update) on `bench.learner.grpo_batch`'s
batch (B = 8, 16 prompt + 112 completion tokens; `--full`: every completion
runs to the end, as the iteration bench's no-EOS rollouts do). After two
warm-up calls, `--steps` calls run under `jax.profiler.trace`; the trace's
XLA op events (the CPU thunks: fusions, dots, copies) are summed per op and
divided by the steps, and each op is named by its HLO `op_name` (where in the
program it comes from: `jvp` the forward, `transpose(jvp)` the backward).
Prints one JSON object: the step's seconds, the ops' total, and the top ops.

On a shared machine the per-op times inflate with the load (the figures are
wall time of each op on its thread); read them as shares of the step. `--size` takes
`tiny`, `small` or a preset name; `--policy`, `--batch`, `--prompt-len` and `--seq-len`
set the batch. On a GPU the ops are the device's (`trace`: the lines they were read from).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
from _update_inputs import update_inputs
from _xla_ops import emit, op_names, op_times


def main() -> tuple[dict, str | None]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", help="tiny, small or a preset name")
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="every completion runs to the end")
    ap.add_argument("--pack-buckets", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--products", action="store_true",
                    help="the update of grpo.reuse_products: its forward reads the batch's "
                         "weight products (`rl.logprobs.forward_products`)")
    ap.add_argument("--out", help="also write the JSON to this file")
    args = ap.parse_args()

    from jaxrl_lp.bench.learner import LOSS, SIZES
    from jaxrl_lp.rl.train_step import make_grpo_step

    cfg, policy, params, ro, adv, opt = update_inputs(
        args.size, full=args.full, policy=args.policy, batch=args.batch,
        prompt_len=args.prompt_len, seq_len=args.seq_len)
    step = make_grpo_step(cfg, policy, LOSS, opt, method="hybrid", pack_buckets=args.pack_buckets)
    state = {"p": jax.tree.map(jnp.copy, params), "o": opt.init(params)}
    batch = (ro, adv, ro.logprobs, None, None, ro.logprobs)
    if args.products:
        from jaxrl_lp.rl.logprobs import forward_products

        batch = (*batch, jax.jit(forward_products, static_argnums=(1, 2))(params, cfg, policy, ro))

    def call():
        state["p"], state["o"], m = step(state["p"], state["o"], *batch)
        return jax.block_until_ready(m["loss"])

    call()
    call()
    names = op_names(step.lower(state["p"], state["o"], *batch).compile().as_text())
    seconds, total, count, trace = op_times(call, args.steps, names)
    ops = sum(total.values())
    result = {"preset": SIZES.get(args.size, args.size), "policy": args.policy,
             "device": jax.devices()[0].device_kind, "batch": args.batch,
             "seq_len": args.seq_len, "full_completions": args.full, "products": args.products,
             "pack_buckets": args.pack_buckets, "steps": args.steps,
             "loadavg": [round(x, 2) for x in os.getloadavg()],
             "step_s_under_profiler": round(seconds, 3), "ops_s": round(ops, 3), "trace": trace,
             "top": [{"op": name, "s": round(s, 4), "share": round(s / ops, 4),
                      "calls": count[name], "op_name": names[name][-160:]}
                     for name, s in total.most_common(args.top)]}
    return result, args.out


if __name__ == "__main__":
    emit(*main())
