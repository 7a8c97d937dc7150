"""`jaxrl-lp train`: GRPO training (with no options, the embedded default run)."""

from __future__ import annotations

import json

from jaxrl_lp.cli.help import add_config_keys_help


def add_common(p) -> None:
    """The options every config-driven command shares: --config, --set, and a --help that
    lists every config key with its default."""
    add_config_keys_help(p)
    p.add_argument("--config", help="a Python config file defining CONFIG (see configs/), or a "
                                    "config JSON (`jaxrl-lp config` output, a run's config.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (listed below), e.g. --set grpo.lr=1e-3 "
                        "(repeatable)")


def load(args):
    """The config of `--config` and `--set` (each section validated as it is made)."""
    from jaxrl_lp.train import apply_overrides, load_config

    return apply_overrides(load_config(args.config), args.overrides)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="supervised warm-start then GRPO; resumes from the run "
                                     "directory's latest checkpoint")
    add_common(p)
    p.add_argument("--refresh", action="store_true",
                   help="for a run that is already complete: redo its final evaluation, "
                        "summary.json and plots (by default a complete run is left unchanged)")
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train import run_train

    summary = run_train(load(args), refresh=args.refresh)
    print(json.dumps(summary, indent=2))
    return 0
