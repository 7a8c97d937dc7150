"""The GRPO update with `layers.dot`'s one token axis against the einsum over the leading axes.

    python benchmarks/update_token_axis_ab.py [--rounds 12] [--size small] > out.json

`bench iteration`'s update at one minibatch (`make_grpo_step`, hybrid given the
rollout's log-probs, packed rows, the bench's loss and optimizer) on
`bench.learner.grpo_batch`'s batch (B = 8, 16 + 112 tokens, every completion to
the end), built twice in one process:
- `one_token_axis`: as the library runs it off a mesh (the activations'
  leading axes flattened before each matmul);
- `leading_axes`: `layers.dot` traced as under a mesh (`current_mesh` patched
  to say one is active while the step traces), the einsum over the leading
  axes that main ran before.
In both the norm weights' gradient is autodiff's reduce (`layers.scale_features`
patched to the plain product; it too reads the mesh).
Both start from the same weights and optimizer state, are called alternately
`--rounds` times after one warm-up call each, and report the fastest and the
median seconds. `same_bits` says whether their first updates left the same
parameters, and `same_gradient` whether the gradients of the dense loss are
the same bits (a dense preset: they are).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from _update_inputs import update_inputs

from jaxrl_lp.bench.learner import LOSS, SIZES
from jaxrl_lp.models import layers
from jaxrl_lp.rl.logprobs import dense_logprobs, packed_rows_of
from jaxrl_lp.rl.train_step import make_grpo_step


def _traced_as(form: str, fn):
    """`fn()` with `layers.dot` tracing the form named (the patch only lives during the call)."""
    real, scale = layers.current_mesh, layers.scale_features
    # The norm weights' gradient takes its form by the mesh too (`scale_features`): the plain
    # product in both, so that only the matmuls' token axes differ.
    layers.scale_features = lambda y, w: y * w
    if form == "leading_axes":
        layers.current_mesh = lambda: "traced as under a mesh"
    try:
        return fn()
    finally:
        layers.current_mesh, layers.scale_features = real, scale


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    cfg, policy, params, ro, adv, opt = update_inputs(args.size)
    batch = (ro, adv, ro.logprobs, None, None, ro.logprobs)
    rows = packed_rows_of(ro)

    def loss(p):
        lp, ent = dense_logprobs(p, cfg, policy, ro, packed_rows=rows)
        return jnp.sum(lp * adv[:, None] * ro.completion_mask) + 0.01 * jnp.sum(ent)

    forms = ("one_token_axis", "leading_axes")
    steps, states, first, grads = {}, {}, {}, {}
    for form in forms:
        steps[form] = make_grpo_step(cfg, policy, LOSS, opt, method="hybrid")
        state = (jax.tree.map(jnp.copy, params), opt.init(params))
        p, o, m = _traced_as(form, lambda s=steps[form], st=state: s(*st, *batch))  # compiles
        jax.block_until_ready(m["loss"])
        first[form], states[form] = jax.tree.map(jnp.copy, p), (p, o)  # the calls donate p
        grads[form] = _traced_as(form, lambda: jax.jit(jax.grad(loss))(params))
    load = os.getloadavg()[0]
    times = {form: [] for form in forms}
    for _ in range(args.rounds):
        for form in forms:
            t = time.perf_counter()
            p, o, m = steps[form](*states[form], *batch)
            jax.block_until_ready(m["loss"])
            times[form].append(time.perf_counter() - t)
            states[form] = (p, o)
    equal = lambda a, b: all(np.array_equal(x, y) for x, y in
                             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return {"preset": SIZES[args.size], "rounds": args.rounds,
            "loadavg_start": round(load, 2), "loadavg_end": round(os.getloadavg()[0], 2),
            "seconds": {form: {"min": round(min(ts), 3), "median": round(float(np.median(ts)), 3)}
                        for form, ts in times.items()},
            "leading_axes_over_one_token_axis": round(
                min(times["leading_axes"]) / min(times["one_token_axis"]), 3),
            "same_bits": equal(first["one_token_axis"], first["leading_axes"]),
            "same_gradient": equal(grads["one_token_axis"], grads["leading_axes"])}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
