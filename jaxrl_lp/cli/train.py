"""`jaxrl-lp train`: GRPO training (with no options, the embedded default run)."""

from __future__ import annotations

import json

from jaxrl_lp.cli.help import add_config_keys_help


def add_common(p) -> None:
    """The options every config-driven command shares: --config, --set, and a --help that
    lists every config key with its default."""
    add_config_keys_help(p)
    p.add_argument("--config", help="a Python config file defining CONFIG (see configs/) and/or "
                                    "TASK (a task object of your own), or a config JSON "
                                    "(`jaxrl-lp config` output, a run's config.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (listed below), e.g. --set grpo.lr=1e-3 "
                        "(repeatable)")


def load(args):
    """The config of `--config` and `--set` (each section validated as it is made)."""
    return load_with_task(args)[0]


def load_with_task(args):
    """`(config, task)`: the config as `load`, and the `TASK` the config file defines (None:
    the config's `task` section is the task)."""
    from jaxrl_lp.train import apply_overrides
    from jaxrl_lp.train.config_files import load_run_file

    cfg, task = load_run_file(args.config)
    return apply_overrides(cfg, args.overrides), task


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

    cfg, task = load_with_task(args)
    summary = run_train(cfg, task, refresh=args.refresh,
                        config_file=args.config if task is not None else "")
    print(json.dumps(summary, indent=2))
    return 0
