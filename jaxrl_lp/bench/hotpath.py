"""The hot path a platform's compiler is handed: the decode loop's weight reads, the learner's products.

Nothing is compiled or run: each program is traced on abstract inputs at the
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

    jaxrl-lp bench hotpath                  # qwen3-0.6b and ouro-1.4b, bf16 and fp32, cuda
    jaxrl-lp bench hotpath --presets tiny-qwen3 --policies bf16-engine,mxfp8

Exit status 1 when a low-precision cell's decode loop converts a weight or
reads f32 weights, or its learner shows what the list above excludes. What it
cannot say: how fast a device runs what it is handed (a GPU's profile does).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from jaxrl_lp.bench import emit
from jaxrl_lp.numerics.policy import policy_list_arg, require

__all__ = ["F32_SHARE", "LEARNER_PROGRAMS", "add_arguments", "learner_cell", "main", "report", "sampler_cell"]

LEARNER_PROGRAMS = ("grpo_step_dense", "grpo_step_hybrid", "sft_step")
# The f32 x f32 products a low-precision learner keeps are the f32 maths of its logits (a
# looped model's expected read-out mixes its steps' f32 logits: 0.5% of tiny-ouro's SFT).
F32_SHARE = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench hotpath`."""
    parser.add_argument("--presets", default="qwen3-0.6b,ouro-1.4b",
                        help="comma-separated model presets (default: %(default)s)")
    parser.add_argument("--policies", default="bf16,fp32", type=policy_list_arg,
                        help="comma-separated precision policies (default: %(default)s)")
    parser.add_argument("--platform", default="cuda", choices=("cuda", "tpu", "cpu"),
                        help="the platform whose branches are read (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=32, help="B (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=256, help="(default: %(default)s)")
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
                 new_tokens: int) -> dict:
    """The products of learner program `name` (`plan.programs`) by operands and precision."""
    from jaxrl_lp.plan.hotpath import dot_summary, dots
    from jaxrl_lp.plan.programs import ProgramShapes, build_program

    fn, args = build_program(name, cfg, policy, ProgramShapes(rows, prompt_len, new_tokens))
    return dot_summary(dots(fn.trace(*args).jaxpr.jaxpr, platform))


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
           new_tokens: int = 256) -> dict:
    """Every (preset, policy) cell (module docstring), with its `problems`."""
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
    out = report(presets, policies, args.platform, args.rows, args.prompt_len, args.new_tokens)
    emit(out, args.out)
    return 0 if out["ok"] else 1
