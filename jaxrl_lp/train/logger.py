"""Metrics: JSON lines, TensorBoard event files and PNG plots in the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["PANELS", "MetricsLogger", "PlotSpec", "is_wall_clock", "plot_metrics", "plot_specs",
           "without_wall_clock"]


def is_wall_clock(key: str) -> bool:
    """Whether a metric is a wall-clock figure (`timing_s/*`, `*tokens_per_s`): it differs
    between two runs that are otherwise bit-identical."""
    return key.startswith("timing_s/") or key.endswith("tokens_per_s")


def without_wall_clock(record: dict) -> dict:
    """A metric record without its wall-clock figures (what a rerun reproduces exactly)."""
    return {k: v for k, v in record.items() if not is_wall_clock(k)}


class MetricsLogger:
    """Appends one JSON object per record to `metrics.jsonl` and mirrors scalars to TensorBoard.

    `metrics.jsonl` is the run's record; `tb/` mirrors it. A resumed run
    passes `keep_records`, the number of records that were written when its
    checkpoint was saved (`lines`): the records after it (written by the
    interrupted run past its last checkpoint, and about to be written again)
    are dropped, and the TensorBoard events are rewritten from what is kept,
    so both hold one record per step and phase across any number of resumes.

    Args:
      run_dir: the run directory.
      keep_records: None for a new run; on resume, the records to keep.
      write: False for the processes of a multi-process run other than process
        0: they count records (`lines`) but write nothing.
    """

    def __init__(self, run_dir: str | Path, keep_records: int | None = None, write: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.write = write
        if not write:
            self.lines, self.tb = keep_records or 0, None
            return
        kept = self.records()
        if keep_records is not None and keep_records < len(kept):
            kept = kept[:keep_records]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)  # atomic: a kill leaves the old file or the new one
        self.lines = len(kept)
        tb_dir = self.run_dir / "tb"
        if keep_records is not None and tb_dir.is_dir():
            for old in tb_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self.tb = self._writer()
        if keep_records is not None:
            for r in kept:
                self._mirror(r["step"], r["phase"], r)

    def _writer(self):
        from tensorboardX import SummaryWriter

        return SummaryWriter(str(self.run_dir / "tb"))

    def _mirror(self, step: int, phase: str, metrics: dict) -> None:
        for k, v in metrics.items():
            if k in ("step", "phase") or v is None or not np.isfinite(float(v)):
                continue
            self.tb.add_scalar(f"{phase}/{k}", float(v), int(step))

    def log(self, step: int, phase: str, metrics: dict) -> None:
        if not self.write:
            self.lines += 1
            return
        rec = {"step": int(step), "phase": phase}
        # Non-finite values are written as null: JSON has no NaN.
        rec.update({k: (float(v) if np.isfinite(float(v)) else None) for k, v in metrics.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self.lines += 1
        self._mirror(step, phase, metrics)

    def records(self) -> list[dict]:
        """Every record of `metrics.jsonl`, in order (a torn last line is skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # the tail of a write a kill cut short
                break
        return out

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class PlotSpec(NamedTuple):
    """One PNG of the run directory: what `plot_metrics` draws, testable without drawing."""

    name: str                                          # file name, e.g. "reward.png"
    title: str
    ylabel: str
    yscale: str                                        # "linear" or "symlog"
    series: dict[str, tuple[list[int], list[float]]]   # label -> (steps, values)


# name, record phase, metric keys, title, y label, y scale
PANELS = (
    ("sft_loss.png", "sft", ["loss"], "warm-start (supervised) loss",
     "cross-entropy (nats / answer token)", "linear"),
    ("reward.png", "grpo", ["reward_mean"], "GRPO reward (train batch)", "mean reward", "linear"),
    ("accuracy.png", "eval", ["accuracy"], "held-out accuracy (greedy)",
     "accuracy (fraction correct)", "linear"),
    # symlog: linear around 0, so steps where the two agree bit for bit sit exactly on 0.
    ("mismatch.png", "grpo", ["mismatch_k3", "mismatch_max_abs_dlogp"],
     "sampler vs learner log-probs (0 = exact agreement)",
     "mismatch (0 = exact agreement)", "symlog"),
    ("timing.png", "grpo", [f"timing_s/{p}" for p in ("export", "sample", "score", "behaviour",
                                                       "reference", "update", "sync")],
     "GRPO iteration time by phase", "seconds", "linear"),
)


def plot_specs(records: list[dict]) -> list[PlotSpec]:
    """The plots of a run's metric records (one `PlotSpec` per PNG, empty series included)."""
    specs = []
    for name, phase, keys, title, ylabel, yscale in PANELS:
        series = {}
        for k in keys:
            pts = [(r["step"], r[k]) for r in records
                   if r["phase"] == phase and r.get(k) is not None]
            if pts:
                steps, values = zip(*pts, strict=True)
                series[k] = (list(steps), list(values))
        specs.append(PlotSpec(name, title, ylabel, yscale, series))
    return specs


def plot_metrics(records: list[dict], out_dir: str | Path) -> list[Path]:
    """Writes sft_loss.png, reward.png, accuracy.png, mismatch.png and timing.png; returns
    their paths."""
    # A bare Figure draws with Agg and touches no global state: `matplotlib.use("Agg")`
    # here would switch off a notebook's inline plots for the rest of its session.
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    written = []
    for spec in plot_specs(records):
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for label, (steps, values) in spec.series.items():
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
        if spec.yscale == "symlog":  # the mismatch measures are >= 0
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.set_ylim(bottom=0)
        ax.set_title(spec.title)
        ax.set_xlabel("step")
        ax.set_ylabel(spec.ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / spec.name, dpi=100)
        written.append(out_dir / spec.name)
    return written
