"""`jaxrl-lp eval`: held-out scores of a run's checkpoint: greedy accuracy, mean@k and pass@k.

    jaxrl-lp eval                                   # runs/default, the embedded default config
    jaxrl-lp eval --run runs/fair --served          # the run's own config.json; + its served copy
    jaxrl-lp eval --run runs/fair --exporter fmt:nvfp4   # the copy another exporter would serve
    jaxrl-lp eval --config configs/default.py --set run.out_dir=runs/x --step 40
    jaxrl-lp eval --run runs/mine --samples 8       # + mean@8, pass@1..8 at temperature 1

Only the params (and, with `--served`, the exporter state) are restored, so any
run evaluates: with or without a `sync.exporter`, a warm-start or a finished run.
A run whose task was a config file's `TASK` finds it again through its `task.json`.
A sample is solved when its reward is at least 1 (`train.evaluation.SOLVED`).
"""

from __future__ import annotations

import json

from jaxrl_lp.cli.train import add_common, load_with_task


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
    p.add_argument("--samples", type=int, default=0, metavar="K",
                   help="also sample K completions of each held-out problem: mean@K and pass@k "
                        "for k = 1, 2, 4, ..., K")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="the sampling temperature of --samples (default 1.0)")
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train.config_files import load_run_file
    from jaxrl_lp.train.evaluation import evaluate_run
    from jaxrl_lp.train.run_io import run_config
    from jaxrl_lp.train.task_source import TaskRecord

    if args.samples < 0 or not args.temperature > 0:
        raise ValueError(f"--samples={args.samples} must be >= 0 and --temperature="
                         f"{args.temperature} > 0")
    if args.run:
        cfg = run_config(args.run, args.config, args.overrides)
        record = TaskRecord.read(args.run)
        source = args.config or (record.config_file if record is not None else "")
        task = load_run_file(source)[1] if source else None
    else:
        cfg, task = load_with_task(args)
    print(json.dumps(evaluate_run(cfg, size=args.size, step=args.step, served=args.served,
                                  exporter=args.exporter, task=task, samples=args.samples,
                                  temperature=args.temperature), indent=2))
    return 0
