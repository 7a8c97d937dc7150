"""`jaxrl-lp bench TARGET`: performance benchmarks, one JSON object on stdout.

Each target is a module `jaxrl_lp.bench.<target>` exposing `add_arguments(parser)`
(its options) and either `run(args) -> dict` (the result, which this command
prints as JSON and, with `--out`, writes to a file) or `main(args) -> int` (a
target that prints its own JSON). To add a target, write the module and add its
name to `TARGETS`; a target whose module is not present is left out.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jaxrl_lp.cli.help import show_defaults

TARGETS = ("sampler", "exactness", "replay", "smoke", "learner", "iteration", "kernels",
           "speculative", "lowering", "compile", "overlap", "lora", "hotpath", "multiturn",
           "decode")


def _target_modules() -> dict:
    mods = {}
    for name in TARGETS:
        try:
            mods[name] = importlib.import_module(f"jaxrl_lp.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"jaxrl_lp.bench.{name}":
                raise
    return mods


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="performance benchmarks (JSON out)",
        description="Runs a benchmark and prints its result as one JSON object.")
    targets = parser.add_subparsers(dest="target", metavar="TARGET")
    for name, mod in _target_modules().items():
        doc = (mod.__doc__ or name).strip()
        sub = targets.add_parser(name, help=doc.splitlines()[0], description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sub)
        if hasattr(mod, "run"):
            sub.add_argument("--out", default=None, help="also write the JSON to this file")
        show_defaults(sub)
        sub.set_defaults(bench_module=mod)
    parser.set_defaults(func=run, bench_parser=parser)


def run(args) -> int:
    mod = getattr(args, "bench_module", None)
    if mod is None:
        args.bench_parser.print_help(sys.stderr)
        return 2
    if not hasattr(mod, "run"):
        return int(mod.main(args) or 0)
    from jaxrl_lp.bench import emit

    emit(mod.run(args), args.out, indent=2)
    return 0
