"""Our hybrid GRPO iteration before/after the fingerprint cache and with `grpo.draw=inverse_cdf`.

    python benchmarks/iteration_ab.py [--repeats 2] [--minibatches 1,4] > out.json

`jaxrl-lp bench iteration`'s own iteration (`bench.iteration._Iteration`, small
preset, B = 8, G = 4, 16 + 112 tokens, no EOS), in one process, alternating
(`bench.iteration._race_iterations`, the fastest run reported with its phase
split), per minibatch count:
- `<mb>_uncached`: the fingerprint cache off (`numerics.fingerprint.CACHE_SIZE`
  = 0 during the call): what main did before it.
- `<mb>`: the default (cache on, Gumbel-max draw).
- `<mb>_inverse_cdf`: cache on, `grpo.draw=inverse_cdf`.
Tunix is not raced (it needs its own venv, `bench.iteration`'s docstring).
"""

import argparse
import json
import os

import jax
import optax

from jaxrl_lp.bench.iteration import _Iteration, _prompts, _race_iterations, _summary
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics import fingerprint
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout import LoopSpec


def _uncached(fn):
    def call():
        size, fingerprint.CACHE_SIZE = fingerprint.CACHE_SIZE, 0
        fingerprint._cache.clear()
        try:
            return fn()
        finally:
            fingerprint.CACHE_SIZE = size
    return call


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--minibatches", default="1,4")
    args = ap.parse_args()
    cfg, policy = get_preset("small-qwen3"), Policy.parse("fp32")
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompts = _prompts(cfg, 2, 16, 0)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-6))
    calls = {}
    for k in [int(s) for s in args.minibatches.split(",")]:
        def it(draw="gumbel", k=k):
            return _Iteration(cfg, policy, params, prompts, optimizer, method="hybrid",
                              group=4, new_tokens=112, minibatches=k, loop=LoopSpec(),
                              pack_buckets=16, seed=0, draw=draw)
        calls[f"hybrid_mb{k}_uncached"] = _uncached(it())
        calls[f"hybrid_mb{k}"] = it()
        calls[f"hybrid_mb{k}_inverse_cdf"] = it("inverse_cdf")
    load0 = os.getloadavg()
    _, times, phases = _race_iterations(calls, args.repeats, 0.0)
    out = {"platform": f"{jax.default_backend()}, {os.cpu_count()} cores",
           "loadavg_start": [round(x, 2) for x in load0],
           "small-qwen3": _summary(times, phases, 8 * 112),
           "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    for name, ts in times.items():
        out["small-qwen3"][name]["all_iteration_s"] = [round(t, 3) for t in ts]
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
