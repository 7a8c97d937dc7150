"""Helpers the studies share: configs, restoring a run's state, re-seating a checkpoint.

The studies drive the training program (`jaxrl_lp.train.run_train`) and read
its run directories back. Two things the program does not offer as public API
live here:

- `restore_state(cfg)`: the full checkpointed state (params, optimizer states,
  sync state) of the latest checkpoint in `cfg.run.out_dir`, restored into the
  structure `cfg` implies.
- `reseat_checkpoint(src_cfg, dst_cfg)`: rewrites the latest checkpoint of
  `dst_cfg.run.out_dir` (a copy of `src_cfg`'s run) with the sync-state
  structure `dst_cfg` expects. A warm-start run with `sync.exporter=none`
  stores an empty sync state; resuming it with an exporter set fails in orbax
  because the tree structures differ. The sync state is re-initialised by
  `SyncHooks.start` at the first GRPO step anyway, so its content does not
  matter, only its structure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.config_files import apply_overrides
from jaxrl_lp.train.defaults import default_config
from jaxrl_lp.train.sync_hooks import SyncHooks

__all__ = ["QUICK_OVERRIDES", "ArmRuns", "arm_figures", "arm_series", "check_arms",
           "check_overrides", "make_config", "plot_arm_series", "remove_outputs",
           "reseat_checkpoint", "restore_state", "warm_start_then_arms"]

# A tiny model, task and batch for smoke runs (`--quick`, the tests). One-digit addition
# and 100 warm-start steps give the tiny model some reward variance (about 20% accuracy),
# without which GRPO does not move the master at all.
QUICK_OVERRIDES: tuple[str, ...] = (
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
    "model.head_dim=16", "model.intermediate_size=64", "model.loop_steps=2",
    "task.max_digits=1", "sft.steps=100", "sft.lr=1e-2", "sft.batch_size=16",
    "grpo.prompts_per_step=4", "grpo.group_size=4", "run.eval_size=32",
)


def make_config(overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """The default config (read at call time) with `a.b=c` overrides applied in order.

    A study measures the mismatch at every GRPO step: `grpo.verify_every=1`
    (a study's own overrides may change it), so where the learner takes the
    sampler's recorded log-probs (`grpo.replay=auto`) the batch is still
    replayed and compared, and the `mismatch_*` metrics are logged each step.
    """
    return apply_overrides(default_config(), ["grpo.verify_every=1", *overrides])


def check_overrides(study: str, overrides, owned) -> None:
    """A one-line ValueError for an override of a key the study sets itself (`owned`)."""
    for o in overrides:
        key = str(o).split("=", 1)[0].strip()
        if key in owned:
            raise ValueError(f"{study}: --set {key} is set by the study itself (its arms, "
                             f"--steps, --out); remove it")


def check_arms(study: str, arms, valid: tuple[str, ...], what: str = "arm") -> tuple[str, ...]:
    """`arms` as a tuple (None: `valid`); a one-line ValueError naming the valid ones."""
    if arms is None:
        return valid
    arms = tuple(arms)
    bad = [a for a in arms if a not in valid]
    if bad or not arms:
        raise ValueError(f"{study}: unknown {what}(s) {bad or '(none given)'}; "
                         f"{what}s are {','.join(valid)}")
    return arms


def remove_outputs(out: Path, names: list[str] | tuple[str, ...]) -> None:
    """Deletes the entries `names` (files or directories) of `out`, and nothing else."""
    for name in names:
        p = Path(out) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def _policies(cfg: TrainConfig) -> tuple[Policy, Policy]:
    return cfg.grpo.policies


def restore_state(cfg: TrainConfig) -> tuple[dict, dict, Any, Any, SyncHooks]:
    """The latest checkpoint of `cfg.run.out_dir`.

    Returns:
      `(state, meta, task, model_config, hooks)`: `state` has the keys of the
      training program's state (`params`, `opt_sft`, `opt_grpo`, `sync`), `hooks`
      the `SyncHooks` for `cfg.sync`.
    """
    # The program's own builder, so the restored structure is exactly the one it saves.
    from jaxrl_lp.train.program import initial_state

    plan, like, hooks = initial_state(cfg)
    task, mcfg = plan.task, plan.model
    ckpt = Checkpointer(cfg.run.out_dir)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {cfg.run.out_dir}/checkpoints")
        state, meta = ckpt.restore(like.tree(), mcfg)
    finally:
        ckpt.close()
    return state, meta, task, mcfg, hooks


def reseat_checkpoint(src_cfg: TrainConfig, dst_cfg: TrainConfig) -> int:
    """Rewrites `dst_cfg.run.out_dir`'s latest checkpoint with `dst_cfg`'s sync-state structure.

    The checkpoint (a copy of a run made with `src_cfg`) is read with the
    structure `src_cfg` implies, from `dst_cfg.run.out_dir`; params,
    optimizer states and metadata are kept; the sync state becomes
    `SyncHooks(dst_cfg.sync).init_state(params)`. Returns the checkpoint step.
    """
    src_cfg = dataclasses.replace(
        src_cfg, run=dataclasses.replace(src_cfg.run, out_dir=dst_cfg.run.out_dir))
    state, meta, _, mcfg, _ = restore_state(src_cfg)
    lpol, spol = _policies(dst_cfg)
    state["sync"] = SyncHooks(dst_cfg.sync, mcfg, lpol, spol).init_state(state["params"])
    meta["sync"] = dataclasses.asdict(dst_cfg.sync)  # what the sync state now is
    step = int(meta["step"])
    shutil.rmtree(Path(dst_cfg.run.out_dir) / "checkpoints")
    ckpt = Checkpointer(dst_cfg.run.out_dir, keep=dst_cfg.run.keep_checkpoints)
    try:
        ckpt.save(step, state, meta)
    finally:
        ckpt.close()
    return step


class ArmRuns(NamedTuple):
    """What `warm_start_then_arms` ran: the warm-start and each arm's run from a copy of it."""

    out: Path                  # the study directory
    steps: int                 # GRPO steps per arm
    sft_cfg: Any               # the warm-start's config
    sft_summary: dict          # its `run_train` summary
    runs: dict                 # arm -> (config, `run_train` summary, metrics.jsonl records)
    timings: dict              # seconds: `sft_seconds`, `<arm>_seconds`
    started: float             # `time.time()` at the start
    common: list               # the overrides every run took


def warm_start_then_arms(study: str, out_dir, *, valid: tuple[str, ...], arms, arm_overrides,
                         steps: int | None, default_steps: int, sft_steps: int | None,
                         study_overrides: tuple[str, ...], overrides, quick: bool,
                         progress: bool, outputs: tuple[str, ...]) -> ArmRuns:
    """One warm-start, then every arm's run from a copy of it (the studies that compare arms
    of one GRPO phase: `matched_precision`, `lora_mismatch`).

    The arms are checked against `valid` and `steps` (default `default_steps`, 2 with
    `quick`) must be positive (ValueErrors naming the study). The study's outputs
    (`sft`, every valid arm's directory, `outputs`) are removed from `out_dir` first.
    Every run takes `common` = the quick or the study's own overrides, `overrides`, and
    the progress setting (and `sft.steps` when given). The warm-start is `common` with
    `grpo.steps=0`, into `out_dir/sft`; arm `a` copies it to `out_dir/a` and resumes it
    with `[*common, *arm_overrides(a, steps), run.eval_every=max(1, steps // 3)]`.
    """
    arms = tuple(arms or valid)
    for a in arms:
        if a not in valid:
            raise ValueError(f"{study}: unknown arm {a!r}; arms are {list(valid)}")
    steps = steps if steps is not None else (2 if quick else default_steps)
    if steps < 1:
        raise ValueError(f"{study}: steps must be >= 1; got {steps}")
    from jaxrl_lp.train.program import run_train

    t0 = time.time()
    out = Path(out_dir)
    remove_outputs(out, ["sft", *valid, *outputs])
    out.mkdir(parents=True, exist_ok=True)
    common = [*(QUICK_OVERRIDES if quick else study_overrides), *overrides,
              f"run.progress={'true' if progress else 'false'}"]
    if sft_steps is not None:
        common.append(f"sft.steps={sft_steps}")
    sft_cfg = make_config([*common, "grpo.steps=0", f"run.out_dir={out / 'sft'}"])
    sft_summary = run_train(sft_cfg)
    timings = {"sft_seconds": round(time.time() - t0, 1)}
    runs = {}
    for arm in arms:
        t_arm = time.time()
        arm_dir = out / arm
        shutil.copytree(out / "sft", arm_dir)
        cfg = make_config([*common, *arm_overrides(arm, steps),
                           f"run.eval_every={max(1, steps // 3)}", f"run.out_dir={arm_dir}"])
        summary = run_train(cfg)
        records = [json.loads(x) for x in (arm_dir / "metrics.jsonl").read_text().splitlines() if x]
        runs[arm] = (cfg, summary, records)
        timings[f"{arm}_seconds"] = round(time.time() - t_arm, 1)
    return ArmRuns(out, steps, sft_cfg, sft_summary, runs, timings, t0, common)


def _finite(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def arm_series(records: list[dict], n_sft: int, keys: tuple[str, ...]) -> dict:
    """Per GRPO step (counted from the warm-start's end) the values of `keys` (None where a
    record lacks one or it is not finite), and the held-out accuracy per evaluation.

    A repeated step (a resumed run) keeps its latest record.
    """
    grpo, evals = {}, {}
    for r in records:
        if r.get("phase") == "grpo":
            grpo[int(r["step"]) - n_sft] = r
        elif r.get("phase") == "eval":
            evals[int(r["step"]) - n_sft] = r["accuracy"]
    steps = sorted(grpo)
    return {"step": steps, **{k: [_finite(grpo[t].get(k)) for t in steps] for k in keys},
            "eval_step": sorted(evals), "accuracy": [evals[t] for t in sorted(evals)]}


def arm_figures(series: dict, summary: dict, means: tuple[str, ...] = ()) -> dict:
    """An arm's summary figures: the mismatch (k1 and k3 means, max |delta logp|), the mean
    reward over the first and last quarter of the steps, the run's accuracies and skipped
    steps, and `<key>_mean` of each of `means`."""
    q = max(1, len(series["step"]) // 4)
    rewards = series["reward_mean"]
    dlogp = [x for x in series["mismatch_max_abs_dlogp"] if x is not None]
    return {
        "mismatch_k1_mean": _mean(series["mismatch_k1"]),
        "mismatch_k3_mean": _mean(series["mismatch_k3"]),
        "mismatch_max_abs_dlogp": max(dlogp) if dlogp else None,
        **{f"{k}_mean": _mean(series[k]) for k in means},
        "reward_first": _mean(rewards[:q]),
        "reward_last": _mean(rewards[-q:]),
        "initial_accuracy": summary["initial_accuracy"],
        "final_accuracy": summary["final_accuracy"],
        "accuracy_gain": summary["accuracy_gain"],
        "skipped_steps": summary["skipped_steps"],
    }


def plot_arm_series(series: dict[str, dict], out: Path, panels, style: Callable[[str], tuple],
                    linthresh: float = 1e-6) -> list[Path]:
    """One PNG per panel `(file, x key, y key, title, log)`, a line per arm in `style(arm)`
    = (linestyle, color); a log panel is symlog below `linthresh`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, xkey, key, title, log in panels:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for arm, s in series.items():
            pts = [(t, v) for t, v in zip(s[xkey], s[key], strict=True) if v is not None]
            if pts:
                linestyle, color = style(arm)
                ax.plot(*zip(*pts, strict=True), linestyle=linestyle, color=color,
                        marker="." if len(pts) < 30 else None, label=arm)
        if log:
            ax.set_yscale("symlog", linthresh=linthresh)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written
