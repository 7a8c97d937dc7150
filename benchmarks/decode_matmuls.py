"""The matmuls of one decode step of a dense preset, alone: how fast XLA streams the weights.

Prints one JSON object: for B rows (default 8, the learner bench's batch)
and every matmul of one decode step of the preset (8 layers' q, k, v, o,
gate, up, down and the lm head of `small-qwen3`), the time per step and the
weight bytes per second, three ways:

- `dot_in_out`: `x @ W` with W stored `[in, out]`, the model's layout;
- `dot_out_in`: the same product with W stored `[out, in]`;
- `dot_out_in_weights_major`: W stored `[out, in]` as the dot's row
  operand (`W @ x.T`, the product `[out, B]`, transposed back): the
  decode layout `transposed`'s product, `models.layers.dot` itself;
- `dot_in_out_weights_major`: W as stored, `[in, out]`, contracted over its
  first axis as the row operand (no copy; XLA:CPU transposes it every call);
- `multiply_reduce_out_in`: `sum(W[:, None, :] * x[None], -1)` (XLA's
  reduction emitter instead of its dot);
- `multiply_reduce_transposed_in_loop`: the same with W stored `[in, out]`
  and transposed inside the loop (whether XLA hoists the transpose out).

Each form runs `--steps` dependent steps in one jitted `fori_loop` (the input
of every matmul depends on the previous step, so nothing is hoisted), the
forms alternating, fastest of `--repeats`. It bounds what a faster decode
layout could give the sampler and the hybrid learner's replay
(docs/design/learner_step.md, "Learner step time on CPU").

    python benchmarks/decode_matmuls.py [--preset small-qwen3] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.layers import TransposedWeight, dot
from jaxrl_lp.numerics.policy import Policy


def _shapes(cfg) -> list[tuple[int, int]]:
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer = [(d, cfg.num_heads * hd), (d, cfg.num_kv_heads * hd), (d, cfg.num_kv_heads * hd),
             (cfg.num_heads * hd, d), (d, f), (d, f), (f, d)]
    return layer * cfg.num_layers + [(d, cfg.vocab_size)]


def _products():
    def dot_in_out(x, w_in_out):
        return x @ w_in_out

    def dot_out_in(x, w_out_in):
        return jax.lax.dot_general(x, w_out_in, (((1,), (1,)), ((), ())))

    def dot_out_in_weights_major(x, w_out_in):
        # The decode's own product in the `transposed` layout (`models.layers.TransposedWeight`).
        return dot(x, TransposedWeight(w_out_in), Policy.parse("fp32"))

    def dot_in_out_weights_major(x, w_in_out):
        # The same with W as stored, `[in, out]`, contracted over its first axis.
        y = jax.lax.dot_general(w_in_out, x, (((0,), (1,)), ((), ())))
        return jax.lax.optimization_barrier(y).T

    def multiply_reduce_out_in(x, w_out_in):
        return jnp.sum(w_out_in[:, None, :] * x[None], axis=-1).T

    def multiply_reduce_transposed_in_loop(x, w_in_out):
        return multiply_reduce_out_in(x, w_in_out.T)

    return {"dot_in_out": (dot_in_out, False), "dot_out_in": (dot_out_in, True),
            "dot_out_in_weights_major": (dot_out_in_weights_major, True),
            "dot_in_out_weights_major": (dot_in_out_weights_major, False),
            "multiply_reduce_out_in": (multiply_reduce_out_in, True),
            "multiply_reduce_transposed_in_loop": (multiply_reduce_transposed_in_loop, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    shapes = _shapes(cfg)
    key = jax.random.PRNGKey(0)
    ws = [0.02 * jax.random.normal(jax.random.fold_in(key, i), s) for i, s in enumerate(shapes)]
    xs = {n: jax.random.normal(jax.random.fold_in(key, n), (args.batch, n))
          for n in {s[0] for s in shapes}}
    weight_bytes = int(sum(np.prod(s) for s in shapes) * 4)
    runs, outs = {}, {}
    for name, (product, transposed) in _products().items():
        weights = [w.T.copy() if transposed else w for w in ws]

        def loop(weights, xs, product=product):
            def body(_, acc):
                for (n, _out), w in zip(shapes, weights, strict=True):
                    acc = acc + product(xs[n] + acc * 1e-9, w).sum()
                return acc
            return jax.lax.fori_loop(0, args.steps, body, jnp.float32(0.0))

        fn = jax.jit(loop)
        outs[name] = float(fn(weights, xs))  # compile and warm up
        runs[name] = (fn, weights)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (fn, weights) in runs.items():
            t = time.perf_counter()
            fn(weights, xs).block_until_ready()
            times[name].append((time.perf_counter() - t) / args.steps)
    res = {"preset": args.preset, "batch": args.batch, "weight_bytes": weight_bytes,
           "platform": jax.devices()[0].device_kind, "steps": args.steps,
           "repeats": args.repeats}
    for name, ts in times.items():
        best = min(ts)
        res[name] = {"ms_per_step": round(best * 1e3, 2),
                     "weight_gb_per_s": round(weight_bytes / best / 1e9, 2),
                     "result_rel_diff": abs(outs[name] - outs["dot_in_out"])
                     / max(abs(outs["dot_in_out"]), 1e-30)}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
