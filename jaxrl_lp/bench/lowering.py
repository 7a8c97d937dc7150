"""Lowering for GPU and TPU from this host: every kernel and every program, and the kernels each carries.

Nothing is compiled or run: each program is traced once on abstract inputs at
the presets' real sizes (`plan.programs`) in native low precision, with the
kernel tiles planned for `--targets`, then lowered for each of `--platforms`
with JAX's defaults (`kernels.lowering`). A cell records whether it lowered,
the Pallas kernels the lowered module calls (Triton custom calls on `cuda`,
Mosaic ones on `tpu`), the kernel families the program should carry under its
policy (`expected_kernels`) and, for a failure, the error. The kernel rows
are the kernels alone under `kernels=on` (a fallback to the reference would
be a failure there): the fused log-prob forward and gradient (T 128, D 256,
V 4096), MXFP8 / MXFP4 / NVFP4 quantize and dequantize of a weight, and decode
attention (B 8, H 16 / K 8, S 1024, Dh 128). `table` is the result as the
markdown table of the GPU and TPU first-contact issue.

    jaxrl-lp bench lowering --markdown            # 3 presets x bf16, mxfp8, nvfp4
    jaxrl-lp bench lowering --presets qwen3-0.6b --policies bf16 --programs sampler_decode

Exit status 1 when a cell does not lower or lacks a kernel it should carry.

What it proves and what it cannot: `kernels.lowering`'s docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import Counter

import jax
import jax.numpy as jnp

from jaxrl_lp.numerics.policy import PRESETS as POLICY_PRESETS
from jaxrl_lp.numerics.policy import Policy, policy_list_arg, require

__all__ = ["KERNEL_CASES", "add_arguments", "expected_kernels", "kernel_family", "lower_cell",
           "main", "report", "table"]

PRESETS = ("qwen3-0.6b", "qwen3-4b", "ouro-1.4b")
POLICIES = ("bf16", "mxfp8", "nvfp4")
PLATFORMS = ("cuda", "tpu")
TARGETS = ("h100", "tpu-v5p")
KERNEL_CASES = ("logprob_forward", "logprob_gradient", "mxfp8_quantize", "mxfp4_quantize",
                "nvfp4_quantize", "decode_attention")
_BLOCK_FORMATS = ("mxfp8", "mxfp4", "nvfp4")
# Programs with the learner's read-out from the hidden state (the sampler and the replay take
# their log-probs from the logits they sample from; the behaviour log-probs of a hybrid
# learner are its replay alone), and those with one-token decode steps.
_READOUT = ("grpo_step_dense", "grpo_step_hybrid", "sft_step")
_DECODES = ("grpo_step_hybrid", "behaviour_logprobs", "sampler_decode", "replay")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxrl_lp.plan.programs import PROGRAMS

    parser.add_argument("--presets", default=",".join(PRESETS), help="model presets")
    parser.add_argument("--policies", default=",".join(POLICIES), type=policy_list_arg,
                        help="precision policies")
    parser.add_argument("--platforms", default=",".join(PLATFORMS), help="cuda, tpu (and cpu)")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help="programs to lower")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help="the kernel targets tiles are planned for, one per platform "
                             "(kernels.targets)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "on"),
                        help="the policies' kernels mode (auto: the platform's kernel where its "
                             "tile fits; on: an error where it does not)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers per preset (default: the preset's own); the "
                             "programs are the same per layer, so 2 checks the code paths in "
                             "a fraction of the time at the real widths")
    parser.add_argument("--no-kernel-rows", action="store_true",
                        help="leave out the kernels-alone rows")
    parser.add_argument("--markdown", action="store_true",
                        help="print the table instead of the JSON (--out still gets the JSON)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")


def kernel_family(name: str) -> str:
    """The kernel family of a kernel call's name (`logprob`, `quantize`, `decode_attention`)."""
    for family in ("logprob", "decode_attention", "quantize"):
        if family in name:
            return family
    return name


def expected_kernels(program: str, cfg, policy) -> set[str]:
    """The kernel families `program` of model `cfg` carries under `policy` when lowered for a
    platform with kernels (`kernels=auto`, tiles that fit)."""
    from jaxrl_lp.kernels.logprob import fused_readout

    policy = require(policy, "expected_kernels")
    if policy.kernels == "off":
        return set()
    fams = set()
    # A looped model's SFT loss reads the expected (exit-weighted) logits: no hidden state.
    if fused_readout(policy) and program in _READOUT and not (program == "sft_step"
                                                                and cfg.is_looped):
        fams.add("logprob")
    if program in _DECODES:
        fams.add("decode_attention")
    if policy.matmul_format in _BLOCK_FORMATS:  # every forward's matmuls, and the exporter
        fams.add("quantize")
    return fams


def lower_cell(traced, platform: str, target: str | None, expected: set[str]) -> dict:
    """One lowering of a traced program: `lowers`, kernel calls, expected families, seconds.

    On a platform whose kernels are retired (`kernels.dispatch.RETIRED`) no kernel is
    expected, and a kernel alone under `kernels=on` refusing with the retirement is the
    expected answer (`retired`).
    """
    from jaxrl_lp.kernels.dispatch import RETIRED
    from jaxrl_lp.kernels.lowering import kernel_calls, lower_for

    t0 = time.perf_counter()
    try:
        text = lower_for(traced, platform, target)
    except Exception as e:  # the cell's answer: why it does not lower
        return {"lowers": False, "error": f"{type(e).__name__}: {e}"[:600],
                "retired": platform in RETIRED and "retired" in str(e),
                "seconds": round(time.perf_counter() - t0, 2)}
    calls = Counter(kernel_calls(text, platform))
    found = {kernel_family(k) for k in calls}
    want = expected if platform != "cpu" and platform not in RETIRED else set()
    return {"lowers": True, "kernels": dict(sorted(calls.items())),
            "expected_families": sorted(want), "missing_families": sorted(want - found),
            "seconds": round(time.perf_counter() - t0, 2)}


def _kernel_case(case: str, policy: Policy):
    """(fn, abstract args) of a kernels-alone row, in native bf16 (`policy` sets kernels)."""
    from jaxrl_lp.kernels import quantize as kq
    from jaxrl_lp.kernels.decode_attention import decode_attention
    from jaxrl_lp.kernels.logprob import fused_logprobs

    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    if case.startswith("logprob"):
        def f(h, w, tokens):
            lp, ent = fused_logprobs(h, w, tokens, 1.0, policy)
            return jnp.sum(lp) + jnp.sum(ent)
        fn = jax.grad(f, (0, 1)) if case == "logprob_gradient" else f
        return fn, (s((128, 256), bf), s((256, 4096), bf), s((128,), jnp.int32))
    if case.endswith("_quantize"):
        fmt = case.split("_")[0]
        return (lambda x: kq.dequantize(kq.quantize(x, fmt, axis=0, kernels=policy),
                                        kernels=policy)), (s((2560, 9728), bf),)
    b, h, k, slots, dh = 8, 16, 8, 1024, 128
    return (lambda q, kc, vc, qp, kp: decode_attention(q, kc, vc, qp, kp, policy)), (
        s((b, 1, h, dh), bf), s((b, k, slots, dh), bf), s((b, k, slots, dh), bf),
        s((b, 1), jnp.int32), s((b, slots), jnp.int32))


def _target_for(platform: str, targets: list[str]) -> str | None:
    from jaxrl_lp.kernels.targets import KERNEL_TARGETS

    return next((t for t in targets if KERNEL_TARGETS[t].platform == platform), None)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(args) -> int:
    """Prints the report as JSON (or, with `--markdown`, its table); `--out` gets the JSON."""
    import json

    out = report(_split(args.presets), args.policies, _split(args.platforms),
                 _split(args.programs), _split(args.targets), kernels=args.kernels,
                 kernel_rows=not args.no_kernel_rows, layers=args.layers)
    text = json.dumps(out, indent=2)
    print(out["table"] if args.markdown else text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if out["summary"]["with_expected_kernels"] == out["summary"]["cells"] else 1


def report(presets, policies, platforms=PLATFORMS, programs=None, targets=TARGETS, *,
           kernels: str = "auto", kernel_rows: bool = True, layers: int | None = None) -> dict:
    """The lowering cells (module docstring) as a JSON-ready dict, `table` included.

    `layers` replaces each preset's decoder depth (per loop step for a looped
    preset; widths, heads, vocabulary and loop steps stay the preset's): every
    layer traces the same program, so a shallow model lowers the same code paths
    in a fraction of the time (the test suite's default cells use 2).

    Raises:
      ValueError: an unknown program, target or platform (naming it and the known ones),
        or `layers` below 1.
    """
    from jaxrl_lp.kernels.lowering import trace_for
    from jaxrl_lp.kernels.targets import KERNEL_TARGETS
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.plan.programs import PROGRAMS, ProgramShapes, build_program, native

    programs = list(PROGRAMS) if programs is None else list(programs)
    targets = list(targets)
    for name in programs:
        if name not in PROGRAMS:
            raise ValueError(f"--programs: unknown program {name!r}; choose from {list(PROGRAMS)}")
    for t in targets:
        if t not in KERNEL_TARGETS:
            raise ValueError(f"--targets: unknown target {t!r}; choose from {sorted(KERNEL_TARGETS)}")
    for p in platforms:
        if p not in ("cpu", "cuda", "tpu"):
            raise ValueError(f"--platforms: {p!r} is not one of cpu, cuda, tpu")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers: {layers} is below 1; give a depth of at least 1 or leave "
                         "it out for each preset's own")
    cfgs = {p: get_preset(p) for p in presets}
    if layers is not None:
        cfgs = {p: dataclasses.replace(c, num_layers=layers) for p, c in cfgs.items()}
    policies = [require(p, "bench lowering") for p in policies]
    pols = {p.name: native(p.replace(kernels=kernels)) for p in policies}
    t_all = time.perf_counter()
    out = {"jax": jax.__version__, "kernels_mode": kernels,
           "pallas_backends": {"cuda": "none: our GPU versions are retired from compiled use "
                                       "(kernels.dispatch.RETIRED)", "tpu": "mosaic_tpu"},
           "targets": {p: _target_for(p, targets) for p in platforms},
           "layers": {p: c.num_layers for p, c in cfgs.items()},
           "shapes": ProgramShapes()._asdict(), "kernels": {}, "programs": {}}
    if kernel_rows:
        for case in KERNEL_CASES:
            fn, fargs = _kernel_case(case, native(POLICY_PRESETS["bf16"].replace(kernels="on")))
            traced = trace_for(fn, fargs, targets)
            out["kernels"][case] = {p: lower_cell(traced, p, _target_for(p, targets),
                                                  {kernel_family(case)}) for p in platforms}
    for preset, cfg in cfgs.items():
        for pol_name, pol in pols.items():
            row = out["programs"].setdefault(preset, {}).setdefault(pol_name, {})
            for prog in programs:
                t0 = time.perf_counter()
                try:
                    fn, fargs = build_program(prog, cfg, pol)
                    traced = trace_for(fn, fargs, targets)
                except Exception as e:  # a program that does not even trace
                    row[prog] = {"trace_error": f"{type(e).__name__}: {e}"[:600]}
                    continue
                cell = {"trace_s": round(time.perf_counter() - t0, 2)}
                want = expected_kernels(prog, cfg, pol)
                for p in platforms:
                    cell[p] = lower_cell(traced, p, _target_for(p, targets), want)
                row[prog] = cell
    cells = [c[p] for c in _all_cells(out) for p in platforms if p in c]
    traced_ok = sum(1 for _ in _all_cells(out)) - len(out["kernels"])
    out["summary"] = {
        "cells": len(cells), "lowered": sum(c["lowers"] for c in cells),
        "with_expected_kernels": sum((c["lowers"] and not c["missing_families"])
                                     or c.get("retired", False) for c in cells),
        "programs_traced": traced_ok,
        "programs": sum(len(by_prog) for by_pol in out["programs"].values()
                        for by_prog in by_pol.values()),
        "seconds": round(time.perf_counter() - t_all, 1)}
    out["table"] = table(out, platforms)
    return out


def _all_cells(out: dict):
    yield from out["kernels"].values()
    for by_policy in out["programs"].values():
        for by_program in by_policy.values():
            yield from (c for c in by_program.values() if "trace_error" not in c)


def _cell_text(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if not cell["lowers"]:
        return "retired" if cell.get("retired") else "fails: " + cell["error"].split("\n")[0][:120]
    fams = sorted({kernel_family(k) for k in cell["kernels"]})
    miss = f"; missing {', '.join(cell['missing_families'])}" if cell["missing_families"] else ""
    return f"lowers ({', '.join(fams) or 'no kernel'}{miss})"


def table(out: dict, platforms) -> str:
    """The result as a markdown table: a row per kernel and per (program, preset, policy)."""
    head = "| program | " + " | ".join(p.upper() for p in platforms) + " |"
    lines = [head, "|---|" + "---|" * len(platforms)]
    for case, cell in out["kernels"].items():
        lines.append(f"| kernel {case} (k=on) | "
                     + " | ".join(_cell_text(cell.get(p)) for p in platforms) + " |")
    for preset, by_policy in out["programs"].items():
        for pol, by_program in by_policy.items():
            for prog, cell in by_program.items():
                texts = ([f"trace fails: {cell['trace_error'][:120]}"] * len(platforms)
                         if "trace_error" in cell else [_cell_text(cell.get(p)) for p in platforms])
                lines.append(f"| {prog} {preset} {pol} | " + " | ".join(texts) + " |")
    return "\n".join(lines)
