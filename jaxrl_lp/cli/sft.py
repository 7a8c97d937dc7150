"""`jaxrl-lp sft`: the supervised phase alone (a train run with grpo.steps=0)."""

from __future__ import annotations

import dataclasses
import json

from jaxrl_lp.cli.train import add_common, load


def add_parser(sub) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning only")
    add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train import run_train

    cfg = load(args)
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, steps=0))
    print(json.dumps(run_train(cfg), indent=2))
    return 0
