"""Replay in row slices against the sampler's whole batch, by both constructions.

    python benchmarks/replay_slices.py > docs/bench/replay-slices-2core-cpu.json

A run replays its batch in `minibatches x micro_batches` row slices; the sampler ran the
whole batch. Per model kind and slice count, the completion tokens whose log-prob differs
from the sampler's, and the largest difference, for
- `exact`: `rollout.replay.replay_logprobs` (the sampler's own program, each row in its
  place in the sampler's call: docs/design/replay.md, "Replay == sampler by construction");
- `traced`: the former construction, the sampler's steps traced into a program of the
  slice's shape (`traced_replay_logprobs`, jitted): on XLA:CPU a matmul's rounding depends
  on its row count.
Prints one JSON object.
"""

import json
import platform

import jax
import numpy as np

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprobs import traced_replay_logprobs
from jaxrl_lp.rollout.generate import take_rows
from jaxrl_lp.rollout.replay import replay_logprobs

PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (3, 3))  # 8 rows with 2 samples each


def main() -> dict:
    policy = Policy.parse("fp32")
    out = {"platform": f"{jax.default_backend()} ({platform.processor() or platform.machine()})",
           "jax": jax.__version__, "rows": 2 * len(PROMPTS), "cells": {}}
    traced = jax.jit(traced_replay_logprobs, static_argnums=(1, 2))
    for kind in ("dense", "looped_dense", "looped_deferred"):
        cfg, params, loop = exactness_model(kind, loop_steps=2)
        ro = exactness_rollout(params, cfg, policy, loop, prompts=PROMPTS, num_samples=2,
                               max_new_tokens=8)
        mask = np.asarray(ro.completion_mask) > 0
        want = np.asarray(ro.logprobs)[mask]
        b = mask.shape[0]
        for slices in (1, 2, 4):
            size = b // slices
            parts = [take_rows(ro, np.arange(i, i + size)) for i in range(0, b, size)]
            for name, fn in (("exact", replay_logprobs), ("traced", traced)):
                got = np.concatenate([np.asarray(fn(params, cfg, policy, r))
                                      for r in parts])[mask]
                out["cells"][f"{kind}/{slices}/{name}"] = {
                    "tokens": int(mask.sum()), "differ": int((got != want).sum()),
                    "max_abs_diff": float(np.max(np.abs(got - want)))}
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
