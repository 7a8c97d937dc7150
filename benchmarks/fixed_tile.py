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

With `--model PRESET` (random weights at the preset's shapes, bf16, `--prompts` x `--group`
rows of `--prompt-len` + `--new-tokens` tokens): the sampler in the invariant form whose
products are all fixed tiles (`InvariantForm(tiles=...)`, the weights' and the attention's)
against the learner's invariant forward of its rollout, whole and in halves: the tokens whose
log-prob differs in any bit (must be none); beside it the plain sampler against the dense
learner's forward (what an update compares without the forms), and the times of each
(the second call; compiled only).

Off a GPU or TPU the kernel runs in Pallas's interpreter (`--interpret gpu`, the default
there): bits at small widths, no times; the GPU interpreter sums a row by its place in a tile
(NumPy's BLAS), so its model cell differs where a GPU's need not, and `--interpret tpu` is the
CPU's check of the forms. `SUITE=invariant benchmarks/gpu.sh` runs it on a GPU.
"""

import argparse
import functools
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


def _entry(name, fn, x, w, batch, tokens, steps, interpret, repeats) -> dict:
    """One product's figures in a cell (`cell`)."""
    k, n = w.shape
    learner = np.asarray(fn(x, w)).reshape(batch, tokens, n)
    decode = [np.asarray(fn(x.reshape(batch, tokens, k)[:, t], w)) for t in steps]
    entry = {"rows_differ": sum(_rows_differ(d, learner[:, t])
                                for d, t in zip(decode, steps, strict=True))}
    if name == "fixed_tile":
        want = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                                  precision="highest")).reshape(learner.shape)
        entry["max_rel_diff_vs_f32"] = float(np.abs(learner - want).max() / np.abs(want).max())
    if not (name == "fixed_tile" and interpret):
        entry["ms_decode"] = _median_ms(fn, x[:batch], w, repeats=repeats)
        entry["ms_learner"] = _median_ms(fn, x, w, repeats=repeats)
    return entry


def cell(k: int, n: int, batch: int, tokens: int, dtype, interpret: str | None,
         repeats: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch * tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    xla = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    kernel = lambda a, b: fixed_tile_product(a, b, interpret=interpret)
    kernel = kernel if interpret else jax.jit(kernel)
    steps = sorted({0, tokens // 2, tokens - 1})
    out = {"decode_steps": steps, "rows_compared": batch * len(steps)}
    for name, fn in (("xla", xla), ("fixed_tile", kernel)):
        try:
            out[name] = _entry(name, fn, x, w, batch, tokens, steps, interpret, repeats)
        except Exception as e:  # noqa: BLE001 - recorded: XLA's figures stand without the kernel's
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if "ms_decode" in out["fixed_tile"] and "ms_decode" in out["xla"]:
        out["fixed_tile_vs_xla"] = {
            part: round(out["fixed_tile"][f"ms_{part}"] / out["xla"][f"ms_{part}"], 4)
            for part in ("decode", "learner")}
    return out


def _seconds(fn) -> tuple[object, float]:
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, round(time.perf_counter() - t, 4)


def model_cell(preset: str, prompts: int, group: int, prompt_len: int, new_tokens: int,
               tiles: str, seed: int) -> dict:
    """The sampler in the fixed-tile invariant form (`InvariantForm(tiles=...)`) against the
    learner's invariant forward of its rollout, whole and in halves, bf16 stored natively
    (bf16 arrays, what `auto` stores on a GPU); beside it the plain
    sampler against the dense learner's forward (what the updates compare without the forms).
    Random weights at the preset's shapes; times of a second call (the first compiles)."""
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics.invariant import InvariantForm
    from jaxrl_lp.numerics.policy import Policy

    policy = Policy.parse("bf16,s=native")  # bf16 arrays on any host: the GPU kernel's input
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    prompt_ids = [tuple(int(t) for t in rng.integers(4, cfg.vocab_size, prompt_len))
                  for _ in range(prompts)]
    form = InvariantForm(0, None, tiles)
    out = {"preset": preset, "rows": prompts * group, "prompt_len": prompt_len,
           "new_tokens": new_tokens, "form": form._asdict()}
    for name, layout, method in (("plain", None, "dense"),
                                 ("fixed_tiles", "invariant", "invariant")):
        try:
            out[name] = _model_pair(params, cfg, policy, prompt_ids, group, new_tokens, seed,
                                    layout, method, form)
        except Exception as e:  # noqa: BLE001 - recorded: the plain pair stands without it
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if tiles != "compiled" or any("error" in out[k] for k in ("plain", "fixed_tiles")):
        return out  # interpreted (bits, no comparable times), or a pair that failed
    out["fixed_tiles_vs_plain"] = {
        "sampler": round(out["fixed_tiles"]["sampler_s"] / out["plain"]["sampler_s"], 4),
        "learner_forward": round(out["fixed_tiles"]["learner_forward_s"]
                                 / out["plain"]["learner_forward_s"], 4)}
    return out


def _model_pair(params, cfg, policy, prompt_ids, group, new_tokens, seed, layout, method,
                form) -> dict:
    """One sampler and the learner forward that reads its rollout (`model_cell`)."""
    from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
    from jaxrl_lp.rollout.generate import generate, take_rows
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.train.behaviour import bit_mismatch

    sample = functools.partial(
        generate, params, cfg, prompt_ids, policy=policy,
        sampling=SamplingConfig(temperature=1.0), max_new_tokens=new_tokens, num_samples=group,
        eos_id=0, key=jax.random.PRNGKey(seed + 1), decode_layout=layout,
        invariant_form=form if layout else None)
    ro, first = _seconds(sample)
    ro, again = _seconds(sample)
    program = jit_learner_logprobs(cfg, policy, method, form=ro.invariant_form)
    if type(program).__name__ != "LogprobProgram":  # never the replay: it would equal by design
        raise RuntimeError(f"the {method} learner runs as {type(program).__name__} here")
    forward = functools.partial(program, params, ro)
    lp, learner_first = _seconds(forward)
    lp, learner_again = _seconds(forward)
    differ, tokens, worst = bit_mismatch(lp, ro.logprobs, ro.completion_mask)
    half = ro.completion_tokens.shape[0] // 2
    halves = [take_rows(ro, np.arange(i, i + half)) for i in (0, half)]
    in_halves = sum(bit_mismatch(program(params, r), r.logprobs, r.completion_mask)[0]
                    for r in halves)
    return {"decode_layout": ro.decode_layout, "learner": method, "tokens": tokens,
            "tokens_differ": differ, "max_abs_diff": worst, "tokens_differ_in_halves": in_halves,
            "sampler_s": again, "sampler_first_s": first, "learner_forward_s": learner_again,
            "learner_first_s": learner_first}


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
    parser.add_argument("--widths", default=QWEN3_0_6B, help="KxN,KxN,... ('' for none)")
    parser.add_argument("--batch", type=int, default=32, help="B: the decode's rows")
    parser.add_argument("--tokens", type=int, default=384, help="T: tokens per sequence")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--interpret", choices=("gpu", "tpu"), default=None,
                        help="run the kernel's version for that platform in Pallas's "
                             "interpreter (default off a GPU or TPU: gpu)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", default=None, metavar="PRESET",
                        help="also the whole model at PRESET (e.g. qwen3-0.6b): the sampler in "
                             "the fixed-tile invariant form against the learner's forward")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    interpret = args.interpret or (None if backend in ("gpu", "tpu") else "gpu")
    widths = []
    for spec in filter(None, args.widths.split(",")):
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
    if args.model:
        tiles = "compiled" if interpret is None else f"interpret-{interpret}"
        report["model"] = model_cell(args.model, args.prompts, args.group, args.prompt_len,
                                     args.new_tokens, tiles, args.seed)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
