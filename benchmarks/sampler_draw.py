"""The token draw alone and the sampler with it: `grpo.draw=gumbel` against `inverse_cdf`.

    python benchmarks/sampler_draw.py [--repeats 5] > out.json

- `draw_ms`: one jitted `draw_categorical` of a [8, 32000] f32 batch of logits
  (B = 8, the small preset's vocabulary), the fastest of `--repeats` timed
  blocks of 50 calls each, per call; `jax_random_categorical` is the same
  Gumbel draw as `jax.random.categorical` computes it (its `jnp.argmax`, which
  the sampler's `first_argmax` replaced: the same tokens), and
  `jax_random_gumbel_noise` the sampler's draw with JAX's own noise
  (`jax.random.gumbel`, its Threefry rounds a loop on CPU, which
  `rollout.noise` unrolls: the same bits), beside it.
- `noise_in_scan_ms`: the noise alone in the decode loop's form, 112 steps of
  a `lax.scan` each adding a key's [8, 32000] noise to the logits and taking
  the max, per step: `rollout.noise.gumbel` against `jax.random.gumbel`.
- `sampler_s`: `rollout.generate` on random small-qwen3 weights (f32), 8 rows of
  16 prompt tokens, 112 new tokens at temperature 1.0, the fastest of
  `--repeats` calls after a warm-up.
The two draws alternate within each repeat; the JSON carries the load average.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout import SamplingConfig, generate
from jaxrl_lp.rollout.noise import gumbel
from jaxrl_lp.rollout.sampling import DRAWS, draw_categorical, first_argmax


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    cfg = get_preset("small-qwen3")
    logits = jax.random.normal(jax.random.PRNGKey(0), (8, cfg.vocab_size))
    draws = {d: jax.jit(lambda k, x, d=d: draw_categorical(k, x, d)) for d in DRAWS}
    draws["jax_random_categorical"] = jax.jit(lambda k, x: jax.random.categorical(k, x, axis=-1))
    draws["jax_random_gumbel_noise"] = jax.jit(
        lambda k, x: first_argmax(jax.random.gumbel(k, x.shape, x.dtype) + x))
    params = init_params(cfg, jax.random.PRNGKey(1))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)).tolist()

    def sample(d):
        ro = generate(params, cfg, prompts, policy=Policy.parse("fp32"), max_new_tokens=112,
                      sampling=SamplingConfig(temperature=1.0, draw=d), key=jax.random.key(0))
        return jax.block_until_ready(ro.completion_tokens)

    def noise_scan(noise):
        def body(acc, i):
            k = jax.random.fold_in(jax.random.PRNGKey(3), i)
            return acc + jnp.sum(jnp.max(noise(k, logits.shape) + logits, axis=-1)), None
        return jax.jit(lambda: jax.lax.scan(body, jnp.float32(0), jnp.arange(112))[0])

    scans = {"rollout_noise": noise_scan(gumbel), "jax_random_gumbel": noise_scan(
        lambda k, shape: jax.random.gumbel(k, shape))}
    scan_ms = {name: [] for name in scans}
    for fn in scans.values():
        jax.block_until_ready(fn())
    draw_ms = {d: [] for d in draws}
    sampler_s = {d: [] for d in DRAWS}
    for d in draws:  # warm-up: compile them
        jax.block_until_ready(draws[d](jax.random.PRNGKey(2), logits))
        if d in DRAWS:
            sample(d)
    load = os.getloadavg()[0]
    for r in range(args.repeats):
        for name, fn in scans.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            scan_ms[name].append((time.perf_counter() - t0) / 112 * 1e3)
        for d in draws:
            t0 = time.perf_counter()
            for i in range(50):
                out = draws[d](jax.random.PRNGKey(i + 50 * r), logits)
            jax.block_until_ready(out)
            draw_ms[d].append((time.perf_counter() - t0) / 50 * 1e3)
            if d not in DRAWS:
                continue
            t0 = time.perf_counter()
            sample(d)
            sampler_s[d].append(time.perf_counter() - t0)
    print(json.dumps({
        "loadavg_start": round(load, 2), "loadavg_end": round(os.getloadavg()[0], 2),
        "draw_ms": {d: round(min(v), 3) for d, v in draw_ms.items()},
        "noise_in_scan_ms": {n: round(min(v), 3) for n, v in scan_ms.items()},
        "sampler_s": {d: round(min(v), 3) for d, v in sampler_s.items()},
        "repeats": args.repeats}, indent=2))


if __name__ == "__main__":
    main()
