"""Metrics: JSON lines, TensorBoard event files and PNG plots in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["MetricsLogger", "plot_metrics"]


class MetricsLogger:
    """Appends one JSON object per record to `metrics.jsonl` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str | Path):
        from tensorboardX import SummaryWriter

        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.tb = SummaryWriter(str(self.run_dir / "tb"))

    def log(self, step: int, phase: str, metrics: dict) -> None:
        rec = {"step": int(step), "phase": phase}
        # Non-finite values are written as null: JSON has no NaN.
        rec.update({k: (float(v) if np.isfinite(float(v)) else None) for k, v in metrics.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        for k, v in metrics.items():
            if not np.isfinite(float(v)):
                continue
            self.tb.add_scalar(f"{phase}/{k}", float(v), int(step))

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def close(self) -> None:
        self.tb.close()


def plot_metrics(records: list[dict], out_dir: str | Path) -> list[Path]:
    """Writes reward.png, accuracy.png and mismatch.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    panels = {
        "reward.png": ("grpo", ["reward_mean"], "reward (train batch)"),
        "accuracy.png": ("eval", ["accuracy"], "held-out accuracy (greedy)"),
        "mismatch.png": ("grpo", ["mismatch_k3", "mismatch_max_abs_dlogp"],
                         "sampler vs learner log-probs"),
    }
    written = []
    for name, (phase, keys, title) in panels.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in keys:
            pts = [(r["step"], r[k]) for r in records
                   if r["phase"] == phase and r.get(k) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="." if len(pts) < 30 else None, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    return written
