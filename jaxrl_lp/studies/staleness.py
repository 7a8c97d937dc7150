"""Staleness study: off-policy GRPO at max_staleness 0, 1, 2 on the default task.

docs/design/offpolicy.md, "Off-policy GRPO and placement" (`grpo.max_staleness`, `train.rollout_queue`).
One supervised
warm-start (`grpo.steps=0`) is run once into `<out>/sft`; every arm copies it
and resumes it with the same GRPO phase (the default config's: 60 steps, 32
prompts x 8 samples, Adam 1e-4), changing only how stale its rollouts are:

- `k0`: `grpo.max_staleness=0`, the synchronous loop (reference).
- `k1`, `k2`: the rollout of step n sampled on step n - K's export. The PPO
  ratio divides the replay under the current weights by the sampler's
  recorded log-probs (the default `sampler` anchor): the whole policy change,
  clipped.
- `k1_decoupled`: K = 1 with the ratio anchored on the learner's replay at the
  current weights (`loss.ratio_anchor=learner`) and the policy change weighted
  by truncated importance sampling (`loss.correction=tis`): decoupled PPO, the
  pairing of the asynchronous frameworks.

Every arm verifies replay == sampler on every step (`grpo.verify_every=1`),
so its `mismatch_*` (the numerics alone, at the rollout's own weights) is
measured at each step; `offpolicy_*` measure the current policy against the
behaviour one. Per arm: the series of held-out accuracy, mean reward,
`offpolicy_k3`, `offpolicy_max_abs_dlogp`, `rollout_staleness`, and the
summary `initial_accuracy`, `final_accuracy`, `accuracy_gain`,
`gain_vs_synchronous` (the arm's gain minus k0's), `mismatch_max_abs_dlogp`
(over the whole run; 0 with matched policies), `offpolicy_k3_mean`.
JSON (`staleness.json`, `staleness_series.json`) and plots (`accuracy.png`,
`reward.png`, `offpolicy.png`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from jaxrl_lp.studies.common import QUICK_OVERRIDES, make_config, remove_outputs

__all__ = ["ARMS", "run_staleness"]

ARMS: dict[str, list[str]] = {
    "k0": ["grpo.max_staleness=0"],
    "k1": ["grpo.max_staleness=1"],
    "k2": ["grpo.max_staleness=2"],
    "k1_decoupled": ["grpo.max_staleness=1", "loss.ratio_anchor=learner",
                     "loss.correction=tis"],
}
OUTPUT_FILES = ("staleness.json", "staleness_series.json", "accuracy.png", "reward.png",
                "offpolicy.png")
SERIES_KEYS = ("reward_mean", "offpolicy_k3", "offpolicy_max_abs_dlogp", "rollout_staleness",
               "mismatch_max_abs_dlogp")


def _series(records: list[dict], n_sft: int) -> dict:
    grpo, evals = {}, {}
    for r in records:  # a repeated step (a resumed run) keeps the latest record
        if r.get("phase") == "grpo":
            grpo[int(r["step"]) - n_sft] = r
        elif r.get("phase") == "eval":
            evals[int(r["step"]) - n_sft] = r["accuracy"]
    steps = sorted(grpo)
    return {"step": steps, **{k: [grpo[t].get(k) for t in steps] for k in SERIES_KEYS},
            "eval_step": sorted(evals), "accuracy": [evals[t] for t in sorted(evals)]}


def _plot(series: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, x, key, title in (
            ("accuracy.png", "eval_step", "accuracy", "held-out greedy accuracy"),
            ("reward.png", "step", "reward_mean", "mean reward of the batch learned from"),
            ("offpolicy.png", "step", "offpolicy_k3",
             "k3 KL, behaviour policy vs current (the policy change a ratio carries)")):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for arm, s in series.items():
            pts = [(t, v) for t, v in zip(s[x], s[key], strict=True) if v is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=arm)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)


def run_staleness(out_dir: str | Path = "runs/study-staleness", *, steps: int | None = None,
                  sft_steps: int | None = None, arms: tuple[str, ...] | None = None,
                  overrides: tuple[str, ...] = (), quick: bool = False,
                  progress: bool = False) -> dict:
    """Runs the staleness study (module docstring); writes JSON, series and plots.

    Args:
      out_dir: the study directory (`sft/`, one run directory per arm, JSON,
        PNGs); the study's own outputs there are replaced, nothing else.
      steps: GRPO steps per arm (default: the default config's 60; 3 with `quick`).
      sft_steps: warm-start steps (default: the default config's).
      arms: a subset of `ARMS` (default: all).
      overrides: extra `a.b=c` config overrides for every run.
      quick: a tiny model and batch (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: show the training progress bars.

    Returns:
      The JSON-able result (also in `staleness.json`).
    """
    arms = tuple(arms or ARMS)
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"staleness: unknown arm {a!r}; arms are {list(ARMS)}")
    from jaxrl_lp.train.program import run_train

    t0 = time.time()
    out = Path(out_dir)
    remove_outputs(out, ["sft", *ARMS, *OUTPUT_FILES])
    out.mkdir(parents=True, exist_ok=True)
    common = [*(QUICK_OVERRIDES if quick else ()), *overrides,
              f"run.progress={'true' if progress else 'false'}"]
    if sft_steps is not None:
        common.append(f"sft.steps={sft_steps}")
    steps = steps if steps is not None else (3 if quick else make_config(common).grpo.steps)
    if steps < 1:
        raise ValueError(f"staleness: steps must be >= 1; got {steps}")
    sft_cfg = make_config([*common, "grpo.steps=0", f"run.out_dir={out / 'sft'}"])
    sft_summary = run_train(sft_cfg)
    n_sft = sft_cfg.sft.steps
    timings = {"sft_seconds": round(time.time() - t0, 1)}
    result_arms, all_series = {}, {}
    for arm in arms:
        t_arm = time.time()
        arm_dir = out / arm
        shutil.copytree(out / "sft", arm_dir)
        cfg = make_config([*common, f"grpo.steps={steps}", *ARMS[arm],
                           f"run.out_dir={arm_dir}"])
        summary = run_train(cfg)
        records = [json.loads(x) for x in (arm_dir / "metrics.jsonl").read_text().splitlines()
                   if x]
        s = _series(records, n_sft)
        k3 = [v for v in s["offpolicy_k3"] if v is not None]
        dlogp = [v for v in s["mismatch_max_abs_dlogp"] if v is not None]
        result_arms[arm] = {
            "overrides": ARMS[arm], "initial_accuracy": summary["initial_accuracy"],
            "final_accuracy": summary["final_accuracy"], "accuracy_gain": summary["accuracy_gain"],
            "mismatch_max_abs_dlogp": max(dlogp) if dlogp else None,
            "mismatch_measured_steps": len(dlogp),
            "offpolicy_k3_mean": sum(k3) / len(k3) if k3 else None,
            "rollout_staleness_max": max(s["rollout_staleness"]),
            "skipped_steps": summary["skipped_steps"],
        }
        all_series[arm] = s
        timings[f"{arm}_seconds"] = round(time.time() - t_arm, 1)
    if "k0" in result_arms:
        for fig in result_arms.values():
            fig["gain_vs_synchronous"] = fig["accuracy_gain"] - result_arms["k0"]["accuracy_gain"]
    _plot(all_series, out)
    result = {
        "study": "staleness", "arms": result_arms,
        "setup": {"sft_steps": n_sft, "grpo_steps": steps, "grpo_lr": sft_cfg.grpo.lr,
                  "prompts_per_step": sft_cfg.grpo.prompts_per_step,
                  "group_size": sft_cfg.grpo.group_size, "eval_size": sft_cfg.run.eval_size,
                  "sft_accuracy": sft_summary["final_accuracy"], "seed": sft_cfg.run.seed,
                  "quick": quick, "overrides": list(common)},
        "timings": dict(timings, total_seconds=round(time.time() - t0, 1)),
    }
    (out / "staleness.json").write_text(json.dumps(result, indent=2))
    (out / "staleness_series.json").write_text(json.dumps(all_series, indent=1))
    return result
