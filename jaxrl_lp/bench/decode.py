"""The decode step's program for a GPU, read from this host: ops per step, the weights in the loop.

The sampler's whole program (`rollout.generate.sampler_program`: the prefill, then
the decode `while` loop) at a preset's real size, low precision stored natively as
on a GPU, in the decode layout a GPU gets (`as_stored`), read twice
(`plan.decode_step`):

- `lowered`: lowered for `cuda` on this host (always): the HLO ops of one step;
- `compiled`: XLA:GPU's optimized program for `--target` (`plan.cuda_aot`: the
  deviceless compile through the CUDA PJRT plugin, `--cuda-plugin` or
  `$JAXRL_LP_CUDA_PLUGIN`; left out, with the reason, where there is none): the
  kernels one step launches, by kind, once per `--xla-gpu-flags` preset.

Each says what the loop carries as weights (bytes by dtype) and lists every op
that copies, slices or converts a weight on every step (`weight_ops`; expected:
none, the weights are unstacked and rounded once per call before the loop,
`models.blocks.unstack_layers`, `decode_weights`), and the loops nested in the
step (expected: none; a scan over stacked layers would be one).

    jaxrl-lp bench decode                                  # qwen3-0.6b bf16, B 32, lowered
    JAXRL_LP_CUDA_PLUGIN=DIR jaxrl-lp bench decode --xla-gpu-flags none,decode_graphs

Exit status 1 when a step converts, slices or copies a weight, or nests a loop. An op that
rebuilds a weight's values from its quantized codes (an MX format's decode copy, whose products
on Hopper multiply the values) is listed in `code_rebuilds` and not counted.
What it cannot say: how long a kernel takes (a GPU's profile does: `benchmarks/gpu.sh`,
`SUITE=profile`), or what autotuning on a device would pick for each product. XLA
forms CUDA graphs (command buffers) after the HLO passes, from the thunks, so the
`decode_graphs` preset does not show in the compiled text: only a GPU measures it
(`SUITE=graphs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

from jaxrl_lp.bench import emit
from jaxrl_lp.numerics.policy import policy_arg
from jaxrl_lp.plan.cuda_aot import PLUGIN_ENV

__all__ = ["DRAWS", "add_arguments", "draw_traced", "lowered_text", "main", "report",
           "sampler_traced"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxrl-lp bench decode`."""
    parser.add_argument("--preset", default="qwen3-0.6b", help="model preset")
    parser.add_argument("--policy", default="bf16", type=policy_arg, help="precision policy")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the preset's own)")
    parser.add_argument("--rows", type=int, default=32, help="B (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--target", default="h200", help="the GPU compiled for: h100, h200")
    parser.add_argument("--cuda-plugin", default=None,
                        help="folder holding the CUDA PJRT plugin (plan.cuda_aot); default "
                             "$JAXRL_LP_CUDA_PLUGIN; none: the lowered program only")
    parser.add_argument("--xla-gpu-flags", default="none",
                        help="presets to compile with, one compile each (jaxrl_lp.xla_flags; "
                             "comma-separated; combine two in one compile with '+')")
    parser.add_argument("--out", default=None, help="also write the JSON here")


def _spec(args) -> dict:
    return {"preset": args.preset, "policy": args.policy, "layers": args.layers,
            "rows": args.rows, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}


def _model(spec: dict):
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.numerics.policy import require
    from jaxrl_lp.plan.programs import native

    cfg = get_preset(spec["preset"])
    if spec.get("layers"):
        cfg = dataclasses.replace(cfg, num_layers=spec["layers"])
    return cfg, native(require(spec["policy"], "bench decode"))


def sampler_traced(spec: dict, sharding=None):
    """`sampler_program` traced at `spec`'s sizes (abstract inputs carrying `sharding`)."""
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.rollout.generate import Forced, sampler_program
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.step import LoopSpec

    cfg, policy = _model(spec)
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    params = jax.tree.map(lambda x: s(x.shape, x.dtype),
                          jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))))
    b, p, n, i32 = spec["rows"], spec["prompt_len"], spec["new_tokens"], jnp.int32
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding)
    forced = Forced(s((b, n), i32), s((b, n), i32), s((), jnp.bool_))
    return sampler_program.trace(
        params, s((b, p), i32), s((b, p), i32), s((b,), i32), key, s((), i32), forced,
        cfg=cfg, policy=policy, loop=LoopSpec().resolve(cfg),
        sampling=SamplingConfig(temperature=1.0), max_new_tokens=n, eos_id=None, pad_id=0,
        layout="as_stored")


# The draws `bench decode` compiles alone (`--draws`): `rollout.sampling.SamplingConfig` fields.
DRAWS = {"gumbel": {}, "greedy": {"greedy": True}, "inverse_cdf": {"draw": "inverse_cdf"},
         "top_k_50": {"top_k": 50}, "top_p_0.9": {"top_p": 0.9}}


def draw_traced(spec: dict, sharding=None):
    """One step's token choice and log-prob (`choose_tokens`, `token_logprobs`) over [B, V]
    f32 logits, under the sampling of `DRAWS[spec["draw"]]`, traced."""
    from jaxrl_lp.rollout.sampling import SamplingConfig, choose_tokens, token_logprobs

    cfg, _ = _model(spec)
    sampling = SamplingConfig(**DRAWS[spec["draw"]])
    logits = jax.ShapeDtypeStruct((spec["rows"], cfg.vocab_size), jnp.float32, sharding=sharding)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding)

    def draw(logits_BxV, key):
        tokens_B = choose_tokens(logits_BxV, key, sampling)
        return tokens_B, token_logprobs(logits_BxV, tokens_B, sampling.temperature)

    return jax.jit(draw).trace(logits, key)


def lowered_text(spec: dict) -> str:
    """The sampler's program lowered for `cuda` on this host, as HLO text."""
    lowered = sampler_traced(spec).lower(lowering_platforms=("cuda",))
    return lowered.compiler_ir("hlo").get_hlo_module().to_string()


def min_weight_elems(spec: dict) -> int:
    """The smallest matmul weight's elements: below it an array is not a weight here."""
    from jaxrl_lp.models.model import init_params

    cfg, _ = _model(spec)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    layer = [x.size // x.shape[0] for x in jax.tree.leaves(params["layers"]) if x.ndim == 3]
    return min(layer)


def _bad(step: dict) -> list[str]:
    out = [f"{len(step['weight_ops'])} ops copy, slice or convert a weight each step"
           ] if step["weight_ops"] else []
    if step["nested_loops"]:
        out.append(f"{step['nested_loops']} loops nested in the step")
    return out


def report(spec: dict, target: str = "h200", plugin: str | None = None,
           flag_sets: tuple[str, ...] = ("none",)) -> dict:
    """The JSON of `jaxrl-lp bench decode` (module docstring)."""
    from jaxrl_lp.bench.hotpath import _commit
    from jaxrl_lp.plan.cuda_aot import compiled_text
    from jaxrl_lp.plan.decode_step import decode_step_ops, program_ops
    from jaxrl_lp.xla_flags import flags_for, parse

    least = min_weight_elems(spec)
    cfg, _ = _model(spec)
    logits = spec["rows"] * cfg.vocab_size
    t0 = time.perf_counter()
    lowered = decode_step_ops(lowered_text(spec), least, False).as_dict()
    del lowered["logits_passes"]  # counted where each op is a pass: the compiled text
    out = {"target": "decode", "date": datetime.date.today().isoformat(),
           "machine": f"{platform.machine()} {platform.system().lower()}, "
                      f"{os.cpu_count()} cores (nothing runs on a GPU)",
           "jax": jax.__version__, "commit": _commit(), "command": _command(plugin),
           **spec, "policy": spec["policy"].name, "min_weight_elems": least,
           "lowered": {"platform": "cuda", **lowered, "seconds": round(time.perf_counter() - t0, 1)}}
    problems = [f"lowered: {p}" for p in _bad(lowered)]
    if plugin is None:
        out["compiled"] = {"skipped": "no CUDA PJRT plugin (--cuda-plugin, "
                                      "$JAXRL_LP_CUDA_PLUGIN; plan.cuda_aot)"}
    else:
        from pathlib import Path

        out["compiled"] = {"target": target, "cuda_plugin": sorted(
            p.name.removesuffix(".dist-info") for p in Path(plugin).glob("jax_cuda*.dist-info"))}
        for name in flag_sets:
            presets = parse(name.replace("+", ","), "--xla-gpu-flags")
            t0 = time.perf_counter()
            # The policy crosses to the child by its name (parsed at the child's command line).
            text = compiled_text("jaxrl_lp.bench.decode:sampler_traced",
                                 {**spec, "policy": spec["policy"].name}, target, plugin,
                                 " ".join(flags_for(presets)))
            step = decode_step_ops(text, least, True, logits).as_dict()
            out["compiled"][name] = {"flags": list(flags_for(presets)), **step,
                                     "seconds": round(time.perf_counter() - t0, 1)}
            problems += [f"compiled ({name}): {p}" for p in _bad(step)]
        # The token choice alone, by sampling (the logits an input, so not written here).
        out["compiled"]["draws"] = {
            draw: program_ops(compiled_text("jaxrl_lp.bench.decode:draw_traced",
                                            {**spec, "policy": spec["policy"].name, "draw": draw},
                                            target, plugin), logits)
            for draw in DRAWS}
    out["problems"] = problems
    out["ok"] = not problems
    return out


def _command(plugin: str | None) -> str:
    """This process's command line as typed (the plugin's folder as the variable naming it)."""
    argv = list(sys.argv[1:])
    if "--cuda-plugin" in argv:
        i = argv.index("--cuda-plugin")
        del argv[i:i + 2]
    prefix = f"{PLUGIN_ENV}=DIR " if plugin else ""
    return f"{prefix}jaxrl-lp {' '.join(argv)}".strip()


def main(args: argparse.Namespace) -> int:
    """`jaxrl-lp bench decode`: prints the JSON; exit 1 when a step touches a weight."""
    from jaxrl_lp.plan.cuda_aot import GPU_TARGETS, plugin_from_env

    for n, v in (("--rows", args.rows), ("--prompt-len", args.prompt_len),
                 ("--new-tokens", args.new_tokens), ("--layers", args.layers or 1)):
        if v < 1:
            print(f"jaxrl-lp bench decode: {n} must be >= 1, got {v}", file=sys.stderr)
            return 2
    try:
        if args.target not in GPU_TARGETS:
            raise ValueError(f"--target must be one of {', '.join(GPU_TARGETS)}, "
                             f"got {args.target!r}")
        plugin = plugin_from_env(args.cuda_plugin)
        flag_sets = tuple(s.strip() for s in args.xla_gpu_flags.split(",") if s.strip())
        from jaxrl_lp.xla_flags import parse

        for name in flag_sets:
            parse(name.replace("+", ","), "--xla-gpu-flags")
    except ValueError as e:
        print(f"jaxrl-lp bench decode: {e}", file=sys.stderr)
        return 2
    out = report(_spec(args), args.target, plugin, flag_sets or ("none",))
    emit(out, args.out)
    return 0 if out["ok"] else 1
