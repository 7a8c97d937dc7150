"""LoRA GRPO against full fine-tuning on the default task: accuracy gained, parameters trained.

The default run's flow (`jaxrl-lp train` with no arguments): one supervised
warm-start of the whole model (`grpo.steps=0`) into `<out>/sft`, then, from a
copy of it each, the default run's GRPO phase (`full`: every parameter, Adam
at `grpo.lr`) and LoRA GRPO on the warm-started weights (`lora-r<R>`: rank R
on every layer matmul, alpha `lora.alpha`, the f32 base frozen, Adam at
`--lora-lr`), on the same prompts, seeds and held-out set. Reported per arm:
held-out greedy accuracy before and after GRPO and the gain; the parameters
GRPO trained and their fraction of full fine-tuning's; and `within_margin`:
whether the arm's gain is at least full fine-tuning's less `--margin`
(accuracy points, as a fraction). LoRA starts at exactly the warm-start's
accuracy (B = 0), so the gains compare directly.

`--quick` runs a tiny model for a smoke test; `--warm-start DIR` reuses a
finished warm-start run instead of training one.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--run-dir", default="runs/bench-lora",
                   help="where the warm-start and the arms' runs go (replaced)")
    p.add_argument("--ranks", default="8", help="LoRA ranks to compare, comma-separated")
    p.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA's GRPO learning rate")
    p.add_argument("--margin", type=float, default=0.10,
                   help="a LoRA arm is within the margin when its accuracy gain is at least "
                        "full fine-tuning's minus this (a fraction: 0.10 is 10 points)")
    p.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: the "
                   "default config's)")
    p.add_argument("--warm-start", default=None, metavar="RUN_DIR",
                   help="a finished warm-start run (grpo.steps=0) to start from")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (repeatable)")
    p.add_argument("--quick", action="store_true", help="a tiny model for a smoke run")


def _trained(cfg, plan, lora: bool) -> tuple[int, int]:
    """(parameters the GRPO phase trains, the model's parameters)."""
    import jax

    from jaxrl_lp.lora import adapter_shapes
    from jaxrl_lp.models.model import param_shapes

    count = lambda t: sum(math.prod(s) for s in jax.tree.leaves(
        t, is_leaf=lambda x: isinstance(x, tuple)))
    full = count(param_shapes(plan.model))
    return (count(adapter_shapes(plan.model, cfg.lora)) if lora else full), full


def run(args) -> dict:
    from jaxrl_lp.studies.common import QUICK_OVERRIDES, make_config
    from jaxrl_lp.train.program import run_train
    from jaxrl_lp.train.validate import validate

    ranks = [int(r) for r in str(args.ranks).split(",") if r.strip()]
    if not ranks or min(ranks) < 1:
        raise ValueError(f"--ranks {args.ranks!r}: positive integers, comma-separated")
    out = Path(args.run_dir)
    common = [*(QUICK_OVERRIDES if args.quick else ()), *args.overrides, "run.progress=false",
              "grpo.verify_every=10"]
    if args.grpo_steps is not None:
        common.append(f"grpo.steps={args.grpo_steps}")
    t0 = time.time()
    sft = out / "sft"
    if args.warm_start:
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(args.warm_start, sft)
        sft_summary = json.loads((sft / "summary.json").read_text())
    else:
        if out.exists():
            shutil.rmtree(out)
        sft_summary = run_train(make_config([*common, "grpo.steps=0", f"run.out_dir={sft}"]))
    timings = {"sft_seconds": round(time.time() - t0, 1)}
    arms = {"full": []} | {f"lora-r{r}": [f"lora.rank={r}", f"grpo.lr={args.lora_lr}"]
                           for r in ranks}
    results = {}
    for name, extra in arms.items():
        t = time.time()
        shutil.copytree(sft, out / name)
        cfg = make_config([*common, *extra, f"run.out_dir={out / name}"])
        summary = run_train(cfg)
        trained, total = _trained(cfg, validate(cfg), name != "full")
        results[name] = {
            "initial_accuracy": summary["initial_accuracy"],
            "final_accuracy": summary["final_accuracy"],
            "accuracy_gain": summary["accuracy_gain"], "grpo_lr": cfg.grpo.lr,
            "trained_params": trained, "model_params": total,
            "skipped_steps": summary["skipped_steps"],
            **({"rank": cfg.lora.rank, "alpha": cfg.lora.alpha,
                "targets": list(cfg.lora.target_weights())} if name != "full" else {}),
        }
        timings[f"{name}_seconds"] = round(time.time() - t, 1)
    full = results["full"]
    for name, r in results.items():
        r["trained_fraction"] = r["trained_params"] / full["trained_params"]
        if name != "full":
            r["gain_vs_full"] = r["accuracy_gain"] - full["accuracy_gain"]
            r["within_margin"] = r["accuracy_gain"] >= full["accuracy_gain"] - args.margin
            r["at_most_10_percent_trained"] = r["trained_fraction"] <= 0.10
    cfg = make_config([*common, f"run.out_dir={sft}"])
    return {
        "benchmark": "lora-vs-full",
        "arms": results,
        "margin": args.margin,
        "setup": {"sft_steps": cfg.sft.steps, "sft_accuracy": sft_summary["final_accuracy"],
                  "grpo_steps": cfg.grpo.steps, "full_grpo_lr": cfg.grpo.lr,
                  "lora_grpo_lr": args.lora_lr, "eval_size": cfg.run.eval_size,
                  "prompts_per_step": cfg.grpo.prompts_per_step,
                  "group_size": cfg.grpo.group_size, "seed": cfg.run.seed, "quick": args.quick,
                  "warm_start": args.warm_start, "overrides": common},
        "timings": dict(timings, total_seconds=round(time.time() - t0, 1)),
    }
