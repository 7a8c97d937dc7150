"""LoRA mismatch study: what merged serving costs per base format, and the served-copy loss that removes it.

A learner that adapts a frozen base computes `x W + ((x A) B) s`; a sampler
that serves the merged weights computes `x (W + A B s)` rounded to its served
format, and the two disagree, more so the coarser the format: an adapter
update far below the base format's step is rounded away in the served copy
(the lag Fair Cast measures for full fine-tuning, docs/design/sync.md, "Weight export and sync"). One f32
warm-start of the default model (`grpo.steps=0`) is run once into `<out>/sft`;
every arm copies it and resumes it with the same short LoRA GRPO run (rank
`RANK` on every matmul, the same seed, data order and learning rate; LoRA
starts at the first GRPO step on the warm-started weights, held in the arm's
base format), changing only the base format and the serving:

- `<fmt>_unmerged`: the sampler runs the base and the adapters as the learner
  does (`lora.serve=unmerged`): the replay is the sampler's computation, the
  mismatch is exactly 0.
- `<fmt>_merged`: the sampler runs `W + A B s` rounded back to the base's own
  format (`lora.serve=merged`; f32 serves the f32 merge), the learner computes
  unmerged: the mismatch of merged serving.
- `<fmt>_merged_served`: the same served copy, and the learner's loss on it
  with a straight-through gradient to the adapters (`sync.loss_on_served`):
  the replay is the served copy's computation again, the mismatch exactly 0.

`<fmt>` is each of `BASES` (`f32`, `bf16`, `mxfp8`, `nvfp4`). Per arm, from its
`metrics.jsonl` (every batch replayed and compared, `grpo.verify_every=1`): per
step the mismatch between the sampler's log-probs and the learner's of the
sampled tokens (k1 and k3 KL, max |delta logp|), the served copy against the
learner's merged master (`served_master_k3`, merged arms), the mean reward, and
the held-out greedy accuracy; and the summary figures `mismatch_k3_mean`,
`mismatch_max_abs_dlogp`, `reward_first` / `reward_last`, `initial_accuracy`,
`final_accuracy`, `accuracy_gain`, `replay_verified` (steps whose replay was
the sampler's bits). `merged_mismatch_removed` says per format whether the
merged arm's mismatch was above 0 and the served-copy arm's exactly 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from jaxrl_lp.lora.config import LoraConfig
from jaxrl_lp.studies.common import arm_figures, arm_series, plot_arm_series, warm_start_then_arms

__all__ = ["ARMS", "BASES", "MODES", "arm_overrides", "run_lora_mismatch"]

BASES: tuple[str, ...] = ("f32", "bf16", "mxfp8", "nvfp4")
MODES: tuple[str, ...] = ("unmerged", "merged", "merged_served")
ARMS: tuple[str, ...] = tuple(f"{b}_{m}" for b in BASES for m in MODES)
RANK = 8
# LoRA's GRPO learning rate: 10x the default run's full fine-tuning rate (1e-4), LoRA's
# usual ratio. Rank 8 on every matmul from the default warm-start (47.7%), 60 steps: 1e-3
# gave 91.8%, 3e-3 93.4% (full fine-tuning: 89.8%); `jaxrl-lp bench lora` uses 1e-3 too.
LORA_LR = 1e-3
DEFAULT_STEPS = 6
STUDY_OVERRIDES: tuple[str, ...] = ("grpo.prompts_per_step=16", "run.eval_size=128")
OUTPUT_FILES = ("lora_mismatch.json", "lora_mismatch_series.json", "mismatch.png",
                "max_dlogp.png", "reward.png", "accuracy.png")
SERIES_KEYS = ("mismatch_k1", "mismatch_k3", "mismatch_max_abs_dlogp", "served_master_k3",
               "reward_mean", "replay_verified")


def arm_overrides(arm: str, steps: int) -> list[str]:
    """The config overrides of one arm (on top of the warm-start's config)."""
    if arm not in ARMS:
        raise ValueError(f"lora-mismatch: unknown arm {arm!r}; arms are {list(ARMS)}")
    base, mode = arm.split("_", 1)
    out = [f"grpo.steps={steps}", f"grpo.lr={LORA_LR}", f"lora.rank={RANK}",
           f"lora.base_format={base}"]
    if mode == "unmerged":
        return out
    out.append("lora.serve=merged")
    return [*out, "sync.loss_on_served=true"] if mode == "merged_served" else out


def _arm_result(records: list[dict], n_sft: int, summary: dict) -> tuple[dict, dict]:
    series = arm_series(records, n_sft, SERIES_KEYS)
    fig = arm_figures(series, summary, means=("served_master_k3",))
    fig["replay_verified"] = int(sum(x or 0 for x in series["replay_verified"]))
    return series, fig


def _plot(series: dict[str, dict], out: Path) -> None:
    styles = {"unmerged": ":", "merged": "-", "merged_served": "--"}
    colors = {"f32": "black", "bf16": "tab:blue", "mxfp8": "tab:orange", "nvfp4": "tab:red"}
    panels = (("mismatch.png", "step", "mismatch_k3",
               f"LoRA rank {RANK}: mismatch KL k3 (sampler vs learner)", True),
              ("max_dlogp.png", "step", "mismatch_max_abs_dlogp",
               f"LoRA rank {RANK}: max |delta logp|", True),
              ("reward.png", "step", "reward_mean", f"LoRA rank {RANK}: mean reward", False),
              ("accuracy.png", "eval_step", "accuracy",
               f"LoRA rank {RANK}: held-out greedy accuracy", False))

    def style(arm):
        base, _, mode = arm.partition("_")
        return styles[mode], colors[base]

    plot_arm_series(series, out, panels, style, linthresh=1e-8)


def run_lora_mismatch(out_dir: str | Path = "runs/study-lora-mismatch", *,
                      steps: int | None = None, sft_steps: int | None = None,
                      arms: tuple[str, ...] | None = None, overrides: tuple[str, ...] = (),
                      quick: bool = False, progress: bool = False) -> dict:
    """Runs the LoRA mismatch study (module docstring); writes JSON, series and plots.

    Args:
      out_dir: the study directory (`sft/`, one run directory per arm, JSON, PNGs);
        the study's own outputs there are replaced, nothing else.
      steps: LoRA GRPO steps per arm (default `DEFAULT_STEPS`; 2 with `quick`).
      sft_steps: warm-start steps (default: the default config's `sft.steps`).
      arms: a subset of `ARMS` (default: all twelve).
      overrides: extra `a.b=c` config overrides for every run, after the study's own.
      quick: a tiny model and batch (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: show the training progress bars.

    Returns:
      The JSON-able result (also in `lora_mismatch.json`).
    """
    ran = warm_start_then_arms(
        "lora-mismatch", out_dir, valid=ARMS, arms=arms, arm_overrides=arm_overrides,
        steps=steps, default_steps=DEFAULT_STEPS, sft_steps=sft_steps,
        study_overrides=STUDY_OVERRIDES, overrides=overrides, quick=quick, progress=progress,
        outputs=OUTPUT_FILES)
    out, steps, sft_cfg, sft_summary, runs, timings, t0, common = ran
    n_sft = sft_cfg.sft.steps
    result_arms, all_series = {}, {}
    for arm, (_, summary, records) in runs.items():
        series, fig = _arm_result(records, n_sft, summary)
        base, _, mode = arm.partition("_")
        fig.update(base_format=base, serve="merged" if mode != "unmerged" else "unmerged",
                   loss_on_served=mode == "merged_served")
        result_arms[arm], all_series[arm] = fig, series
    _plot(all_series, out)
    removed = {}
    for base in BASES:
        m, s = result_arms.get(f"{base}_merged"), result_arms.get(f"{base}_merged_served")
        if m is not None and s is not None and m["mismatch_max_abs_dlogp"] is not None:
            removed[base] = (m["mismatch_max_abs_dlogp"] > 0
                             and s["mismatch_max_abs_dlogp"] == 0.0
                             and s["replay_verified"] == steps)
    result = {
        "study": "lora-mismatch",
        "arms": result_arms,
        "merged_mismatch_removed": removed,
        "setup": {
            "rank": RANK, "alpha": LoraConfig().alpha, "grpo_lr": LORA_LR,
            "sft_steps": n_sft, "grpo_steps": steps, "sft_accuracy": sft_summary["final_accuracy"],
            "policy": sft_cfg.grpo.learner_policy, "eval_size": sft_cfg.run.eval_size,
            "prompts_per_step": sft_cfg.grpo.prompts_per_step,
            "group_size": sft_cfg.grpo.group_size, "seed": sft_cfg.run.seed, "quick": quick,
            "overrides": list(common),
            "model": {k: getattr(sft_cfg.model, k) for k in
                      ("family", "hidden_size", "num_layers", "loop_steps", "intermediate_size")},
        },
        "timings": dict(timings, total_seconds=round(time.time() - t0, 1)),
    }
    (out / "lora_mismatch.json").write_text(json.dumps(result, indent=2))
    (out / "lora_mismatch_series.json").write_text(json.dumps(all_series, indent=1))
    return result
