"""The weights fingerprint's two forms on a preset's weights: seconds, temporaries, page faults.

    python benchmarks/fingerprint.py [--size small] [--repeats 7] > out.json

`numerics.fingerprint.tree_fingerprint` runs once per weight version: the
sampler takes it of the weights it ran (`Rollout.weights_digest`), and the
replay rule's check of the same arrays is then served from its cache. Its two
forms give the same bits: one reduction per leaf and lane (what GPU and TPU
lower), and, on CPU, `CHUNK`-element slices in a loop (XLA:CPU rewrites a long
reduction into a tree of windows that the hash cannot fuse into, so the
one-reduction form writes every hashed element to memory first). Each form is
compiled for this host, checked to give the same [2] uint32, and timed
alternately after a warm-up: the fastest of `--repeats`, the compiled
temporaries (`memory_analysis`), and the minor page faults of a call (fresh
memory the kernel zeroes; from `getrusage`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import jax
import numpy as np


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from jaxrl_lp.bench.learner import SIZES
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics import fingerprint

    cfg = get_preset(SIZES[args.size])
    params = init_params(cfg, jax.random.PRNGKey(0))
    spread = (False,) * len(jax.tree.leaves(params))
    forms = {name: jax.jit(lambda t, chunked=chunked: fingerprint._tree_sums(t, spread, chunked))
             for name, chunked in (("one_reduction", False), ("chunked_cpu", True))}
    out = {name: {} for name in forms}
    values = {}
    for name, fn in forms.items():
        out[name]["temp_bytes"] = fn.lower(params).compile().memory_analysis().temp_size_in_bytes
        values[name] = np.asarray(fn(params))
    assert np.array_equal(values["one_reduction"], values["chunked_cpu"]), values
    times = {name: [] for name in forms}
    faults = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, fn in forms.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            jax.block_until_ready(fn(params))
            times[name].append(time.perf_counter() - t)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    for name in forms:
        out[name] |= {"seconds": round(min(times[name]), 4),
                      "page_faults": int(np.median(faults[name]))}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return {"preset": SIZES[args.size], "weight_bytes": nbytes, "chunk": fingerprint.CHUNK,
            "fingerprint": [int(v) for v in values["chunked_cpu"]], "repeats": args.repeats,
            "loadavg": [round(x, 2) for x in os.getloadavg()], **out,
            "speedup": round(out["one_reduction"]["seconds"] / out["chunked_cpu"]["seconds"], 2)}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
