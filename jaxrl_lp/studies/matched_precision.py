"""Matched-precision study: GRPO with the sampler and the learner in the same FP8/FP4 format.

End-to-end FP8 and FP4 RL. One supervised warm-start
(`grpo.steps=0`, the default config's f32 policy) is run once into
`<out>/sft`; every arm copies it and resumes it with the same short GRPO run
(same seed, data order and learning rate), changing only the two precision
policies and the mismatch correction:

- `f32`: learner and sampler `fp32` (the default run's GRPO phase; reference).
- `<fmt>_matched`: learner and sampler both the `<fmt>` preset (quantized
  matmuls with straight-through gradients to the f32 master). The learner's
  hybrid log-probs replay the sampler's own step computation, so the logged
  mismatch is exactly 0.
- `<fmt>_unmatched`: sampler `<fmt>`, learner `UNMATCHED_LEARNER` (`bf16`),
  no correction; the PPO ratio is anchored on the sampler's log-probs, so it
  carries `pi_learner / pi_sampler` uncorrected (what a run that ignores the
  mismatch does).
- `<fmt>_unmatched_tis` / `<fmt>_unmatched_mis`: the same, with token
  truncated / masked importance sampling (`loss.correction=tis|mis`, cap
  `loss.correction_cap`, default 2) and the ratio anchored on the learner's
  recomputed log-probs (`loss.ratio_anchor=learner`, the usual pairing).

`<fmt>` is each of `FORMATS` (`fp8` per-tensor E4M3, `mxfp8`, `mxfp4`,
`nvfp4`; docs/design/low_precision.md, "Number formats"). Per arm, from its `metrics.jsonl`: the per-step
series of mismatch (k1 and k3 KL between the sampler's and the learner's
log-probs of the sampled tokens, max |delta logp|), the fraction of tokens
masked (MIS) or truncated (TIS), the mean reward, and the held-out greedy
accuracy (evaluated every `eval_every` steps, with the arm's sampler policy);
and the summary figures `mismatch_k1_mean`, `mismatch_k3_mean`,
`mismatch_max_abs_dlogp`, `frac_masked_mean`, `frac_truncated_mean`,
`reward_first` / `reward_last` (means over the first / last quarter of the
steps), `initial_accuracy`, `final_accuracy`, `accuracy_gain`.
`matched_below_unmatched` says, per format, whether the matched arm's mean k3
KL and max |delta logp| are both below every unmatched arm's (k3 rather than k1:
the k1 estimate of a small KL is often negative on a finite batch).

Defaults: `DEFAULT_STEPS` GRPO steps per arm, 16 prompts x 8 samples, 128
held-out problems, all 17 arms; a matched arm's time is mostly the compile of
its quantized learner step. `--steps 60 --set grpo.prompts_per_step=32 --set
run.eval_size=256` is the default run's GRPO phase per arm. What both took and
gave: docs/design/studies.md, "What the default studies cost".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from jaxrl_lp.studies.common import arm_figures, arm_series, plot_arm_series, warm_start_then_arms

__all__ = ["ARMS", "DEFAULT_ARMS", "FORMATS", "KINDS", "arm_overrides", "run_matched_precision"]

FORMATS: tuple[str, ...] = ("fp8", "mxfp8", "mxfp4", "nvfp4")
KINDS: tuple[str, ...] = ("matched", "unmatched", "unmatched_tis", "unmatched_mis")
ARMS: tuple[str, ...] = ("f32", *(f"{f}_{k}" for f in FORMATS for k in KINDS))
# The learner of the unmatched arms: a bf16 learner beside an FP8/FP4 sampler.
UNMATCHED_LEARNER = "bf16"
DEFAULT_STEPS = 6
# Every arm by default: 17 short runs. A subset (`--arms`) trades formats for steps.
DEFAULT_ARMS = ARMS
# Smaller than the default run's GRPO batch (32 x 8) and held-out set (256), so 17 arms fit
# in the default study's time; `--set` restores them.
STUDY_OVERRIDES: tuple[str, ...] = ("grpo.prompts_per_step=16", "run.eval_size=128")
OUTPUT_FILES = ("matched_precision.json", "matched_precision_series.json", "mismatch.png",
                "reward.png", "accuracy.png", "masked.png")
SERIES_KEYS = ("mismatch_k1", "mismatch_k3", "mismatch_max_abs_dlogp", "frac_masked",
               "frac_truncated", "reward_mean")


def arm_overrides(arm: str, steps: int) -> list[str]:
    """The config overrides of one arm (on top of the warm-start's config)."""
    if arm not in ARMS:
        raise ValueError(f"matched-precision: unknown arm {arm!r}; arms are {list(ARMS)}")
    out = [f"grpo.steps={steps}"]
    if arm == "f32":
        return [*out, "grpo.learner_policy=fp32", "grpo.sampler_policy=fp32"]
    fmt, kind = arm.split("_", 1)
    if kind == "matched":
        return [*out, f"grpo.learner_policy={fmt}", f"grpo.sampler_policy={fmt}"]
    out += [f"grpo.learner_policy={UNMATCHED_LEARNER}", f"grpo.sampler_policy={fmt}"]
    if kind == "unmatched":
        return [*out, "loss.correction=none", "loss.ratio_anchor=sampler"]
    return [*out, f"loss.correction={kind.rsplit('_', 1)[1]}", "loss.ratio_anchor=learner"]


def _arm_result(records: list[dict], n_sft: int, summary: dict) -> tuple[dict, dict]:
    """The arm's per-step series and summary figures from its metrics records."""
    series = arm_series(records, n_sft, SERIES_KEYS)
    return series, arm_figures(series, summary, means=("frac_masked", "frac_truncated"))


def _plot(series: dict[str, dict], out: Path) -> list[Path]:
    styles = {"matched": "-", "unmatched": ":", "unmatched_tis": "--", "unmatched_mis": "-."}
    colors = {"f32": "black", "fp8": "tab:blue", "mxfp8": "tab:orange", "mxfp4": "tab:green",
              "nvfp4": "tab:red"}
    panels = (("mismatch.png", "step", "mismatch_k1",
               "mismatch KL k1 (sampler vs learner; 0 = exact agreement)", True),
              ("masked.png", "step", "frac_masked", "fraction of tokens masked (MIS)", False),
              ("reward.png", "step", "reward_mean", "mean reward", False),
              ("accuracy.png", "eval_step", "accuracy", "held-out greedy accuracy", False))

    def style(arm):
        fmt, _, kind = arm.partition("_")
        return styles.get(kind, "-"), colors.get(fmt)

    return plot_arm_series(series, out, panels, style)


def run_matched_precision(out_dir: str | Path = "runs/study-matched-precision", *,
                          steps: int | None = None, sft_steps: int | None = None,
                          arms: tuple[str, ...] | None = None, overrides: tuple[str, ...] = (),
                          quick: bool = False, progress: bool = False) -> dict:
    """Runs the matched-precision study (module docstring); writes JSON, series and plots.

    Args:
      out_dir: the study directory (`sft/`, one run directory per arm, JSON,
        PNGs); the study's own outputs there are replaced, nothing else.
      steps: GRPO steps per arm (default `DEFAULT_STEPS`; 2 with `quick`).
      sft_steps: warm-start steps (default: the default config's `sft.steps`).
      arms: a subset of `ARMS` (default `DEFAULT_ARMS`).
      overrides: extra `a.b=c` config overrides for every run (model size...),
        applied after the study's own batch and eval sizes.
      quick: a tiny model and batch (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: show the training progress bars.

    Returns:
      The JSON-able result (also in `matched_precision.json`).
    """
    ran = warm_start_then_arms(
        "matched-precision", out_dir, valid=ARMS, arms=arms or DEFAULT_ARMS,
        arm_overrides=arm_overrides, steps=steps, default_steps=DEFAULT_STEPS, sft_steps=sft_steps,
        study_overrides=STUDY_OVERRIDES, overrides=overrides, quick=quick, progress=progress,
        outputs=OUTPUT_FILES)
    out, steps, sft_cfg, sft_summary, runs, timings, t0, common = ran
    n_sft = sft_cfg.sft.steps
    result_arms, all_series = {}, {}
    for arm, (cfg, summary, records) in runs.items():
        series, fig = _arm_result(records, n_sft, summary)
        fmt, _, kind = arm.partition("_")
        fig.update(format=None if arm == "f32" else fmt, kind=kind or "reference",
                   learner_policy=cfg.grpo.learner_policy, sampler_policy=cfg.grpo.sampler_policy,
                   correction=cfg.loss.correction, ratio_anchor=cfg.loss.ratio_anchor)
        result_arms[arm] = fig
        all_series[arm] = series
    _plot(all_series, out)
    below = {}
    for fmt in FORMATS:
        m = result_arms.get(f"{fmt}_matched")
        others = [result_arms[f"{fmt}_{k}"] for k in KINDS[1:] if f"{fmt}_{k}" in result_arms]
        keys = ("mismatch_k3_mean", "mismatch_max_abs_dlogp")
        if m is not None and others and all(m[k] is not None for k in keys):
            below[fmt] = all(o[k] is not None and m[k] < o[k] for o in others for k in keys)
    result = {
        "study": "matched-precision",
        "arms": result_arms,
        "matched_below_unmatched": below,
        "setup": {
            "sft_steps": n_sft, "grpo_steps": steps, "grpo_lr": sft_cfg.grpo.lr,
            "unmatched_learner": UNMATCHED_LEARNER, "correction_cap": sft_cfg.loss.correction_cap,
            "logprobs": sft_cfg.grpo.logprobs, "seed": sft_cfg.run.seed,
            "sft_accuracy": sft_summary["final_accuracy"], "eval_size": sft_cfg.run.eval_size,
            "prompts_per_step": sft_cfg.grpo.prompts_per_step,
            "group_size": sft_cfg.grpo.group_size, "quick": quick, "overrides": list(common),
            "model": {k: getattr(sft_cfg.model, k) for k in
                      ("family", "hidden_size", "num_layers", "loop_steps", "intermediate_size")},
        },
        "timings": dict(timings, total_seconds=round(time.time() - t0, 1)),
    }
    (out / "matched_precision.json").write_text(json.dumps(result, indent=2))
    (out / "matched_precision_series.json").write_text(json.dumps(all_series, indent=1))
    return result
