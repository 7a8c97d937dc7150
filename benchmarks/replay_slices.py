"""Replay in row slices against the sampler's whole batch: how many log-probs differ, by how much.

    python benchmarks/replay_slices.py

The training program's behaviour log-probs run in `minibatches x micro_batches` row
slices (`jit_learner_logprobs(micro_batches=)`); the sampler ran the whole batch. On
XLA:CPU a matmul's rounding depends on its row count, so the sliced replay is not the
sampler's bits, which is why `grpo.verify_every` replays the batch in one pass
(docs/design.md, "Exact log-probs at the price of dense ones"). Prints one JSON object:
per model kind and slice count, the completion tokens whose log-prob differs from the
sampler's and the largest difference.
"""

import json

import jax
import numpy as np

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rl.logprobs import jit_learner_logprobs

PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (3, 3))  # 8 rows with 2 samples each


def main() -> dict:
    policy = Policy.parse("fp32")
    out = {"platform": jax.default_backend(), "rows": 2 * len(PROMPTS), "cells": {}}
    for kind in ("dense", "looped_dense", "looped_deferred"):
        cfg, params, loop = exactness_model(kind, loop_steps=2)
        ro = exactness_rollout(params, cfg, policy, loop, prompts=PROMPTS, num_samples=2,
                               max_new_tokens=8)
        mask = np.asarray(ro.completion_mask) > 0
        want = np.asarray(ro.logprobs)[mask]
        for slices in (1, 2, 4):
            got = np.asarray(jit_learner_logprobs(cfg, policy, "replay",
                                                  micro_batches=slices)(params, ro))[mask]
            out["cells"][f"{kind}/{slices}"] = {
                "tokens": int(mask.sum()), "differ": int((got != want).sum()),
                "max_abs_diff": float(np.max(np.abs(got - want)))}
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
