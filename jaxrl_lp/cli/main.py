"""Entry point of the `jaxrl-lp` command.

Each subcommand lives in its own module of `jaxrl_lp.cli` exposing
`add_parser(subparsers)` (which registers the subcommand and sets
`func=run` on its parser) and `run(args) -> int`. Modules are imported only
when present, so the command works while the project grows.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("train", "sft", "sample", "eval", "convert", "config", "bench", "study", "plan")


class UserError(Exception):
    """An error caused by the user's input: printed as one clear line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-lp",
        description="Low-precision RL for dense and looped language models in JAX.",
        epilog="`jaxrl-lp train` runs the embedded default (a small looped model learns "
               "arithmetic on CPU); `jaxrl-lp COMMAND --help` describes a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"jaxrl_lp.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"jaxrl_lp.cli.{name}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:  # plain `jaxrl-lp` explains itself rather than starting a run
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from jaxrl_lp.train.behaviour import ReplayMismatchError
    from jaxrl_lp.train.checkpoint import CheckpointWriteError
    from jaxrl_lp.train.preemption import EXIT_PREEMPTED, Preempted

    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, CheckpointWriteError,
            ReplayMismatchError) as e:  # the run's newest checkpoint stays as it was
        print(f"jaxrl-lp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # a checkpoint was saved: the same command resumes
        print(f"jaxrl-lp {args.command}: {e}", file=sys.stderr)
        return EXIT_PREEMPTED


if __name__ == "__main__":
    sys.exit(main())
