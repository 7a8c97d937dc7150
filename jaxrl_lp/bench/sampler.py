"""The sampler benchmark: our jitted sampler against Hugging Face `generate`, and deferred looped decoding.

Dense (`tiny` and `small` presets): greedy decoding of the same random Qwen3
weights, same batch, prompt and new-token lengths, by our sampler and by
`transformers` `generate` (`hf_ref.hf_model`), on CPU, in one process, after a
warm-up; our compile time is reported apart (`compile_s`). Policy fp32 by
default (`--policy`): on CPU XLA's bf16 matmuls are several times slower than
f32 (docs/design/low_precision.md, "Performance on the development CPUs"); on GPU
`--policy bf16` runs natively.

Looped: a random Ouro-style model whose exit gate (logits of std 0.5 around a
bias of -0.6) makes a `threshold:0.5` rule exit after about 2 of 4 loop steps,
decoded in `dense` mode (all R loop steps) and in `deferred` mode (a token
stops at its exit step; a decode step stops when the whole batch has exited),
at batch 1 and 8. `ideal_speedup` is R / mean exit depth of the decode steps:
what deferred mode would gain if loop steps were all the work of a token.

`--sizes` and `--looped-sizes` also take a model preset (`qwen3-0.6b`,
`ouro-1.4b`: random weights at that size, the looped one with the gate
above), and `--batch` several batches: the GPU's cells
(`benchmarks/gpu.sh`), with `--no-hf` and `--policy bf16`.

Every figure is also put against the bandwidth bound: decode reads the
weights once per step (as its loop reads them: bf16 where stored natively,
`models.blocks.decode_weights`) and the KV cache up to the mean context, so
tokens/s <= batch * bandwidth / those bytes. The bandwidth is the
accelerator's HBM figure (`plan.targets`, by device name), the development
CPUs' on CPU (`CPU_BANDWIDTH_GBPS`, measured: docs/design/low_precision.md,
"Performance on the development CPUs"), or `--bandwidth-gbps`.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.blocks import decode_weights
from jaxrl_lp.models.config import ModelConfig, get_preset
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import FP32, Policy, policy_arg
from jaxrl_lp.rollout import LoopSpec, SamplingConfig, generate

__all__ = ["LOOPED_SIZES", "add_arguments", "bench_dense", "bench_looped", "device_bandwidth_gbps",
           "kv_bytes", "run", "weight_bytes"]

DENSE_PRESETS = {"tiny": "tiny-qwen3", "small": "small-qwen3"}
# Looped models of the same shapes as the dense presets (Ouro has no QK-norm).
LOOPED_SIZES = {
    name: get_preset(preset).replace(family="ouro", loop_steps=4, qk_norm=False)
    for name, preset in DENSE_PRESETS.items()
}
CPU_BANDWIDTH_GBPS = 15.0  # a batch-8 f32 matrix-vector product on the development CPUs
POLICY = FP32
MAX_RUNS = 200  # timed runs of one configuration at most (tiny runs take milliseconds)


def weight_bytes(cfg: ModelConfig, params: dict, loop_steps: float | None = None,
                 policy: Policy | None = None) -> int:
    """Bytes of weights one decode step reads: every layer (per loop step run) and the head.

    The embedding table is gathered (a few rows), not streamed, unless it is
    also the (tied) output head. With a `policy`, the weights as its decode
    loop reads them (`models.blocks.decode_weights`: bf16 where stored
    natively); without, as `params` holds them.
    """
    if policy is not None:
        params = jax.eval_shape(lambda p: decode_weights(p, policy), params)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
    layers = nbytes(params["layers"])
    # A decode copy may give a tied head a copy of its own (a quantized one: `decode_weights`).
    head = nbytes(params["lm_head"] if "lm_head" in params else params["embed"])
    other = nbytes(params["final_norm"]) + (nbytes(params["exit_gate"]) if cfg.is_looped else 0)
    steps = cfg.loop_steps if loop_steps is None else loop_steps
    return int(round(layers * steps + head + other * steps))


def kv_bytes(cfg: ModelConfig, policy: Policy, batch: int, context: float,
             loop_steps: float | None = None) -> int:
    """Bytes of keys and values a decode step reads at `context` tokens: every layer's (per loop
    step run), at the cache's dtype (`models.cache.init_cache`)."""
    steps = (cfg.loop_steps if loop_steps is None else loop_steps) if cfg.is_looped else 1
    item = np.dtype(policy.carrier_dtype).itemsize
    return int(round(2 * cfg.num_layers * steps * batch * cfg.num_kv_heads * cfg.head_dim
                     * context * item))


def device_bandwidth_gbps() -> tuple[float, str]:
    """(GB/s, where it comes from): the accelerator's HBM (`plan.targets`, by device name),
    else the development CPUs' figure (docs/design/low_precision.md)."""
    from jaxrl_lp.plan.targets import target_of_device

    dev = jax.devices()[0]
    t = None if dev.platform == "cpu" else target_of_device(dev.device_kind)
    if t is not None:
        return t.hbm_bandwidth / 1e9, f"plan.targets[{t.name!r}] for {dev.device_kind}"
    return CPU_BANDWIDTH_GBPS, "a batch-8 f32 matrix-vector product on the development CPUs"


def _bound(batch: int, nbytes: float, bandwidth_gbps: float) -> float:
    return batch * bandwidth_gbps * 1e9 / nbytes


def _race(calls: dict, repeats: int, min_time: float):
    """Times the calls in turn (so a change in load falls on all of them), after a warm-up.

    Returns (first-call seconds, timed seconds, last results), each a dict keyed
    like `calls`; every call runs at least `repeats` times and until all of
    them together took `len(calls) * min_time` (at most MAX_RUNS each). The
    figures reported are the fastest runs: on a shared machine the slower runs
    measure the neighbours' load as much as the code.
    """
    firsts, times, outs = {}, {m: [] for m in calls}, {}
    for m, fn in calls.items():
        firsts[m], outs[m] = _first_call(fn)
    some = next(iter(calls))
    while (len(times[some]) < repeats
           or (sum(map(sum, times.values())) < len(calls) * min_time
               and len(times[some]) < MAX_RUNS)):
        for m, fn in calls.items():
            t, outs[m] = _first_call(fn)
            times[m].append(t)
    return firsts, times, outs


def _ours_call(params, cfg, prompts, **kwargs):
    return lambda: jax.block_until_ready(generate(params, cfg, prompts, **kwargs))


def _first_call(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _hf_call(model, prompt_BxP, new_tokens):
    """Greedy `generate` of exactly `new_tokens` tokens; returns the new tokens [B, N]."""
    import torch

    ids = torch.from_numpy(np.asarray(prompt_BxP, np.int64))
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)

    def call():
        with torch.inference_mode():
            return model.generate(ids, **kwargs)[:, ids.shape[1]:].numpy()

    return call


def _hf_threads(model, prompt_BxP, choice: str) -> int:
    """torch's thread count for the race: given, or `best` of 1 and all cores on a short run.

    On a busy machine of few cores torch's multi-threaded kernels can be several
    times slower than one thread; `best` gives the reference its better setting.
    """
    import torch

    cores = os.cpu_count() or 1
    if choice != "best":
        return int(choice)
    best, best_t = 1, float("inf")
    short = _hf_call(model, prompt_BxP, 8)
    for n in sorted({1, cores}):
        torch.set_num_threads(n)
        t = min(_race({"short": short}, 2, 0.0)[1]["short"])
        if t < best_t:
            best, best_t = n, t
    return best


def bench_dense(size: str, *, batch: int, prompt_len: int, new_tokens: int, repeats: int,
                min_time: float, hf: bool, hf_threads: str, bandwidth_gbps: float,
                seed: int, policy: Policy = POLICY, decode_layout: str | None = None) -> dict:
    """Greedy decoding tokens/s of our sampler and of `transformers` on one dense preset.

    After a warm-up of each, timed runs of the two alternate, so that a change
    in the machine's load falls on both.
    """
    preset = DENSE_PRESETS.get(size, size)
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.PRNGKey(seed))
    prompts = np.random.RandomState(seed).randint(1, cfg.vocab_size, (batch, prompt_len))
    ours = _ours_call(params, cfg, prompts.tolist(), sampling=SamplingConfig(greedy=True),
                      policy=policy, max_new_tokens=new_tokens, eos_id=None,
                      decode_layout=decode_layout)
    calls = {"ours": ours}
    if hf:
        import torch

        from jaxrl_lp.bench.hf_ref import hf_model

        threads_before = torch.get_num_threads()
        model = hf_model(cfg, params)
        n = _hf_threads(model, prompts, hf_threads)
        torch.set_num_threads(n)
        calls["hf"] = _hf_call(model, prompts, new_tokens)
    firsts, times, outs = _race(calls, repeats, min_time)
    if hf:
        torch.set_num_threads(threads_before)
    first, ro, ours_times = firsts["ours"], outs["ours"], times["ours"]
    ours_s = min(ours_times)
    tokens = batch * new_tokens
    nbytes = weight_bytes(cfg, params, policy=policy)
    kv = kv_bytes(cfg, policy, batch, prompt_len + (new_tokens - 1) / 2)
    out = {
        "preset": preset, "params": cfg.param_count(), "batch": batch,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "policy": policy.name,
        "compile_s": round(first - ours_s, 3), "ours_s": round(ours_s, 4),
        "ours_runs": len(ours_times),
        "ours_ms_per_step": round(1e3 * ours_s / new_tokens, 3),
        "ours_tokens_per_s": round(tokens / ours_s, 1),
        "weight_bytes_per_step": nbytes,
        "kv_bytes_per_step": kv,
        "bound_tokens_per_s": round(_bound(batch, nbytes + kv, bandwidth_gbps), 1),
        "bound_ms_per_step": round(1e3 * (nbytes + kv) / (bandwidth_gbps * 1e9), 4),
    }
    out["ours_fraction_of_bound"] = round(out["ours_tokens_per_s"] / out["bound_tokens_per_s"], 3)
    if hf:
        hf_s, hf_times, hf_tokens = min(times["hf"]), times["hf"], outs["hf"]
        out.update({
            "hf_threads": n, "hf_s": round(hf_s, 4), "hf_runs": len(hf_times),
            "hf_ms_per_step": round(1e3 * hf_s / new_tokens, 3),
            "hf_tokens_per_s": round(tokens / hf_s, 1),
            "ratio_vs_hf": round(hf_s / ours_s, 2),
            "hf_fraction_of_bound": round(tokens / hf_s / out["bound_tokens_per_s"], 3),
            # Same weights, f32, greedy: the two decodings agree until a near-tie flips.
            "tokens_equal_hf": round(float((hf_tokens == np.asarray(ro.completion_tokens)).mean()),
                                     4),
        })
    return out


def looped_params(cfg: ModelConfig, seed: int, gate_bias: float, gate_scale: float) -> dict:
    """Random looped weights with a gate of bias `gate_bias` and logit spread `gate_scale`.

    The gate reads the final-normed hidden state (RMS ~1), so a kernel of std
    `gate_scale / sqrt(D)` gives gate logits ~ N(gate_bias, gate_scale).
    """
    params = init_params(cfg, jax.random.PRNGKey(seed))
    d = cfg.hidden_size
    kernel = gate_scale / np.sqrt(d) * jax.random.normal(jax.random.PRNGKey(seed + 1), (d, 1))
    params["exit_gate"] = {"kernel": kernel, "bias": jnp.array([gate_bias], jnp.float32)}
    return params


def bench_looped(size: str, *, batches, prompt_len: int, new_tokens: int, repeats: int,
                 min_time: float, exit_rule: str, gate_bias: float, gate_scale: float,
                 bandwidth_gbps: float, seed: int, policy: Policy = POLICY,
                 decode_layout: str | None = None) -> dict:
    """Dense against deferred compute mode on a looped model whose exits come early."""
    cfg = LOOPED_SIZES[size] if size in LOOPED_SIZES else get_preset(size)
    r = cfg.loop_steps
    params = looped_params(cfg, seed, gate_bias, gate_scale)
    # Sampled (T=1, fixed key) rather than greedy: a random model's greedy output
    # repeats one token, and so would its exit step.
    sampling = SamplingConfig(temperature=1.0)
    out = {
        "model": (f"{DENSE_PRESETS[size]} shapes as a looped (ouro) model, R={r}"
                  if size in LOOPED_SIZES else f"{size}, R={r}"),
        "params": cfg.param_count(), "policy": policy.name, "exit_rule": exit_rule,
        "gate": f"random kernel, gate logits ~ N({gate_bias}, {gate_scale}^2): under {exit_rule} "
                f"tokens exit early (mean_exit_depth, of {r}) and at different steps",
        "sampling": "temperature 1.0, fixed key", "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }
    for batch in batches:
        prompts = np.random.RandomState(seed).randint(1, cfg.vocab_size, (batch, prompt_len))
        prompt_list = prompts.tolist()
        call = lambda p, mode, rule=exit_rule, pl=prompt_list: _ours_call(
            p, cfg, pl, sampling=sampling, policy=policy,
            max_new_tokens=new_tokens, eos_id=None, loop=LoopSpec(rule, mode),
            key=jax.random.PRNGKey(seed), decode_layout=decode_layout)
        calls = {"dense": call(params, "dense"), "deferred": call(params, "deferred")}
        if batch == 1:
            # Where deferred time goes: every token exiting at the first / the last step
            # gives the cost of one loop step and the per-token cost no exit can skip.
            for name, bias in (("first", 10.0), ("last", -10.0)):
                calls[f"exit_{name}"] = call(looped_params(cfg, seed, bias, gate_scale),
                                             "deferred")
        firsts, times, ros = _race(calls, repeats, min_time)
        res = {m: (firsts[m] - min(times[m]), min(times[m])) for m in times}
        tokens = batch * new_tokens
        ro = ros["deferred"]
        decoded = np.asarray(ro.exit_steps)[:, 1:]  # token 0 comes from the full-depth prefill
        depth = float(decoded.mean()) + 1 if decoded.size else float(r)
        steps_per_decode = int(ro.loop_evals) / (new_tokens - 1) if new_tokens > 1 else r
        context = prompt_len + (new_tokens - 1) / 2
        dense_bytes = (weight_bytes(cfg, params, policy=policy)
                       + kv_bytes(cfg, policy, batch, context))
        deferred_bytes = (weight_bytes(cfg, params, loop_steps=steps_per_decode, policy=policy)
                          + kv_bytes(cfg, policy, batch, context, steps_per_decode))
        b = {
            "batch": batch,
            "runs_each": len(times["dense"]),
            "dense_compile_s": round(res["dense"][0], 3),
            "deferred_compile_s": round(res["deferred"][0], 3),
            "dense_tokens_per_s": round(tokens / res["dense"][1], 1),
            "deferred_tokens_per_s": round(tokens / res["deferred"][1], 1),
            "deferred_speedup": round(res["dense"][1] / res["deferred"][1], 3),
            "mean_exit_depth": round(depth, 3),
            "ideal_speedup": round(r / depth, 3),
            # Loop steps run per decode step: the batch runs until its deepest token exits.
            "loop_steps_per_decode_step": round(steps_per_decode, 3),
            "batch_ideal_speedup": round(r / steps_per_decode, 3),
            "dense_loop_evals": int(ros["dense"].loop_evals),
            "deferred_loop_evals": int(ro.loop_evals),
            "dense_bound_tokens_per_s": round(_bound(batch, dense_bytes, bandwidth_gbps), 1),
            "deferred_bound_tokens_per_s": round(_bound(batch, deferred_bytes, bandwidth_gbps),
                                                 1),
        }
        b["speedup_fraction_of_ideal"] = round(b["deferred_speedup"] / b["ideal_speedup"], 3)
        if batch == 1:
            per_tok = {m: min(times[m]) / new_tokens for m in times}
            step = (per_tok["exit_last"] - per_tok["exit_first"]) / (r - 1)
            fixed = per_tok["exit_first"] - step
            b.update({
                "loop_step_ms_per_token": round(1e3 * step, 4),
                "fixed_ms_per_token": round(1e3 * fixed, 4),
                # What deferred mode can reach at this depth when the fixed part stays.
                "attainable_speedup": round(per_tok["dense"] / (fixed + depth * step), 3),
            })
        out[f"batch_{batch}"] = b
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench sampler`."""
    parser.add_argument("--sizes", default="tiny,small",
                        help="dense sizes to race against HF: tiny (tiny-qwen3), small "
                             "(small-qwen3: 8 layers, hidden 512, vocab 32000), or a dense "
                             "model preset (qwen3-0.6b)")
    parser.add_argument("--batch", default="8",
                        help="the dense sizes' batch, or several (comma-separated)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs after warm-up (at least; see --min-time); the fastest "
                             "is reported")
    parser.add_argument("--min-time", type=float, default=2.0,
                        help="keep repeating a timed run until this many seconds (max 200 runs)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    parser.add_argument("--hf-threads", default="best",
                        help="torch threads for the reference: a number, or 'best' of 1 and all "
                             "cores (default)")
    parser.add_argument("--looped-sizes", default="tiny,small",
                        help="looped models for the deferred race: tiny or small (those "
                             "dense shapes, R=4) or a looped preset (ouro-1.4b); '' to skip")
    parser.add_argument("--looped-batches", default="1,8")
    parser.add_argument("--exit-rule", default="threshold:0.5")
    parser.add_argument("--gate-bias", type=float, default=-0.6)
    parser.add_argument("--gate-scale", type=float, default=0.5)
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="memory bandwidth for the bound (default: the accelerator's HBM "
                             "by device name, plan.targets; on CPU the development CPUs' "
                             f"{CPU_BANDWIDTH_GBPS:g} GB/s)")
    parser.add_argument("--policy", default=POLICY.name, type=policy_arg,
                        help="precision policy of our sampler (fp32 on CPU: docs/design/low_precision.md; "
                             "bf16 on GPU, where it is stored natively)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-layout", default=None,
                        choices=["as_stored", "transposed", "invariant"],
                        help="our sampler's decode layout (`rollout.step.decode_layout`; "
                             "default: generate's pick); invariant: the batch-invariant "
                             "forms of grpo.logprobs=invariant")
    parser.add_argument("--xla-gpu-flags", default="none",
                        help="XLA's GPU flags by preset (jaxrl_lp.xla_flags: none, "
                             "decode_graphs, scheduler; comma-separated), set before JAX's "
                             "backend starts: the A/B of benchmarks/gpu.sh SUITE=graphs")


def _batches(text: str, name: str) -> list[int]:
    try:
        out = [int(b) for b in _csv(str(text))]
    except ValueError:
        raise ValueError(f"{name}: batch sizes are integers, comma-separated; got {text!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"{name} must be one or more integers >= 1; got {text!r}")
    return out


def _csv(text: str, allowed=None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if allowed is not None and (bad := [s for s in items if s not in allowed]):
        raise ValueError(f"unknown size(s) {bad}; allowed: {sorted(allowed)}")
    return items


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark; returns one JSON-serializable dict."""
    from jaxrl_lp.xla_flags import apply, flags_for, parse

    presets = parse(args.xla_gpu_flags, "--xla-gpu-flags")
    apply(presets, "--xla-gpu-flags")  # before the first JAX computation below
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    sizes = _csv(args.sizes)
    looped_sizes = _csv(args.looped_sizes)
    for s in sizes:
        if s not in DENSE_PRESETS and get_preset(s).is_looped:
            raise ValueError(f"--sizes: {s!r} is a looped preset; pass it to --looped-sizes")
    for s in looped_sizes:
        if s not in LOOPED_SIZES and not get_preset(s).is_looped:
            raise ValueError(f"--looped-sizes: {s!r} is a dense preset; pass it to --sizes")
    batches = _batches(args.looped_batches, "--looped-batches")
    dense_batches = _batches(args.batch, "--batch")
    bandwidth, bandwidth_src = ((args.bandwidth_gbps, "--bandwidth-gbps") if args.bandwidth_gbps
                                else device_bandwidth_gbps())
    info = {
        "target": "sampler",
        "platform": f"{platform.machine()} {jax.default_backend()}, {os.cpu_count()} cores",
        "jax": jax.__version__, "loadavg_start": round(os.getloadavg()[0], 2),
        "policy": args.policy.name, "decode_layout": args.decode_layout or "auto",
        "device": jax.devices()[0].device_kind,
        "note": "default policy fp32: XLA's bf16 matmuls on CPU are much slower than f32 "
                "(docs/design/low_precision.md); "
                "bounds are batch * bandwidth / bytes read per decode step (the weights as the "
                "loop reads them, and the KV cache at the mean context)",
        "bandwidth_gbps": bandwidth, "bandwidth_source": bandwidth_src,
        "xla_gpu_flags": {"presets": list(presets), "flags": list(flags_for(presets)),
                          "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
    }
    if not args.no_hf:
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__)
    # One batch: keyed by size, as before; several: by size and batch.
    name_of = (lambda s, b: s) if len(dense_batches) == 1 else (lambda s, b: f"{s}_batch_{b}")
    dense = {name_of(s, b): bench_dense(s, batch=b, prompt_len=args.prompt_len,
                                    new_tokens=args.new_tokens, repeats=args.repeats,
                                    min_time=args.min_time, hf=not args.no_hf,
                                    hf_threads=args.hf_threads, bandwidth_gbps=bandwidth,
                                    seed=args.seed, policy=args.policy,
                                    decode_layout=args.decode_layout)
             for s in sizes for b in dense_batches}
    looped = {s: bench_looped(s, batches=batches, prompt_len=args.prompt_len,
                              new_tokens=args.new_tokens, repeats=args.repeats,
                              min_time=args.min_time, exit_rule=args.exit_rule, gate_bias=args.gate_bias,
                              gate_scale=args.gate_scale, bandwidth_gbps=bandwidth,
                              seed=args.seed, policy=args.policy,
                              decode_layout=args.decode_layout) for s in looped_sizes}
    summary = {}
    for k in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf", "compile_s",
              "bound_tokens_per_s", "ours_fraction_of_bound"):
        vals = {s: d[k] for s, d in dense.items() if k in d}
        if vals:
            summary[k] = vals
    for key in ("dense_tokens_per_s", "deferred_tokens_per_s", "deferred_speedup",
                "mean_exit_depth", "ideal_speedup"):
        vals = {f"{s}_batch_{b}": looped[s][f"batch_{b}"][key] for s in looped for b in batches}
        if vals:
            summary[key] = vals
    checks = {}
    if "ratio_vs_hf" in summary:
        for s, want in (("tiny", 3.0), ("small", 1.5)):
            if s in summary["ratio_vs_hf"]:
                checks[f"ratio_vs_hf_{s}>={want}"] = summary["ratio_vs_hf"][s] >= want
    for s in looped:
        if "batch_1" in looped[s]:
            b1 = looped[s]["batch_1"]
            checks[f"deferred_speedup_{s}_batch_1>=0.7*ideal"] = (
                b1["deferred_speedup"] >= 0.7 * b1["ideal_speedup"])
    info["loadavg_end"] = round(os.getloadavg()[0], 2)
    return {**info, **summary, "targets_met": checks, "dense": dense, "looped": looped}
