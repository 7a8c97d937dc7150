"""`jaxrl-lp config`: the resolved config of `--config` and `--set`, validated, as JSON.

The output is what `jaxrl-lp train` with the same options would run, and it
loads back: `jaxrl-lp config --set grpo.lr=1e-4 > my.json` then
`jaxrl-lp train --config my.json`.
"""

from __future__ import annotations

import dataclasses
import json

from jaxrl_lp.cli.train import add_common, load


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="print the resolved config (--config, --set) as JSON",
                       description=__doc__.split("\n\n")[0])
    add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train.logprobs_choice import with_logprobs
    from jaxrl_lp.train.validate import validate

    cfg = load(args)
    plan = validate(cfg)  # the same checks a run makes before it writes anything
    cfg = with_logprobs(cfg, plan.logprobs)  # `grpo.logprobs=auto` as a run resolves it
    print(json.dumps(dataclasses.asdict(cfg), indent=2))
    return 0
