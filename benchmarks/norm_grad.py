"""The norm weights' gradient as XLA:CPU's reduce against a product with ones.

    python benchmarks/norm_grad.py [--size small] [--rounds 6] > out.json

An RMSNorm weight's gradient is `g * y` summed over every token. Autodiff's
product `y * w` gives it as a reduce over the token axis, which XLA:CPU's
YNNPACK runs one element at a time; `models.layers.scale_features` computes
it on CPU as a product with a vector of ones. Two measurements, each form
alternating after a warm-up:
- `weight_grad`: the gradient alone, for a `[1, 1024, D]` input (the input
  and post-attention norms of the small preset's update) and a
  `[1, 1024, H, Dh]` one (its q and k norms): the fastest of 50 calls, in ms;
- `update`: the iteration bench's update (`make_grpo_step`, hybrid on the
  recorded log-probs, packed, the bench's loss and optimizer, every
  completion full), traced with `scale_features` as is and with it patched
  to the plain product: compiled temporaries, the fastest and median of
  `--rounds` calls, and whether the two give the same parameters (they do
  not: the norm weights' gradients sum in another order).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from unittest import mock

import jax
import numpy as np
from _update_inputs import alternate_updates, update_inputs


def _plain(y, w):
    return y * w


def _fastest_ms(fn, args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 3)


def weight_grads(shapes) -> dict:
    from jaxrl_lp.models.layers import scale_features

    out = {}
    for shape in shapes:
        ky, kg = jax.random.split(jax.random.PRNGKey(0))
        y, g = jax.random.normal(ky, shape), jax.random.normal(kg, shape)
        w = jax.numpy.ones(shape[-1:])
        fns = {name: jax.jit(lambda y, w, g, f=f: jax.vjp(f, y, w)[1](g)[1])
               for name, f in (("reduce", _plain), ("product", scale_features))}
        times = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(_fastest_ms(fn, (y, w, g), 50))
        out["x".join(map(str, shape))] = {name: min(t) for name, t in times.items()}
    return out


def updates(size: str, rounds: int) -> dict:
    from jaxrl_lp.bench.learner import LOSS
    from jaxrl_lp.models import layers
    from jaxrl_lp.rl.train_step import make_grpo_step

    cfg, policy, params, ro, adv, opt = update_inputs(size)
    batch = (ro, adv, ro.logprobs, None, None, ro.logprobs, None)
    forms = {"reduce": _plain, "product": layers.scale_features}
    steps, states, temps = {}, {}, {}
    for name, f in forms.items():
        p = jax.tree.map(jax.numpy.copy, params)
        states[name] = [p, opt.init(p)]
        with mock.patch.object(layers, "scale_features", f):  # read when the step is traced
            steps[name] = make_grpo_step(cfg, policy, LOSS, opt, method="hybrid",
                                         pack_buckets=16)
            temps[name] = steps[name].lower(*states[name], *batch).compile() \
                .memory_analysis().temp_size_in_bytes

    times = alternate_updates(
        steps, states, batch, rounds,
        lambda name: mock.patch.object(layers, "scale_features", forms[name]))
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(states["reduce"][0]), jax.tree.leaves(states["product"][0]),
                   strict=True))
    return {"same_bits": same, **{name: {
        "temp_bytes": temps[name], "min_s": round(min(times[name]), 4),
        "median_s": round(float(np.median(times[name])), 4)} for name in forms}}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    from jaxrl_lp.bench.learner import SIZES
    from jaxrl_lp.models.config import get_preset

    cfg = get_preset(SIZES[args.size])
    tokens = 8 * 128
    shapes = [(1, tokens, cfg.hidden_size), (1, tokens, cfg.num_heads, cfg.head_dim)]
    return {"preset": SIZES[args.size], "rounds": args.rounds,
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "weight_grad_ms": weight_grads(shapes), "update": updates(args.size, args.rounds)}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
