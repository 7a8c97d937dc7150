"""`jaxrl-lp train`: GRPO training (with no arguments, the embedded default run)."""

from __future__ import annotations

import json


def add_common(p) -> None:
    p.add_argument("--config", help="a Python config file defining CONFIG (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set grpo.lr=1e-3 (repeatable)")


def load(args):
    from jaxrl_lp.train import apply_overrides, load_config

    return apply_overrides(load_config(args.config), args.overrides)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="supervised warm-start then GRPO; resumes from the run "
                                     "directory's latest checkpoint")
    add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train import run_train

    summary = run_train(load(args))
    print(json.dumps(summary, indent=2))
    return 0
