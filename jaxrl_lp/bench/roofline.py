"""This machine's bounds for a GRPO iteration: its weight-stream bandwidth and f32 matmul rate.

`jaxrl-lp bench iteration` measures both in its own process and run, before
and after its race (the better of the two is used), and puts every phase it
times against the bound they give:

- `measure_weight_stream(cfg, batch)`: one decode step's matmuls alone, B rows
  against every matmul weight of a step (each layer's q, k, v, o, gate, up and
  down, and the output head: `decode_matrices`), `--steps` dependent steps in
  one jitted loop, in three forms: `x @ W` with W stored `[in, out]` (the
  decode layout `as_stored`), W stored `[out, in]` as the product's row
  operand (`W @ x.T`, transposed back: the `transposed` layout's product on
  CPU, `models.layers.TransposedWeight`), and the elementwise product
  reduced over `in` with W stored `[out, in]` (XLA's reduction emitter).
  The bandwidth is the fastest form's weight bytes per second: the most a
  batch-B matrix-vector pass gets out of this machine.
- `measure_matmul_rate(cfg, rows)`: the update's matmuls alone, f32, at its
  rows (the tokens of a minibatch): for every weight the forward `x @ W` and
  the backward's two (`g @ W.T`, `x.T @ g`), FLOPs over seconds.
- `phase_bounds(...)`: per phase, the least time at those rates.
  `sample`: every sampled token is one pass over the weights a decode step
  reads (`bench.sampler.weight_bytes`), so `tokens x bytes / bandwidth`.
  `update` (and a dense learner's `behaviour` forward): the compiled
  program's FLOPs (`plan.hlo_cost`: XLA's dot count with each loop body times
  its trip count; XLA's own `cost_analysis` counts a scanned layer once) over
  the matmul rate, and an update that replays (a later minibatch) at least
  its replay's decode loop's weight stream. Score and sync are host work and
  data movement, not bounded (0).
- `measure_machine` takes both rates once, `best_machine` keeps the better of
  the measurements before and after a race, and `add_bounds` puts a race's
  entries (ours and Tunix's, `bench.iteration`) against them.

Timing: each form alternates with the others, the fastest of `repeats` runs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxrl_lp.bench.sampler import weight_bytes
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.layers import TransposedWeight, dot
from jaxrl_lp.numerics.policy import FP32

F32 = FP32

__all__ = ["add_bounds", "best_machine", "decode_matrices", "measure_machine",
           "measure_matmul_rate", "measure_weight_stream", "phase_bounds"]


def decode_matrices(cfg: ModelConfig) -> list[tuple[int, int]]:
    """`(in, out)` of every matmul weight one pass of a decode step reads (one loop step)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer = [(d, cfg.num_heads * hd), (d, cfg.num_kv_heads * hd), (d, cfg.num_kv_heads * hd),
             (cfg.num_heads * hd, d), (d, f), (d, f), (f, d)]
    return layer * cfg.num_layers + [(d, cfg.vocab_size)]


def _weights(shapes, transposed: bool):
    key = jax.random.PRNGKey(0)
    return [0.02 * jax.random.normal(jax.random.fold_in(key, i), s[::-1] if transposed else s)
            for i, s in enumerate(shapes)]


def _best(calls: dict, repeats: int) -> dict:
    """Fastest seconds of each no-argument call, alternating (each is called once first)."""
    for fn in calls.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {name: min(ts) for name, ts in times.items()}


def measure_weight_stream(cfg: ModelConfig, batch: int, *, steps: int = 10,
                          repeats: int = 5) -> dict:
    """Weight bytes per second of a batch-`batch` matrix-vector pass over `cfg`'s matrices.

    Returns:
      `{"weight_bytes", "batch", "forms": {name: {"ms_per_step", "gb_per_s"}},
      "gb_per_s"}`, the last the faster form's (module docstring).
    """
    shapes = decode_matrices(cfg)
    nbytes = sum(i * o for i, o in shapes) * 4
    xs = {n: jax.random.normal(jax.random.PRNGKey(n), (batch, n)) for n in {i for i, _ in shapes}}

    def dot_in_out(x, w):  # the `as_stored` decode layout's product
        return x @ w

    def weights_major(x, w):  # the `transposed` decode layout's product on CPU
        return dot(x, TransposedWeight(w), F32)

    def reduce_out_in(x, w):
        return jnp.sum(w[:, None, :] * x[None], axis=-1).T

    def loop(product, weights, xs):
        def body(_, acc):
            # Every product reads the accumulator: no step can be hoisted or skipped.
            for (n, _), w in zip(shapes, weights, strict=True):
                acc = acc + jnp.sum(product(xs[n] + acc * 1e-9, w))
            return acc
        return jax.lax.fori_loop(0, steps, body, jnp.float32(0.0))

    calls = {}
    for name, product, transposed in (("dot_in_out", dot_in_out, False),
                                      ("weights_major_out_in", weights_major, True),
                                      ("reduce_out_in", reduce_out_in, True)):
        fn, weights = jax.jit(lambda w, x, p=product: loop(p, w, x)), _weights(shapes, transposed)
        calls[name] = lambda fn=fn, weights=weights: fn(weights, xs)
    best = _best(calls, repeats)
    forms = {name: {"ms_per_step": round(t / steps * 1e3, 3),
                    "gb_per_s": round(nbytes * steps / t / 1e9, 2)} for name, t in best.items()}
    return {"weight_bytes": nbytes, "batch": batch, "steps": steps, "forms": forms,
            "gb_per_s": max(f["gb_per_s"] for f in forms.values())}


def measure_matmul_rate(cfg: ModelConfig, rows: int, *, repeats: int = 3) -> dict:
    """f32 FLOP/s of the update's matmuls at `rows` tokens (module docstring).

    Returns:
      `{"rows", "shapes", "flops", "seconds", "gflop_per_s"}`: each distinct weight
      shape's three matmuls, timed together.
    """
    shapes = sorted(set(decode_matrices(cfg)))
    key = jax.random.PRNGKey(1)
    xs = {n: jax.random.normal(jax.random.fold_in(key, n), (rows, n))
          for n in {i for i, _ in shapes} | {o for _, o in shapes}}
    weights = _weights(shapes, False)

    @jax.jit
    def update(weights, xs):
        out = []
        for (i, o), w in zip(shapes, weights, strict=True):
            x, g = xs[i], xs[o]
            out += [x @ w, g @ w.T, x.T @ g]
        return out

    # Each distinct weight shape once: a model's layers repeat the same few.
    seconds = _best({"update": lambda: update(weights, xs)}, repeats)["update"]
    flops = 3 * 2 * rows * sum(i * o for i, o in shapes)
    return {"rows": rows, "shapes": [list(s) for s in shapes], "flops": flops,
            "seconds": round(seconds, 4), "gflop_per_s": round(flops / seconds / 1e9, 2)}


def phase_bounds(*, tokens: int, weight_bytes: int, bandwidth: float, matmul_rate: float,
                 update_flops: list[float], replays: list[bool], decode_steps: int,
                 behaviour_flops: float = 0.0) -> dict:
    """Least seconds of each phase of one iteration at `bandwidth` (B/s) and `matmul_rate`.

    Args:
      tokens: sampled tokens an iteration's decode loop produces per row (decode steps
        of the sampler, prefill included).
      weight_bytes: the weights one decode step reads.
      bandwidth, matmul_rate: the machine's (bytes/s, FLOP/s).
      update_flops: per update of the iteration, its compiled program's FLOPs.
      replays: per update, whether it replays (a decode loop of `decode_steps`).
      decode_steps: steps of a replay's decode loop.
      behaviour_flops: a dense learner's behaviour forward, 0 where none runs.

    Returns:
      `{"sample_s", "behaviour_s", "update_s", "iteration_s"}`.
    """
    stream = lambda steps: steps * weight_bytes / bandwidth
    update = sum(max(f / matmul_rate, stream(decode_steps) if r else 0.0)
                 for f, r in zip(update_flops, replays, strict=True))
    out = {"sample_s": stream(tokens), "behaviour_s": behaviour_flops / matmul_rate,
           "update_s": update}
    out["iteration_s"] = sum(out.values())
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def measure_machine(cfg: ModelConfig, batch: int, rows: int) -> dict:
    """This machine's weight-stream bandwidth at `batch` and f32 matmul rate at `rows`."""
    return {"weight_stream": measure_weight_stream(cfg, batch),
            "matmul": measure_matmul_rate(cfg, rows)}


def best_machine(before: dict, after: dict) -> dict:
    """Both measurements, and the rates the bounds use: the better of the two."""
    return {"before_race": before, "after_race": after,
            "weight_stream_gb_per_s": max(m["weight_stream"]["gb_per_s"] for m in (before, after)),
            "matmul_gflop_per_s": max(m["matmul"]["gflop_per_s"] for m in (before, after))}


def add_bounds(res: dict, ours: dict, cfg: ModelConfig, new_tokens: int, mbs: list[int],
               machine: dict) -> None:
    """Adds `bounds`, `fraction_of_bound` and `max_ratio_vs_tunix_at_bound` to a race's entries.

    Args:
      res: the race's entries by name (`<method>_mb<k>[_<draw>]`, `tunix_mb<k>`), each
        with its measured `iteration_s` and phase seconds; changed in place.
      ours: our entries' iteration objects (`bench.iteration_ours.OurIteration`: `params`,
        `method`, `minibatches`, `compiled_flops()`).
      cfg: the preset raced; new_tokens: sampled tokens per row; mbs: the minibatch
        counts raced; machine: `best_machine`'s rates.

    A Tunix entry is put against our first update's work, `k` times (the same work:
    `k` unreplayed updates; never a `products` update's, which skips its forward's
    matmuls). `max_ratio_vs_tunix_at_bound` is Tunix's measured iteration over our
    bound iteration.
    """
    nbytes = weight_bytes(cfg, next(iter(ours.values())).params)
    rates = dict(bandwidth=machine["weight_stream_gb_per_s"] * 1e9,
                 matmul_rate=machine["matmul_gflop_per_s"] * 1e9)
    common = dict(tokens=new_tokens, weight_bytes=nbytes, decode_steps=new_tokens, **rates)
    first_update = {}  # minibatches -> the first (unreplayed) update's FLOPs
    for name, it in ours.items():
        flops = it.compiled_flops()
        res[name]["compiled_flops"] = {"updates": flops["updates"], "behaviour": flops["behaviour"],
                                       "xla_cost_analysis_updates": flops["xla_updates"]}
        res[name]["bounds"] = phase_bounds(update_flops=flops["updates"],
                                           replays=flops["replays"],
                                           behaviour_flops=flops["behaviour"], **common)
        if it.method != "products":
            first_update.setdefault(it.minibatches, flops["updates"][0])
    for k in mbs:
        if f"tunix_mb{k}" in res and k in first_update:
            res[f"tunix_mb{k}"]["bounds"] = phase_bounds(
                update_flops=[first_update[k]] * k, replays=[False] * k, **common)
    for r in res.values():
        if not isinstance(r, dict) or "bounds" not in r:
            continue
        b = r["bounds"]
        r["fraction_of_bound"] = {
            phase: float(f"{b[f'{phase}_s'] / r[phase]:.4g}")
            for phase in ("sample", "behaviour", "update") if r.get(phase) and b[f"{phase}_s"]}
        r["fraction_of_bound"]["iteration"] = float(f"{b['iteration_s'] / r['iteration_s']:.4g}")
    for name, it in ours.items():
        theirs = res.get(f"tunix_mb{it.minibatches}")
        if theirs is not None:
            res[name]["max_ratio_vs_tunix_at_bound"] = round(
                theirs["iteration_s"] / res[name]["bounds"]["iteration_s"], 3)
