"""Fair Cast study: does the served bf16 copy follow the f32 master at an RL learning rate?

One supervised warm-start (`grpo.steps=0`) is run once into `<out>/sft`. Each
arm copies that run directory to `<out>/<arm>` and resumes it with the same
short GRPO run (same seed, clipped Adam at `lr`, default 1e-6), starting from
master weights rounded to bf16 values (`sync.bf16_start=true`, as RL from a
released bf16 checkpoint starts). Arms:

- `f32`: `sync.exporter=none`, the sampler runs on the master (the reference).
- `nearest`, `stochastic`, `error_feedback`: `sync.exporter=bf16:<rounding>`
  with the learner's loss on the served copy (`sync.loss_on_served=true`).

Figures per arm (docs/design/sync.md, "Weight export and sync"), from the arm's `metrics.jsonl` (GRPO records)
plus one export of the final master (so the series covers steps 1..N):

- step `t` (1..N) is the number of GRPO updates the master has taken. At step
  0 the master has not moved (served progress is undefined and nothing can
  have changed), so step 0 is left out of every mean.
- `update_retention`: mean over steps of the fraction of served elements whose
  value changed at that step's export.
- `mean_staleness_steps`: mean over steps of the mean per-element staleness as
  the training program logs it (exports since the element's served value last
  changed; the export at step 0 counts, so an element never changed has
  staleness `t + 1` at step `t`).
- `served_progress`: `<s_N - s_0, m_N - m_0> / |m_N - m_0|^2` at the end of the
  run (the export of the final master).
- `lag_steps`: the first step `t` whose served progress reaches 0.5 (null if
  none does). 1 is the smallest possible value.
- `final_accuracy`: greedy held-out accuracy of the final master (the run's
  `summary.json`); `served_final_accuracy`: the same for the final served copy
  (what the sampler would run); `initial_accuracy`: at the start of GRPO (after
  the bf16 rounding).

The `f32` arm is not measured through an exporter: its served copy is the
master, so its series are set by definition (`by_definition: true`): at a
step where the master moved (the previous GRPO update had a non-zero gradient
and was not skipped) retention is 1.0 (every update is served; elements whose
Adam update is exactly zero are not told apart) and staleness 0; at a step
where it did not, retention 0 and staleness one more than before (counting
from 1 at step 0, as the measured arms do); progress is 1.0 from the first
step at which the master has moved, which is then its `lag_steps` (1 when the
first update moved it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from jaxrl_lp.studies.common import (
    QUICK_OVERRIDES,
    make_config,
    remove_outputs,
    reseat_checkpoint,
    restore_state,
)

__all__ = ["ARMS", "arm_figures", "run_fair_cast"]

# The study's arms: the f32 reference and one bf16 served copy per rounding.
ARMS: tuple[str, ...] = ("f32", "nearest", "stochastic", "error_feedback")
DEFAULT_STEPS = 40
DEFAULT_LR = 1e-6
OUTPUT_FILES = ("fair_cast.json", "fair_cast_series.json", "served_progress.png", "retention.png")


def _arm_overrides(arm: str, steps: int, lr: float) -> list[str]:
    out = [f"grpo.steps={steps}", f"grpo.lr={lr}", "sync.bf16_start=true",
           # Only the initial and the final evaluation: the study needs the final accuracy.
           f"run.eval_every={steps + 1}"]
    if arm == "f32":
        return [*out, "sync.exporter=none"]
    return [*out, f"sync.exporter=bf16:{arm}", "sync.loss_on_served=true"]


def _finite(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _grpo_series(records: list[dict], sft_steps: int) -> dict[int, dict]:
    """`{t: record}` for the GRPO records, `t` = updates the master had taken at the export."""
    out = {}
    for r in records:
        if r.get("phase") == "grpo":
            t = int(r["step"]) - sft_steps - 1
            out[t] = r  # a repeated step (a resumed run) keeps the latest record
    return out


def arm_figures(series: dict[str, list]) -> dict:
    """The per-arm figures from its per-step series (`step`, `retention`, `staleness`, `progress`).

    Steps are 1..N (see the module docstring); values may be None (undefined:
    the master has not moved yet, or non-finite).
    """
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return float(np.mean(xs)) if xs else None

    lag = next((t for t, p in zip(series["step"], series["progress"], strict=True)
                if p is not None and p >= 0.5), None)
    return {
        "update_retention": mean(series["retention"]),
        "mean_staleness_steps": mean(series["staleness"]),
        "served_progress": series["progress"][-1] if series["progress"] else None,
        "lag_steps": lag,
    }


def _finished_run_with(run_dir: Path, cfg) -> bool:
    """Whether `run_dir` holds a finished run of `cfg` (ignoring where it was run and
    `run.progress`: a study's `sft/` copied into another study directory is reused)."""
    if not (run_dir / "summary.json").is_file() or not (run_dir / "config.json").is_file():
        return False
    want = json.loads(json.dumps(dataclasses.asdict(cfg)))
    have = json.loads((run_dir / "config.json").read_text())
    for c in (want, have):
        for k in ("progress", "out_dir"):
            c.get("run", {}).pop(k, None)
    return want == have


def _final_export(cfg) -> dict:
    """Exports the final master once more: retention, staleness and progress at step N,
    and the greedy accuracy of that served copy."""
    from jaxrl_lp.rollout.step import LoopSpec
    from jaxrl_lp.sync import progress_update, staleness_update
    from jaxrl_lp.train.evaluation import evaluate

    state, _, task, mcfg, hooks = restore_state(cfg)
    params = state["params"]
    served, sampler_params, sync = hooks.export(state["sync"], params)
    g = cfg.grpo
    acc = evaluate(sampler_params, mcfg, task, hooks.spol, LoopSpec(g.exit_rule, g.compute_mode),
                   cfg.run.eval_size, g.max_new_tokens or task.max_completion_tokens)
    if not hooks.active:
        return {"served_final_accuracy": acc}
    _, m = staleness_update(sync["staleness"], served)
    _, progress = progress_update(sync["progress"], served, params)
    return {"served_final_accuracy": acc, "retention": _finite(m["retention"]),
            "staleness": _finite(m["staleness_mean"]), "progress": _finite(progress)}


def _plot(series: dict[str, dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    panels = (("served_progress.png", "progress", "served progress <s-s0, m-m0>/|m-m0|^2", False),
              ("retention.png", "retention", "update retention (fraction of served elements "
                                             "changed per step)", True))
    for name, key, title, log in panels:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for arm, s in series.items():
            pts = [(t, v) for t, v in zip(s["step"], s[key], strict=True) if v is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="." if len(pts) < 60 else None,
                        label=arm + (" (by definition)" if s.get("by_definition") else ""),
                        linestyle="--" if s.get("by_definition") else "-")
        if key == "progress":
            ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        if log:
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step (updates the master has taken)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written


def run_fair_cast(out_dir: str | Path = "runs/study-fair-cast", *, steps: int = DEFAULT_STEPS,
                  sft_steps: int | None = None, lr: float = DEFAULT_LR,
                  arms: tuple[str, ...] = ARMS, overrides: tuple[str, ...] = (),
                  quick: bool = False, progress: bool = False) -> dict:
    """Runs the Fair Cast study (module docstring); writes `fair_cast.json`, the series and plots.

    Args:
      out_dir: the study directory (`sft/`, one directory per arm, JSON, PNGs).
        The study's own outputs there are replaced, except a finished `sft/`
        run of the same warm-start config, which is reused.
      steps: GRPO steps per arm.
      sft_steps: warm-start steps (default: the default config's `sft.steps`).
      lr: the GRPO (Adam) learning rate.
      arms: a subset of `ARMS`.
      overrides: extra `a.b=c` config overrides for every run (model size...).
      quick: a tiny model and batch (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: show the training progress bars.

    Returns:
      The JSON-able result (also in `fair_cast.json`).
    """
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"fair-cast: unknown arm {a!r}; arms are {list(ARMS)}")
    if steps < 1:
        raise ValueError(f"fair-cast: --steps must be >= 1; got {steps}")
    t0 = time.time()
    out = Path(out_dir)
    common = [*(QUICK_OVERRIDES if quick else ()), *overrides,
              f"run.progress={'true' if progress else 'false'}"]
    if sft_steps is not None:
        common.append(f"sft.steps={sft_steps}")
    sft_cfg = make_config([*common, "grpo.steps=0", f"run.out_dir={out / 'sft'}"])
    reuse = _finished_run_with(out / "sft", sft_cfg)
    # Only what the study writes is replaced; anything else in `out` is left alone.
    ours = [*ARMS, *OUTPUT_FILES, *(() if reuse else ("sft",))]
    remove_outputs(out, ours)
    out.mkdir(parents=True, exist_ok=True)
    from jaxrl_lp.train.program import run_train

    sft_summary = (json.loads((out / "sft" / "summary.json").read_text()) if reuse
                   else run_train(sft_cfg))
    n_sft = sft_cfg.sft.steps
    timings = {"sft_seconds": round(time.time() - t0, 1), "sft_reused": reuse}
    result_arms, all_series = {}, {}
    for arm in arms:
        t_arm = time.time()
        arm_dir = out / arm
        shutil.copytree(out / "sft", arm_dir)
        cfg = make_config([*common, *_arm_overrides(arm, steps, lr), f"run.out_dir={arm_dir}"])
        reseat_checkpoint(sft_cfg, cfg)
        (arm_dir / "config.json").write_text(json.dumps(
            {"study": "fair-cast", "arm": arm, "overrides": [*common, *_arm_overrides(arm, steps, lr)]},
            indent=2))
        summary = run_train(cfg)
        records = [json.loads(x) for x in (arm_dir / "metrics.jsonl").read_text().splitlines() if x]
        grpo = _grpo_series(records, n_sft)
        final = _final_export(cfg)
        by_def = arm == "f32"
        series = {"step": [], "retention": [], "staleness": [], "progress": []}
        stale, moved_once = 1.0, False
        for t in range(1, steps + 1):
            if by_def:  # the served copy is the master: it moves exactly when the master does
                prev = grpo.get(t - 1, {})
                moved = bool(prev.get("grad_norm")) and not prev.get("skipped")
                moved_once |= moved
                stale = 0.0 if moved else stale + 1.0
                vals = (float(moved), stale, 1.0 if moved_once else None)
            elif t == steps:
                vals = (final["retention"], final["staleness"], final["progress"])
            else:
                r = grpo.get(t, {})
                vals = (r.get("update_retention"), r.get("staleness_mean"), r.get("served_progress"))
            series["step"].append(t)
            for k, v in zip(("retention", "staleness", "progress"), vals, strict=True):
                series[k].append(_finite(v))
        fig = arm_figures(series)
        fig.update(
            final_accuracy=summary["final_accuracy"],
            served_final_accuracy=final["served_final_accuracy"],
            initial_accuracy=summary["initial_accuracy"],
            exporter=cfg.sync.exporter, loss_on_served=cfg.sync.loss_on_served,
            by_definition=by_def, skipped_steps=summary["skipped_steps"],
            reward_mean=float(np.mean([r["reward_mean"] for r in grpo.values()])) if grpo else None,
        )
        result_arms[arm] = fig
        all_series[arm] = dict(series, by_definition=by_def)
        timings[f"{arm}_seconds"] = round(time.time() - t_arm, 1)
    _plot(all_series, out)
    result = {
        "study": "fair-cast",
        "arms": result_arms,
        "setup": {
            "sft_steps": n_sft, "grpo_steps": steps, "grpo_lr": lr,
            "optimizer": "adam after clip_by_global_norm(1.0)", "seed": sft_cfg.run.seed,
            "bf16_start": True, "sft_accuracy": sft_summary["final_accuracy"],
            "eval_size": sft_cfg.run.eval_size, "quick": quick, "overrides": list(common),
            "model": {k: getattr(sft_cfg.model, k) for k in
                      ("family", "hidden_size", "num_layers", "loop_steps", "intermediate_size")},
            "prompts_per_step": sft_cfg.grpo.prompts_per_step, "group_size": sft_cfg.grpo.group_size,
            "steps_convention": "step t = updates the master has taken (1..N); lag_steps >= 1",
        },
        "timings": dict(timings, total_seconds=round(time.time() - t0, 1)),
    }
    (out / "fair_cast.json").write_text(json.dumps(result, indent=2))
    (out / "fair_cast_series.json").write_text(json.dumps(all_series, indent=1))
    return result
