"""`jaxrl-lp sft`: the supervised phase alone (a train run with grpo.steps=0).

A binary- or ternary-weight model is trained by config, e.g.
`jaxrl-lp sft --set sft.optimizer=error_diffusion:binary:k=8` (error diffusion,
`jaxrl_lp.optim`) or `--set sft.optimizer=latent_ste:ternary` (f32 latents);
`jaxrl-lp train` with the same setting continues it under GRPO.
"""

from __future__ import annotations

import dataclasses
import json

from jaxrl_lp.cli.train import add_common, load_with_task


def add_parser(sub) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning only")
    add_common(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxrl_lp.train import run_train

    cfg, task = load_with_task(args)
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, steps=0))
    print(json.dumps(run_train(cfg, task, config_file=args.config if task is not None else ""),
                     indent=2))
    return 0
