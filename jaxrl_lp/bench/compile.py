"""Compile seconds against depth: the sampler's and the learner's programs at several layer counts.

Each program (the sampler's whole `generate`, and those of `plan.programs`:
the jitted function exactly as the run jits it, on abstract inputs at the
preset's widths) is built with the preset's
decoder depth replaced by each of `--depths`, then traced, lowered and
compiled for this host (XLA:CPU here; nothing runs and nothing is
allocated). Per program the JSON gives the seconds of each phase at each
depth and a least-squares line through the totals: `s_per_layer`,
`intercept_s` and `at_preset_depth_s`, the line at the preset's own depth
(measured instead when that depth is in `--depths`).

The sampler's decode step applies its layers one by one (a Python loop over
the per-layer weights and KV cache, `models.blocks.unstack_layers`), so its
program grows with depth, and so does every program holding it (the hybrid
step's replay); the learner's dense forward scans a stacked layer. What a GPU
or TPU compiler does with the same program differs in its constants, not in
what is unrolled.

    jaxrl-lp bench compile                                     # qwen3-0.6b at 1, 2, 4, 8 layers
    jaxrl-lp bench compile --presets ouro-1.4b --depths 1,2,4 --programs sampler_decode
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import jax
import numpy as np

from jaxrl_lp.numerics.policy import policy_arg, require

__all__ = ["DEFAULT_PROGRAMS", "add_arguments", "compile_seconds", "report", "run"]

# `sampler_generate` is the sampler's whole program (`rollout.generate`: the prefill, then a
# `while_loop` of decode steps), what a run's first `generate` call compiles; the others are
# `plan.programs`'.
GENERATE = "sampler_generate"
DEFAULT_PROGRAMS = (GENERATE, "sampler_decode", "grpo_step_dense", "grpo_step_hybrid",
                    "sft_step")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", default="qwen3-0.6b", help="model presets, comma-separated")
    parser.add_argument("--policy", default="bf16", type=policy_arg, help="the precision policy")
    parser.add_argument("--depths", default="1,2,4,8", help="decoder layer counts")
    parser.add_argument("--programs", default=",".join(DEFAULT_PROGRAMS),
                        help="programs of plan.programs, comma-separated")
    parser.add_argument("--rows", type=int, default=8, help="batch rows (plan.ProgramShapes)")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt slots")
    parser.add_argument("--new-tokens", type=int, default=512, help="completion slots")


def _generate_trace(cfg, policy, shapes):
    """A closure tracing `rollout.generate`'s jitted program on abstract inputs."""
    import jax.numpy as jnp

    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.rollout.generate import Forced, sampler_program
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.step import LoopSpec

    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    rows, prompt = shapes.rows, shapes.prompt_len
    forced = Forced(ints(rows, shapes.max_new), ints(rows, shapes.max_new),
                    jax.ShapeDtypeStruct((), jnp.bool_))
    return lambda: sampler_program.trace(
        params, ints(rows, prompt), ints(rows, prompt), ints(rows), jax.random.PRNGKey(0),
        ints(), forced, cfg=cfg, policy=policy, loop=LoopSpec().resolve(cfg),
        sampling=SamplingConfig(temperature=1.0), max_new_tokens=shapes.max_new,
        eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id or 0)


def compile_seconds(name: str, cfg, policy, shapes=None) -> dict:
    """Seconds to build, trace, lower and compile program `name` of `cfg` for this host, in
    the form this host runs it (low-precision compute carried as the host does)."""
    from jaxrl_lp.plan.programs import ProgramShapes, build_program

    shapes = shapes or ProgramShapes()
    t0 = time.perf_counter()
    if name == GENERATE:
        trace = _generate_trace(cfg, policy, shapes)
    else:
        fn, args = build_program(name, cfg, policy, shapes)
        trace = lambda: fn.trace(*args)  # noqa: E731
    t1 = time.perf_counter()
    traced = trace()
    t2 = time.perf_counter()
    lowered = traced.lower()
    t3 = time.perf_counter()
    lowered.compile()
    t4 = time.perf_counter()
    return {"build_s": round(t1 - t0, 3), "trace_s": round(t2 - t1, 3),
            "lower_s": round(t3 - t2, 3), "compile_s": round(t4 - t3, 3),
            "total_s": round(t4 - t0, 3)}


def report(presets, policy: str = "bf16", depths=(1, 2, 4, 8),
           programs=DEFAULT_PROGRAMS, shapes=None) -> dict:
    """The measurements (module docstring) as a JSON-ready dict.

    Raises:
      ValueError: an unknown program, fewer than two depths or a depth below 1.
    """
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.plan.programs import PROGRAMS, ProgramShapes

    depths = sorted(set(int(d) for d in depths))
    if len(depths) < 2 or depths[0] < 1:
        raise ValueError(f"--depths: give at least two layer counts of 1 or more, not {depths}")
    for name in programs:
        if name not in (GENERATE, *PROGRAMS):
            raise ValueError(f"--programs: unknown program {name!r}; choose from "
                             f"{[GENERATE, *PROGRAMS]}")
    pol = require(policy, "bench compile")
    shapes = shapes or ProgramShapes()
    out = {"target": "compile", "jax": jax.__version__, "backend": jax.default_backend(),
           "platform": f"{platform.machine()} {platform.system().lower()}, "
                       f"{os.cpu_count()} cores",
           "loadavg_start": round(os.getloadavg()[0], 2), "policy": str(pol),
           "shapes": shapes._asdict(), "depths": depths, "presets": {}}
    for preset in presets:
        base = get_preset(preset)
        row = out["presets"].setdefault(preset, {"preset_depth": base.num_layers,
                                                 "programs": {}})
        for name in programs:
            cells = {}
            for d in depths:
                jax.clear_caches()  # each depth compiles from nothing
                cells[str(d)] = compile_seconds(name, dataclasses.replace(base, num_layers=d),
                                                pol, shapes)
            totals = np.array([cells[str(d)]["total_s"] for d in depths])
            slope, intercept = np.polyfit(np.array(depths, float), totals, 1)
            at = (cells[str(base.num_layers)]["total_s"] if str(base.num_layers) in cells
                  else round(float(intercept + slope * base.num_layers), 2))
            row["programs"][name] = {
                "by_depth": cells, "s_per_layer": round(float(slope), 3),
                "intercept_s": round(float(intercept), 3), "at_preset_depth_s": at,
                "at_preset_depth": ("measured" if str(base.num_layers) in cells
                                    else "extrapolated")}
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    return out


def run(args) -> dict:
    split = [x.strip() for x in args.presets.split(",") if x.strip()]
    programs = [x.strip() for x in args.programs.split(",") if x.strip()]
    depths = [int(x) for x in args.depths.split(",") if x.strip()]
    from jaxrl_lp.plan.programs import ProgramShapes

    shapes = ProgramShapes(rows=args.rows, prompt_len=args.prompt_len, max_new=args.new_tokens)
    return report(split, args.policy, depths, programs, shapes)
