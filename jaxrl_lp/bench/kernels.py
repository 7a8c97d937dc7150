"""The kernel benchmark: each Pallas kernel against its jnp reference, time and compiled memory.

Cases, per shape set (`SHAPES`: `tiny` for tests, `small` CPU-friendly, `full`
production sizes):

- `logprob_fwd_bwd`: value and gradients (d/dh, d/dW) of a weighted sum of the
  chosen tokens' log-probs and entropies (`kernels.logprob.fused_logprobs`),
  by the kernel, by its jnp reference (a scan over vocabulary tiles, `k=off`),
  by the plain path (materialized `[T, V]` logits, `log_softmax`) and by
  `tiled_readout` (XLA's scan over wide tiles with the plain path's products:
  what a GPU program reads out by, so the figure a GPU kernel must beat);
  on a GPU under `--kernels retired` also by `tiled_readout` with the Mosaic GPU
  forward (`kernels.logprob_mgpu`, the port; `mosaic`). `logprob_fwd`: the same
  forwards alone.
- `quantize_<fmt>`, `dequantize_<fmt>` for mxfp8, mxfp4, nvfp4: a weight
  `[in, out]` along axis 0, as the quantize exporter does (`kernels.quantize`
  against `numerics.formats.quantize` / `qarray.dequantize`).
- `decode_attention`: one token per sequence over a full KV cache with left
  padding (`kernels.decode_attention` against `models.attention.attention`).

Each implementation is jitted once (`jax.jit(f).lower(...).compile()`); its
memory is XLA's analysis of that program (`plan.roofline.memory_figures`:
`peak = argument + output - alias + temp + generated_code`), and the same
executable is timed, implementations alternating after a warm-up
(`bench.sampler._race`, the fastest run reported). `max_abs_diff` compares
each output with the reference's (f32, over every output leaf).

On CPU the kernel runs in Pallas interpret mode: correctness only, its times
say nothing of kernel speed, and by default the `full` shapes are compiled for
their memory analysis but not run (`--time-full`). On a TPU the kernel is
compiled (`k=on`). On a GPU our versions are retired from compiled use
(`kernels.dispatch.RETIRED`): `--kernels retired` compiles them there all the
same (`k=on` inside `kernels.dispatch.unretired`), to measure what they would
give and cost against XLA's path, which is what a GPU program runs. Compiled,
the memory-bound cases (quantize, decode attention) are
put against the HBM roofline: bytes moved at least (arguments + outputs) over
time against the device's bandwidth (`plan.targets` by device name, a small
table here for others, or `--hbm-gbps`); decode adds tokens/s (one token per
sequence per call) and the roofline's tokens/s. The fused log-prob reports
model TFLOP/s (6 T D V for forward and backward) against the dense bf16 peak.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time

import jax
import jax.numpy as jnp

from jaxrl_lp.bench.sampler import _race  # the one alternating race of the benchmarks
from jaxrl_lp.kernels import KernelUnavailableError, kernel_backend, logprob_mgpu
from jaxrl_lp.kernels import quantize as kq
from jaxrl_lp.kernels.decode_attention import decode_attention, plan_chunk
from jaxrl_lp.kernels.dispatch import interpreting, unretired
from jaxrl_lp.kernels.logprob import BLOCK_V, fused_logprobs, tiled_readout
from jaxrl_lp.models.attention import attention
from jaxrl_lp.numerics.policy import PRESETS, Policy, policy_arg
from jaxrl_lp.plan.roofline import memory_figures

__all__ = ["FORMATS", "SHAPES", "add_arguments", "device_peaks", "run"]

FORMATS = ("mxfp8", "mxfp4", "nvfp4")
# logprob: T tokens, D hidden, V vocab; quantize: a weight [rows, cols]; decode: B sequences,
# H query heads, K kv heads, Dh head width, S cache slots. `small` fits the compiled kernels'
# tiles too (powers of two where they need them), `tiny` has a ragged vocabulary tile.
SHAPES = {
    "tiny": dict(logprob=dict(t=32, d=64, v=1000), quantize=dict(rows=64, cols=256),
                 decode=dict(b=2, h=4, k=2, dh=16, s=64)),
    "small": dict(logprob=dict(t=256, d=256, v=32000), quantize=dict(rows=256, cols=1024),
                  decode=dict(b=8, h=16, k=8, dh=128, s=512)),
    "full": dict(logprob=dict(t=4096, d=1024, v=151936), quantize=dict(rows=1024, cols=3072),
                 decode=dict(b=64, h=16, k=8, dh=128, s=2048)),
}
INTERPRET_NOTE = "interpret (correctness only, times are not kernel speed)"
# Devices `plan.targets` lacks: (HBM bytes/s, dense bf16 FLOP/s), NVIDIA data sheets (SXM).
EXTRA_PEAKS = {"a100": (2.039e12, 312e12)}
TEMPERATURE = 1.0
SUMMARY_KEYS = ("time_s", "max_rel_diff", "tokens_per_s", "roofline_tokens_per_s", "hbm_fraction",
                "mfu")


def device_peaks(hbm_gbps: float | None = None, peak_tflops: float | None = None) -> dict:
    """HBM bandwidth and dense bf16 peak of the default device, with where they come from."""
    from jaxrl_lp.kernels.targets import host_target
    from jaxrl_lp.plan.targets import TARGETS

    kind = jax.devices()[0].device_kind
    key = kind.lower().replace("-", " ")
    known = {n: (t.hbm_bandwidth, t.peak_flops) for n, t in TARGETS.items()} | EXTRA_PEAKS
    host = host_target()  # the kernel targets know JAX's spellings ("TPU v5 lite" is v5e)
    name = host.name if host is not None and host.name in known else next(
        (n for n in known if n.replace("-", " ") in key), None)
    bw, flops = known[name] if name else (None, None)
    src = f"peaks of {name!r} for {kind}" if name else f"no peaks known for {kind}"
    if hbm_gbps:
        bw, src = hbm_gbps * 1e9, src + "; --hbm-gbps"
    if peak_tflops:
        flops, src = peak_tflops * 1e12, src + "; --peak-tflops"
    return {"device": kind, "hbm_bytes_per_s": bw, "peak_flops": flops, "source": src}


# ----------------------------------------------------------------- the cases
def _logprob_cases(t, d, v, policy: Policy, mode: str, mosaic: str | None = None) -> dict:
    """{case: (abstract args, inputs maker, {impl: fn}, extra)} of the fused log-prob: its
    forward and backward (`logprob_fwd_bwd`, model FLOPs 6 T D V) and its forward alone
    (`logprob_fwd`, 2 T D V: a learner forward's log-probs without a gradient).

    `mosaic` ("mosaic" compiled, "mosaic-interpret") adds `tiled_readout` with the Mosaic GPU
    forward (`kernels.logprob_mgpu`) where the operands fit it; `extra["mosaic"]` says why
    it is absent otherwise."""
    carrier = policy.carrier_dtype
    args = (jax.ShapeDtypeStruct((t, d), carrier), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.bool_),
            jax.ShapeDtypeStruct((2, t), jnp.float32))

    def inputs():
        k = jax.random.split(jax.random.PRNGKey(0), 4)
        return (jax.random.normal(k[0], (t, d)).astype(carrier),
                0.3 * jax.random.normal(k[1], (d, v)), jax.random.randint(k[2], (t,), 0, v),
                jnp.arange(t) % 4 != 1, jax.random.normal(k[3], (2, t)))

    def grads(readout):
        def loss(h, w, tokens, mask, g):
            lp, ent = readout(h, w, tokens, mask)
            return jnp.sum(g[0] * lp + g[1] * ent)
        return jax.value_and_grad(loss, (0, 1))

    def values(readout):
        return lambda h, w, tokens, mask, g: readout(h, w, tokens, mask)

    def plain(h, w, tokens, mask):
        z = jnp.einsum("td,dv->tv", h, policy.round_params(w), preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST)  # no TF32 on GPU: as the fused paths
        # Upcast: log-probs and entropies are f32 from the policy-rounded logits.
        lp = jax.nn.log_softmax(policy.round_logits(z) / TEMPERATURE, axis=-1)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
        return jnp.where(mask, chosen, 0.0), jnp.where(mask, ent, 0.0)

    # Compiled (`k=on`), `fused_logprobs` plans the platform's tile (`logprob_gpu.plan_tiles`,
    # `logprob_tpu.tpu_tiles`), as under `k=auto`; interpreted, any tile runs.
    tiles = {} if mode == "on" else dict(block_t=16, block_v=BLOCK_V)
    fused = lambda pol, **kw: (lambda h, w, tokens, mask: fused_logprobs(
        h, w, tokens, TEMPERATURE, pol, mask_T=mask, **kw))
    # What a GPU program reads out by (`readout_logprobs` where no kernel runs off the CPU).
    tiled = lambda forward: (lambda h, w, tokens, mask: tiled_readout(
        h, policy.round_params(w), tokens, mask, TEMPERATURE, policy, forward=forward))
    readouts = {"plain": plain, "reference": fused(policy.replace(kernels="off")),
                "tiled": tiled("xla"), "kernel": fused(policy.replace(kernels=mode), **tiles)}
    extra = {"tiles": tiles}
    if mosaic is not None:
        why = logprob_mgpu.misfit(d, v, carrier, policy.round_params(jnp.zeros((), jnp.float32)).dtype)
        if why is None:
            readouts["mosaic"] = tiled(mosaic)
        else:
            extra["mosaic"] = f"not run: {why}"
    return {"logprob_fwd_bwd": (args, inputs, {k: grads(f) for k, f in readouts.items()},
                                extra | {"flops": 6.0 * t * d * v}),
            "logprob_fwd": (args, inputs, {k: values(f) for k, f in readouts.items()},
                            extra | {"flops": 2.0 * t * d * v})}


def _quantizer(fmt: str, kernels: str):
    return lambda x: kq.quantize(x, fmt, 0, kernels=kernels)


def _dequantizer(kernels: str):
    return lambda q: kq.dequantize(q, kernels=kernels)


def _quantize_cases(rows, cols, policy: Policy, mode: str):
    """{case: (abstract args, inputs maker, {impl: fn}, extra)} for quantize and dequantize."""
    x = jax.ShapeDtypeStruct((rows, cols), policy.carrier_dtype)
    make_x = lambda: jax.random.normal(jax.random.PRNGKey(1), (rows, cols)).astype(x.dtype)
    cases = {}
    for fmt in FORMATS:
        ref = _quantizer(fmt, "off")
        cases[f"quantize_{fmt}"] = ((x,), lambda: (make_x(),),
                                    {"reference": ref, "kernel": _quantizer(fmt, mode)}, {})
        cases[f"dequantize_{fmt}"] = ((jax.eval_shape(ref, x),),
                                      lambda ref=ref: (jax.jit(ref)(make_x()),),
                                      {"reference": _dequantizer("off"), "kernel": _dequantizer(mode)},
                                      {})
    return cases


def _decode_case(b, h, k, dh, s, policy: Policy, mode: str):
    """The flash-decoding kernel against `models.attention.attention`: one query token per sequence."""
    carrier = policy.carrier_dtype
    args = (jax.ShapeDtypeStruct((b, 1, h, dh), carrier),
            *[jax.ShapeDtypeStruct((b, k, s, dh), carrier)] * 2,
            jax.ShapeDtypeStruct((b, 1), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32))

    def inputs():
        keys = jax.random.split(jax.random.PRNGKey(2), 3)
        pad = (jnp.arange(b) % 4) * (s // 16)  # left padding, different per sequence
        k_pos = jnp.arange(s)[None] - pad[:, None]
        return (jax.random.normal(keys[0], (b, 1, h, dh)).astype(carrier),
                jax.random.normal(keys[1], (b, k, s, dh)).astype(carrier),
                jax.random.normal(keys[2], (b, k, s, dh)).astype(carrier),
                (s - 1 - pad)[:, None], jnp.where(k_pos >= 0, k_pos, -1))

    ref_policy, ker_policy = policy.replace(kernels="off"), policy.replace(kernels=mode)
    fns = {"reference": lambda *a: attention(*a, ref_policy),
           "kernel": lambda *a: decode_attention(*a, ker_policy)}
    # The chunk of the version that runs here: this host's platform's plan (the GPU version's
    # when interpreted), at the query rows the kernel pads the G heads of a kv head to.
    platform = "tpu" if kernel_backend() == "tpu" or interpreting(mode) == "tpu" else "cuda"
    rows = max(16, 1 << (h // k - 1).bit_length())
    chunk, _ = plan_chunk(platform, s, rows, dh, carrier)
    return args, inputs, fns, {"tokens": b, "chunk": chunk, "chunk_platform": platform}


# ----------------------------------------------------------------- measuring one case
def _diffs(a, b) -> dict:
    """Largest |a - b| over the output leaves, absolute and relative to the leaf's max |b|."""
    absolute, relative = 0.0, 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if not x.size:
            continue
        # Upcast: every output leaf (f32, bf16, fp8/fp4 codes, scales) compared in f32.
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        d = float(jnp.max(jnp.abs(x - y)))
        absolute, relative = max(absolute, d), max(relative, d / max(float(jnp.max(jnp.abs(y))), 1e-30))
    return {"max_abs_diff": absolute, "max_rel_diff": relative}


def _measure(args, inputs, fns, extra, *, timed: bool, repeats: int, min_time: float,
             inner: int, peaks: dict | None) -> dict:
    """Compile each implementation on abstract `args`; memory of each, and times when `timed`."""
    out, compiled = dict(extra), {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(*args).compile()
        out[name] = {"compile_s": round(time.perf_counter() - t0, 3),
                     "memory": memory_figures(compiled[name])}
    if not timed:
        return out
    arrays = jax.block_until_ready(inputs())
    def call(c):  # `inner` launches back to back: the dispatch overlaps the device's work
        for _ in range(inner - 1):
            c(*arrays)
        return jax.block_until_ready(c(*arrays))

    calls = {n: (lambda c=c: call(c)) for n, c in compiled.items()}
    _, times, outs = _race(calls, repeats, min_time)
    for name in fns:
        best = min(times[name]) / inner
        out[name].update(time_s=round(best, 7), runs=len(times[name]), launches_per_run=inner)
        if name != "reference":
            out[name].update(_diffs(outs[name], outs["reference"]))
        if peaks and peaks["hbm_bytes_per_s"] and "flops" not in extra:
            # Memory-bound: every argument read and every output written once, at least.
            m = out[name]["memory"]
            moved = m["argument"] + m["output"]
            out[name]["hbm_fraction"] = round(moved / best / peaks["hbm_bytes_per_s"], 4)
            if "tokens" in extra:
                out[name]["tokens_per_s"] = round(extra["tokens"] / best, 1)
                out[name]["roofline_tokens_per_s"] = round(
                    extra["tokens"] * peaks["hbm_bytes_per_s"] / moved, 1)
        if peaks and peaks["peak_flops"] and "flops" in extra:
            out[name]["model_tflops_per_s"] = round(extra["flops"] / best / 1e12, 3)
            out[name]["mfu"] = round(extra["flops"] / best / peaks["peak_flops"], 4)
    for ours in ("kernel", "mosaic"):
        for other in ("reference", "tiled"):
            if ours in fns and other in fns:
                out[f"{ours}_speedup_vs_{other}"] = round(out[other]["time_s"]
                                                          / out[ours]["time_s"], 3)
    return out


def _shape_set(name: str, policy: Policy, mode: str, *, timed: bool, repeats: int,
               min_time: float, inner: int, peaks: dict | None, only: list[str] | None,
               mosaic: str | None = None) -> dict:
    shapes = SHAPES[name]
    cases = _logprob_cases(**shapes["logprob"], policy=policy, mode=mode, mosaic=mosaic)
    cases |= _quantize_cases(**shapes["quantize"], policy=policy, mode=mode)
    cases["decode_attention"] = _decode_case(**shapes["decode"], policy=policy, mode=mode)
    res = {"shapes": shapes, "timed": timed}
    for case, (args, inputs, fns, extra) in cases.items():
        if only and not any(case.startswith(o) for o in only):
            continue
        try:
            res[case] = _measure(args, inputs, fns, extra, timed=timed, repeats=repeats,
                                 min_time=min_time, inner=inner, peaks=peaks)
        except Exception as e:  # one failing kernel (e.g. a GPU lowering) must not hide the rest
            res[case] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return res


# ----------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench kernels`."""
    parser.add_argument("--shapes", default="small,full",
                        help=f"shape sets, comma-separated, of {list(SHAPES)} (module SHAPES)")
    parser.add_argument("--policy", default=None, type=policy_arg,
                        help="precision policy (no matmul_format); default: bf16 where Pallas "
                             "compiles (native bf16 on GPU), fp32 on CPU. Its k= is replaced "
                             "by --kernels")
    parser.add_argument("--kernels", default="auto",
                        choices=("auto", "on", "interpret", "retired"),
                        help="how the kernel side runs; auto: compiled (on) where Pallas "
                             "compiles, interpreted elsewhere; retired: on a GPU, our retired "
                             "GPU versions compiled all the same, against XLA's path")
    parser.add_argument("--time-full", default="auto", choices=("auto", "yes", "no"),
                        help="run the 'full' shapes (not only their memory analysis); auto: "
                             "only where the kernel is compiled (interpreted they take too long)")
    parser.add_argument("--cases", default="",
                        help="only cases whose names start with these (comma-separated: "
                             "logprob, quantize, dequantize, decode); default all")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each after warm-up (at least; see --min-time)")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="keep alternating until each took about this many seconds")
    parser.add_argument("--inner", type=int, default=None,
                        help="launches per timed run (the time is per launch); default 1 "
                             "interpreted, 10 compiled (amortizes the dispatch)")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="HBM bandwidth for the roofline (default: by device name)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak for the MFU (default: by device name)")


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark; returns one JSON-serializable dict."""
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if bad := [s for s in names if s not in SHAPES]:
        raise ValueError(f"--shapes: unknown {bad}; allowed: {list(SHAPES)}")
    if args.repeats < 1 or (args.inner is not None and args.inner < 1):
        raise ValueError("--repeats and --inner must be >= 1")
    # Whether this host runs compiled kernels: a question about the machine the benchmark
    # times on (the programs themselves choose by the platform they are lowered for).
    retired = args.kernels == "retired"
    if retired and jax.default_backend() != "gpu":
        raise KernelUnavailableError(f"--kernels retired compiles our retired GPU versions, on a "
                                     f"GPU host; this one is {jax.default_backend()}: use "
                                     "--kernels interpret (their maths, interpreted)")
    compiles = kernel_backend() is not None or retired
    policy = args.policy or (PRESETS["bf16"] if compiles else PRESETS["fp32"])
    if policy.matmul_format is not None:
        raise ValueError(f"--policy {policy}: the fused log-prob takes no matmul_format")
    mode = "on" if retired else (
        args.kernels if args.kernels != "auto" else ("on" if compiles else "interpret"))
    if mode == "on" and not compiles:
        raise KernelUnavailableError(f"--kernels on: the {jax.default_backend()} backend cannot "
                                     "compile Pallas kernels; use --kernels interpret (or auto)")
    interpreted = mode == "interpret"
    time_full = args.time_full == "yes" or (args.time_full == "auto" and not interpreted)
    peaks = None if interpreted else device_peaks(args.hbm_gbps, args.peak_tflops)
    only = [c.strip() for c in args.cases.split(",") if c.strip()] or None
    inner = args.inner or (1 if interpreted else 10)
    out = {
        "target": "kernels",
        "platform": f"{platform.machine()} {jax.default_backend()}, {os.cpu_count()} cores, "
                    f"{jax.devices()[0].device_kind}",
        "jax": jax.__version__, "loadavg_start": round(os.getloadavg()[0], 2),
        "policy": str(policy.replace(kernels=mode)),
        "kernel_mode": INTERPRET_NOTE if interpreted else (
            "compiled, the retired GPU versions (k=on inside kernels.dispatch.unretired)"
            if retired else f"compiled (k={mode})"),
        "peak_bytes": "plan.roofline.memory_figures of the compiled program: argument + output "
                      "- alias + temp + generated_code",
        "full_shapes": ("timed" if time_full else
                        "memory analysis only, not run: interpreted at these sizes they would take "
                        "too long (--time-full yes to run them)") if "full" in names else "not asked",
    }
    if interpreted:
        out["memory_note"] = ("the kernel's memory is that of the interpreted program (the grid "
                              "run as a loop over whole arrays): its temporaries are the "
                              "interpreter's, not the compiled kernel's")
    if peaks:
        out["peaks"] = peaks
    # The Mosaic GPU read-out's forward: compiled beside the retired kernels on a GPU (it
    # interprets each `wgmma` in Python: off a GPU its own tests run it, at small shapes).
    mosaic = "mosaic" if retired else None
    if not retired:
        out["mosaic"] = "not run: compiled on a GPU only (--kernels retired)"
    with unretired() if retired else contextlib.nullcontext():
        results = {name: _shape_set(name, policy, mode, timed=name != "full" or time_full,
                                    repeats=args.repeats, min_time=args.min_time, inner=inner,
                                    peaks=peaks, only=only, mosaic=mosaic) for name in names}
    summary = {}
    for name in names:
        for case, r in results[name].items():
            if isinstance(r, dict) and "kernel" in r:
                summary[f"{name}/{case}"] = {
                    impl: {k: r[impl][k] for k in SUMMARY_KEYS if k in r[impl]}
                    | {"peak_bytes": r[impl]["memory"]["peak"]}
                    for impl in ("plain", "reference", "tiled", "kernel", "mosaic") if impl in r}
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    return {**out, "summary": summary, **results}
