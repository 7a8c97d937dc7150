"""`jaxrl-lp eval`: greedy held-out accuracy of a run's checkpoint.

    jaxrl-lp eval                                   # runs/default, the embedded default config
    jaxrl-lp eval --run runs/fair --served          # the run's own config.json; + its served copy
    jaxrl-lp eval --run runs/fair --exporter fmt:nvfp4   # the copy another exporter would serve
    jaxrl-lp eval --config configs/default.py --set run.out_dir=runs/x --step 40

Only the params (and, with `--served`, the exporter state) are restored, so any
run evaluates: with or without a `sync.exporter`, a warm-start or a finished run.
"""

from __future__ import annotations

import json

from jaxrl_lp.cli.train import add_common, load


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="greedy held-out accuracy of a run's checkpoint",
                       description=__doc__.split("\n\n")[0])
    add_common(p)
    p.add_argument("--run", metavar="RUN_DIR", default=None,
                   help="the run directory; its config.json is the config unless --config is "
                        "given (--set still applies)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--size", type=int, default=None, help="held-out problems (default run.eval_size)")
    p.add_argument("--served", action="store_true",
                   help="also score the served copy: the run's sync.exporter applied with the "
                        "exporter state of the checkpoint (as summary.json's final_accuracy_served)")
    p.add_argument("--exporter", default=None, metavar="SPEC",
                   help="score the copy this sync.exporter serves instead (e.g. fmt:nvfp4; "
                        "implies --served)")
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train.evaluation import evaluate_run
    from jaxrl_lp.train.run_io import run_config

    cfg = run_config(args.run, args.config, args.overrides) if args.run else load(args)
    print(json.dumps(evaluate_run(cfg, size=args.size, step=args.step, served=args.served,
                                  exporter=args.exporter), indent=2))
    return 0
