"""The GRPO update with the layers stored stacked (scanned) against stored per layer (unrolled).

    python benchmarks/unstacked_update_ab.py [--size small] [--rounds 6] > out.json

The iteration bench's update (`make_grpo_step`, hybrid on the recorded
log-probs, packed, the bench's loss and optimizer, every completion full) on
the same batch, three ways, alternating after two warm-up calls each:
- `stacked`: the parameters as the program holds them, `layers` a dict of
  `[L, ...]` arrays, which the forward scans (`models.blocks.over_layers`);
- `unstacked_in_step`: the same parameters, unstacked inside the step
  (`unstack_layers` before the forward): the layer loop unrolls, but each
  layer's weights are sliced out and the gradient stacked back;
- `unstacked_storage`: the parameters and the optimizer state held per layer
  (`unstack_layers` once, before): nothing is sliced or stacked.
Each holds its own copy of the parameters and optimizer state and updates it
every call. Prints, per form, the compiled temporaries, the fastest and
median seconds of `--rounds` calls, and whether its parameters after all
calls are the stacked form's bits: not a promise of either unstacked form
(an unrolled loop fuses otherwise, and per-layer leaves sum the clip's
global norm in another order). A lead measured for the learner's layout,
not what the program does (it holds the layers stacked).
"""

from __future__ import annotations

import argparse
import json
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from _update_inputs import alternate_updates, update_inputs


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()

    from jaxrl_lp.bench.learner import LOSS, SIZES
    from jaxrl_lp.models import model
    from jaxrl_lp.models.blocks import unstack_layers
    from jaxrl_lp.rl.train_step import make_grpo_step

    cfg, policy, params, ro, adv, opt = update_inputs(args.size)
    batch = (ro, adv, ro.logprobs, None, None, ro.logprobs, None)
    forward = model.dense_forward

    def unstacking(params, *a, **k):
        return forward(unstack_layers(params), *a, **k)

    forms = {"stacked": (params, None), "unstacked_in_step": (params, unstacking),
             "unstacked_storage": (unstack_layers(params), None)}
    steps, states, temps = {}, {}, {}
    for name, (p, patch) in forms.items():
        p = jax.tree.map(jnp.copy, p)
        states[name] = [p, opt.init(p)]
        with mock.patch.object(model, "dense_forward", patch or forward):
            steps[name] = make_grpo_step(cfg, policy, LOSS, opt, method="hybrid",
                                         pack_buckets=16)
            temps[name] = steps[name].lower(*states[name], *batch).compile() \
                .memory_analysis().temp_size_in_bytes  # traced here, with the patch

    # The patch is only read when a step is traced (its first call).
    times = alternate_updates(
        steps, states, batch, args.rounds,
        lambda name: mock.patch.object(model, "dense_forward", forms[name][1] or forward))
    ref = jax.tree.leaves(states["stacked"][0])
    out = {}
    for name in forms:
        got = states[name][0]
        got = got if name != "unstacked_storage" else {
            **got, "layers": jax.tree.map(lambda *a: jnp.stack(a), *got["layers"])}
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(ref, jax.tree.leaves(got), strict=True))
        out[name] = {"temp_bytes": temps[name], "min_s": round(min(times[name]), 4),
                     "median_s": round(float(np.median(times[name])), 4),
                     "same_bits_as_stacked": same}
    return {"preset": SIZES[args.size], "rounds": args.rounds,
            "loadavg": [round(x, 2) for x in os.getloadavg()], **out}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
