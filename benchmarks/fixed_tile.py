"""Whether a product gives a decode's row the bits the learner's parallel forward gives it, on
this device: XLA's own product against the fixed-tile kernel (`kernels.fixed_tile`), and what
the kernel costs beside XLA's.

    python benchmarks/fixed_tile.py --out docs/bench/fixed-tile-h200.json     # on a GPU
    python benchmarks/fixed_tile.py --interpret gpu --batch 4 --tokens 8 --widths 128x128

The learner's rows are B sequences of T tokens, `[B x T, K]`, row (b, t) at b x T + t; a
decode step t computes the B rows (b, t) alone, `[B, K]`, each at place b of its product.
For each weight width `K x N` (default: Qwen3-0.6B's projections, bf16, B 32, T 384) and
decode steps t = 0, T / 2, T - 1: the rows of the decode's product whose f32 bits differ from
the same rows of the learner's, for XLA's product (`jnp.dot`, f32 accumulation) and for the
kernel; the kernel's largest difference from the f32 product (relative to the largest value);
and the time of one product of each at the decode's rows and at the learner's (the median of
`--repeats` calls after a warm-up, each call a program of up to 50 products of other rows;
compiled only). One JSON object on stdout (and `--out`).

Off a GPU or TPU the kernel runs in Pallas's interpreter (`--interpret gpu`, the default
there): bits at small widths, no times. `SUITE=invariant benchmarks/gpu.sh` runs it on a GPU.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.kernels.fixed_tile import fixed_tile_product

QWEN3_0_6B = "1024x2048,1024x3072,3072x1024,2048x1024"


def _rows_differ(a, b) -> int:
    """Rows of `a` and `b` `[R, N]` whose f32 bits differ anywhere."""
    a = np.asarray(a, np.float32).view(np.uint32)
    b = np.asarray(b, np.float32).view(np.uint32)
    return int((a != b).any(axis=-1).sum())


def _median_ms(fn, x_MxK, w_KxN, repeats: int) -> float:
    """The median time of one product, of `repeats` calls each running `inner` products of
    other rows in one program (a decode's product is too short to time one a call)."""
    inner = max(1, min(50, 65536 // x_MxK.shape[0]))
    xs = jnp.stack([jnp.roll(x_MxK, i, axis=1) for i in range(inner)])
    many = jax.jit(lambda xs, w: jax.lax.scan(lambda c, x: (c, fn(x, w)), None, xs)[1])
    jax.block_until_ready(many(xs, w_KxN))  # compiled and warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(many(xs, w_KxN))
        times.append(time.perf_counter() - t)
    return round(1e3 * statistics.median(times) / inner, 5)


def cell(k: int, n: int, batch: int, tokens: int, dtype, interpret: str | None,
         repeats: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch * tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    xla = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    kernel = lambda a, b: fixed_tile_product(a, b, interpret=interpret)
    steps = sorted({0, tokens // 2, tokens - 1})
    out = {"decode_steps": steps, "rows_compared": batch * len(steps)}
    for name, fn in (("xla", xla), ("fixed_tile", kernel)):
        learner = np.asarray(fn(x, w)).reshape(batch, tokens, n)
        decode = [np.asarray(fn(x.reshape(batch, tokens, k)[:, t], w)) for t in steps]
        entry = {"rows_differ": sum(_rows_differ(d, learner[:, t])
                                    for d, t in zip(decode, steps, strict=True))}
        if name == "fixed_tile":
            want = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                                      precision="highest")).reshape(learner.shape)
            entry["max_rel_diff_vs_f32"] = float(np.abs(learner - want).max()
                                                 / np.abs(want).max())
        if not (name == "fixed_tile" and interpret):
            entry["ms_decode"] = _median_ms(fn, x[:batch], w, repeats=repeats)
            entry["ms_learner"] = _median_ms(fn, x, w, repeats=repeats)
        out[name] = entry
    if "ms_decode" in out["fixed_tile"]:
        out["fixed_tile_vs_xla"] = {
            part: round(out["fixed_tile"][f"ms_{part}"] / out["xla"][f"ms_{part}"], 4)
            for part in ("decode", "learner")}
    return out


def _note(interpret: str | None) -> str:
    if interpret is None:
        return "the kernel compiled for this device"
    note = f"the kernel in Pallas's {interpret} interpreter: bits and no times"
    if interpret == "gpu":
        note += (" (each wgmma a NumPy product of its tiles, whose BLAS may sum a row by its "
                 "place in the tile; whether a GPU's tensor cores do, a GPU measures)")
    return note


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=QWEN3_0_6B, help="KxN,KxN,...")
    parser.add_argument("--batch", type=int, default=32, help="B: the decode's rows")
    parser.add_argument("--tokens", type=int, default=384, help="T: tokens per sequence")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--interpret", choices=("gpu", "tpu"), default=None,
                        help="run the kernel's version for that platform in Pallas's "
                             "interpreter (default off a GPU or TPU: gpu)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    interpret = args.interpret or (None if backend in ("gpu", "tpu") else "gpu")
    widths = []
    for spec in args.widths.split(","):
        try:
            k, n = (int(v) for v in spec.lower().split("x"))
        except ValueError:
            parser.error(f"--widths: {spec!r} is not KxN (e.g. 1024x3072)")
        widths.append((k, n))
    if args.batch < 1 or args.tokens < 1:
        parser.error("--batch and --tokens are at least 1")
    report = {
        "target": "fixed-tile", "date": date.today().isoformat(),
        "device": jax.devices()[0].device_kind, "backend": backend, "jax": jax.__version__,
        "host": platform.processor() or platform.machine(), "dtype": args.dtype,
        "batch": args.batch, "tokens": args.tokens, "kernel": interpret or "compiled",
        "repeats": args.repeats,
        "note": _note(interpret),
        "cells": {f"{k}x{n}": cell(k, n, args.batch, args.tokens, jnp.dtype(args.dtype),
                                   interpret, args.repeats, args.seed) for k, n in widths},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
