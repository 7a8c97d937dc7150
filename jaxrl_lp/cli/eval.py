"""`jaxrl-lp eval`: held-out accuracy of a run's latest checkpoint (or of a fresh init)."""

from __future__ import annotations

import json

from jaxrl_lp.cli.train import add_common, load


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="greedy held-out accuracy of the run's latest checkpoint")
    add_common(p)
    p.add_argument("--size", type=int, default=None, help="held-out problems (default run.eval_size)")
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train.program import evaluate_run

    print(json.dumps(evaluate_run(load(args), size=args.size), indent=2))
    return 0
