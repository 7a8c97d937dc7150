"""The hot path a platform's compiler is handed: the decode loop's weight reads, the learner's products.

Nothing is run: each program is traced on abstract inputs at the
preset's real size with low precision stored natively, as on a GPU or TPU
(`plan.programs.native`), and read for `--platform` (`plan.hotpath`):

- `sampler`: the sampler's whole program (`rollout.generate.sampler_program`,
  prefill and the decode `while` loop) in the platform's decode layout. Per
  dtype, the bytes of weights the loop reads each step, and every conversion
  of a weight inside the loop (none expected: the weights are rounded to the
  matmul inputs once per call, `models.blocks.decode_weights`).
- `grpo_step_dense`, `grpo_step_hybrid`, `sft_step`: the learner's updates
  (`plan.programs`), their products by operand dtypes and precision with
  their FLOPs. Expected under a low-precision policy without a matmul
  format: no product of an f32 operand with a low-precision one (an f32
  GEMM of bf16 data on a GPU), f32 x f32 products only for the f32 maths of
  logits (at most `F32_SHARE` of the FLOPs), and none at `HIGHEST` on
  low-precision operands (`numerics.products`).

With the CUDA PJRT plugin (`--cuda-plugin` or `$JAXRL_LP_CUDA_PLUGIN`, as
`jaxrl-lp bench decode`), each cell's `grpo_step_dense` is also compiled for
`--target` with no GPU (`plan.cuda_aot`, `compiled`): the temporary bytes XLA:GPU
plans beside the arguments and every array of 1 GiB or more in its optimized
program, with the read-out from the hidden state (`readout`: the tiled read-out
a GPU program runs, `kernels.logprob.tiled_readout`) and with `kernels=off`
(`plain_readout`: logits, then `log_softmax`) side by side, and with the layers
recomputing in the backward under each `--remat` choice (`grpo.remat`, `models.remat`:
`dots` saves the weight products and recomputes the attention, `layers` saves the
layers' inputs), with the product FLOPs that adds.

    jaxrl-lp bench hotpath                  # qwen3-0.6b and ouro-1.4b, bf16 and fp32, cuda
    jaxrl-lp bench hotpath --presets tiny-qwen3 --policies bf16-engine,mxfp8
    JAXRL_LP_CUDA_PLUGIN=DIR jaxrl-lp bench hotpath --presets qwen3-0.6b --policies bf16

Exit status 1 when a low-precision cell's decode loop converts a weight or
reads f32 weights, or its learner shows what the list above excludes. What it
cannot say: how fast a device runs what it is handed (a GPU's profile does).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from jaxrl_lp.bench import emit
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.numerics.policy import policy_list_arg, require
from jaxrl_lp.plan.programs import UPDATES

__all__ = ["F32_SHARE", "LARGE_ARRAY_BYTES", "LEARNER_PROGRAMS", "add_arguments", "compiled_update",
           "learner_cell", "learner_traced", "main", "report", "sampler_cell"]

LEARNER_PROGRAMS = UPDATES
# The f32 x f32 products a low-precision learner keeps are the f32 maths of its logits (a
# looped model's expected read-out mixes its steps' f32 logits).
F32_SHARE = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench hotpath`."""
    parser.add_argument("--presets", default="qwen3-0.6b,ouro-1.4b",
                        help="comma-separated model presets (default: %(default)s)")
    parser.add_argument("--policies", default="bf16,fp32", type=policy_list_arg,
                        help="comma-separated precision presets, or policies of any form "
                             "separated by ';' (default: %(default)s)")
    parser.add_argument("--platform", default="cuda", choices=("cuda", "tpu", "cpu"),
                        help="the platform whose branches are read (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=32, help="B (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--cuda-plugin", default=None,
                        help="folder holding the CUDA PJRT plugin (plan.cuda_aot); default "
                             "$JAXRL_LP_CUDA_PLUGIN; with one, each cell's GRPO update is also "
                             "compiled for --target and its buffers read (cuda only)")
    parser.add_argument("--target", default="h200", help="the GPU compiled for: h100, h200")
    parser.add_argument("--remat", default="dots,layers",
                        help="with the CUDA plugin, the update also compiled under each of these "
                             "(grpo.remat: dots, layers; '' for none; default: %(default)s)")
    parser.add_argument("--out", default=None, help="also write the JSON here")


def _weight_shapes(params) -> set[tuple[int, ...]]:
    """The shapes of the matmul weights (a layer's, without the layer axis) and the head's."""
    shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(params["layers"]) if x.ndim == 3}
    shapes |= {tuple(params[k].shape) for k in ("embed", "lm_head") if k in params}
    return shapes


def sampler_cell(cfg, policy, platform: str, rows: int, prompt_len: int, new_tokens: int) -> dict:
    """The decode loop's weight reads (bytes by dtype, converts) of `sampler_program`."""
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.plan.hotpath import loop_weight_reads
    from jaxrl_lp.rollout.generate import Forced, sampler_program
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.step import LoopSpec

    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    b, p, n = rows, prompt_len, new_tokens
    forced = Forced(s((b, n), i32), s((b, n), i32), s((), jnp.bool_))
    loop = LoopSpec().resolve(cfg)
    # The decode layout off CPU: the weights as stored (`rollout.step.decode_layout`).
    layout = "transposed" if platform == "cpu" and policy.matmul_format is None else "as_stored"
    traced = sampler_program.trace(
        params, s((b, p), i32), s((b, p), i32), s((b,), i32), jax.random.key(0), s((), i32),
        forced, cfg=cfg, policy=policy, loop=loop, sampling=SamplingConfig(temperature=1.0),
        max_new_tokens=n, eos_id=None, pad_id=0, layout=layout)
    reads = loop_weight_reads(traced.jaxpr.jaxpr, platform, _weight_shapes(params))
    return {"layout": layout, "loop_weight_bytes": reads.weight_bytes,
            "loop_weight_converts": [list(c[:2]) + [list(c[2])] for c in reads.converts]}


def learner_cell(name: str, cfg, policy, platform: str, rows: int, prompt_len: int,
                 new_tokens: int, remat: Remat = Remat.NONE) -> dict:
    """The products of learner program `name` (`plan.programs`, its layers recomputing as
    `remat` says) by operands and precision."""
    from jaxrl_lp.plan.hotpath import dot_summary, dots
    from jaxrl_lp.plan.programs import ProgramShapes, build_program

    fn, args = build_program(name, cfg, policy, ProgramShapes(rows, prompt_len, new_tokens),
                             remat=remat)
    return dot_summary(dots(fn.trace(*args).jaxpr.jaxpr, platform))


def _flops(cell: dict) -> int:
    return sum(d["flops"] for d in cell["products"].values())


def learner_traced(spec: dict, sharding=None):
    """Learner program `spec["program"]` (`plan.programs`) of `spec["preset"]` under
    `spec["policy"]` at `spec`'s sizes, traced on abstract inputs carrying `sharding` (what
    `plan.cuda_aot` compiles)."""
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.plan.programs import ProgramShapes, build_program

    fn, args = build_program(spec["program"], get_preset(spec["preset"]), spec["policy"],
                             ProgramShapes(spec["rows"], spec["prompt_len"], spec["new_tokens"]),
                             remat=Remat(spec.get("remat", "none")))
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    return fn.trace(*args)


# An array of at least this many bytes in a compiled update is listed (`large_arrays`): the
# [T, V] f32 logits of Qwen3-0.6B at 32 x 384 tokens are 7.5 GB, its largest weight 0.3 GB.
LARGE_ARRAY_BYTES = 1 << 30
_ARRAY = re.compile(r"\b(f32|bf16|f16|s32|pred)\[([\d,]+)\]")
_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1}


def _compiled_buffers(preset: str, policy, target: str, plugin: str, rows: int,
                      prompt_len: int, new_tokens: int, remat: Remat = Remat.NONE) -> dict:
    from jaxrl_lp.plan.cuda_aot import compiled_memory

    t0 = time.perf_counter()
    spec = {"program": "grpo_step_dense", "preset": preset, "policy": policy.name, "rows": rows,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "remat": remat.value}
    mem = compiled_memory("jaxrl_lp.bench.hotpath:learner_traced", spec, target, plugin)
    large = set()
    for dtype, dims in _ARRAY.findall(mem.pop("text")):
        if _ITEM[dtype] * math.prod(int(d) for d in dims.split(",")) >= LARGE_ARRAY_BYTES:
            large.add(f"{dtype}[{dims}]")
    return {**mem, "large_arrays": sorted(large), "compile_s": round(time.perf_counter() - t0, 1)}


def compiled_update(preset: str, policy, target: str, plugin: str, rows: int, prompt_len: int,
                    new_tokens: int, remats: tuple[Remat, ...] = (),
                    dense_flops: int | None = None) -> dict:
    """XLA:GPU's buffers for `grpo_step_dense` compiled for `target` (`plan.cuda_aot`): the
    temporary bytes beside the arguments and every array type of `LARGE_ARRAY_BYTES` or more
    in its optimized program, under `policy` (`readout`) and, where `policy` reads out from
    the hidden state, under it with `kernels=off` (`plain_readout`: the logits, then
    `log_softmax`, what every GPU program ran before the tiled read-out); and under each of
    `remats` (`remat`, by its name: the layers recomputing in the backward, `models.remat`,
    with the tiled read-out), with the update's product FLOPs against `readout`'s
    (`flops_vs_none`: what the recomputation adds; `dense_flops`, the update's own product
    FLOPs on cuda where the caller has them, else traced here)."""
    from jaxrl_lp.kernels.logprob import fused_readout
    from jaxrl_lp.models.config import get_preset

    out = {"program": "grpo_step_dense", "target": target,
           "readout": _compiled_buffers(preset, policy, target, plugin, rows, prompt_len,
                                        new_tokens)}
    if fused_readout(policy):
        out["plain_readout"] = _compiled_buffers(preset, policy.replace(kernels="off"), target,
                                                 plugin, rows, prompt_len, new_tokens)
    if remats:
        cfg = get_preset(preset)
        base = dense_flops or _flops(learner_cell("grpo_step_dense", cfg, policy, "cuda", rows,
                                                  prompt_len, new_tokens))
        out["remat"] = {}
        for r in remats:
            flops = _flops(learner_cell("grpo_step_dense", cfg, policy, "cuda", rows, prompt_len,
                                        new_tokens, r))
            out["remat"][r.value] = {
                **_compiled_buffers(preset, policy, target, plugin, rows, prompt_len,
                                    new_tokens, r),
                "flops": flops, "flops_vs_none": round(flops / base, 4)}
    return out


def _problems(cell: dict, policy) -> list[str]:
    """What a low-precision cell without a matmul format should not show."""
    if not policy.is_low_precision or policy.matmul_format is not None:
        return []
    out = []
    samp = cell["sampler"]
    if samp["loop_weight_converts"]:
        out.append(f"sampler: {len(samp['loop_weight_converts'])} weight converts in the loop")
    if samp["loop_weight_bytes"].get("float32"):
        out.append("sampler: the loop reads f32 weights")
    for name in LEARNER_PROGRAMS:
        d = cell[name]
        if d["mixed_flop_share"] > 0:
            out.append(f"{name}: {d['mixed_flop_share']:.2%} of FLOPs in f32 x low-precision "
                       "products")
        if d["f32_operand_flop_share"] > F32_SHARE:
            out.append(f"{name}: {d['f32_operand_flop_share']:.2%} of FLOPs have an f32 operand "
                       f"(at most {F32_SHARE:.0%}: the f32 maths of logits)")
        if d["highest_on_low_precision"]:
            out.append(f"{name}: {d['highest_on_low_precision']} HIGHEST products of "
                       "low-precision operands")
    return out


def report(presets, policies, platform: str = "cuda", rows: int = 32, prompt_len: int = 128,
           new_tokens: int = 256, plugin: str | None = None, target: str = "h200",
           remats: tuple[Remat, ...] = ()) -> dict:
    """Every (preset, policy) cell (module docstring), with its `problems`; with `plugin`
    (cuda only) each cell's `compiled` update too, and under each of `remats`."""
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.plan.programs import native

    cells = []
    for preset in presets:
        cfg = get_preset(preset)
        for pol in policies:
            policy = native(require(pol, "bench hotpath"))
            t0 = time.perf_counter()
            cell = {"preset": preset, "policy": pol.name,
                    "sampler": sampler_cell(cfg, policy, platform, rows, prompt_len,
                                            new_tokens)}
            for name in LEARNER_PROGRAMS:
                cell[name] = learner_cell(name, cfg, policy, platform, rows, prompt_len,
                                          new_tokens)
            if plugin is not None:
                cell["compiled"] = compiled_update(  # the cell's products were read for cuda
                    preset, policy, target, plugin, rows, prompt_len, new_tokens, remats,
                    _flops(cell["grpo_step_dense"]))
            cell["problems"] = _problems(cell, policy)
            cell["trace_s"] = round(time.perf_counter() - t0, 1)
            cells.append(cell)
    return {"target": "hotpath", "platform": platform, "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "traced_on": jax.default_backend(),
            "commit": _commit(),
            "shapes": {"rows": rows, "prompt_len": prompt_len, "new_tokens": new_tokens},
            "cells": cells, "ok": not any(c["problems"] for c in cells)}


def _commit() -> str | None:
    """The checkout's commit, with `+` when its files differ from it (None outside git)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty.strip() else "")


def main(args: argparse.Namespace) -> int:
    """`jaxrl-lp bench hotpath`: prints the report's JSON; exit 1 when a cell has problems."""
    presets = [p for p in args.presets.split(",") if p]
    policies = args.policies
    for n, v in (("--rows", args.rows), ("--prompt-len", args.prompt_len),
                 ("--new-tokens", args.new_tokens)):
        if v < 1:
            print(f"jaxrl-lp bench hotpath: {n} must be >= 1, got {v}", file=sys.stderr)
            return 2
    from jaxrl_lp.plan.cuda_aot import GPU_TARGETS, plugin_from_env

    try:
        plugin = plugin_from_env(args.cuda_plugin)
    except ValueError as e:
        print(f"jaxrl-lp bench hotpath: {e}", file=sys.stderr)
        return 2
    if plugin is not None and args.platform != "cuda":
        print(f"jaxrl-lp bench hotpath: --cuda-plugin compiles for a GPU; drop it or use "
              f"--platform cuda (got {args.platform})", file=sys.stderr)
        return 2
    if args.target not in GPU_TARGETS:
        print(f"jaxrl-lp bench hotpath: --target must be one of {', '.join(GPU_TARGETS)}; got "
              f"{args.target!r}", file=sys.stderr)
        return 2
    try:
        remats = tuple(Remat.of(r) for r in args.remat.split(",") if r)
    except ValueError as e:
        print(f"jaxrl-lp bench hotpath: --remat: {e}", file=sys.stderr)
        return 2
    out = report(presets, policies, args.platform, args.rows, args.prompt_len, args.new_tokens,
                 plugin, args.target, remats)
    emit(out, args.out)
    return 0 if out["ok"] else 1
