"""Metrics: JSON lines, TensorBoard event files, Weights & Biases and PNG plots of a run."""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = ["PANELS", "MetricsLogger", "PlotSpec", "WandbSettings", "import_wandb", "is_wall_clock",
           "plot_metrics",
           "plot_specs", "without_wall_clock"]

WANDB_MODES = ("online", "offline", "disabled")
# What W&B refuses in a project name (its own check, made here before anything is written).
_WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


def is_wall_clock(key: str) -> bool:
    """Whether a metric is a wall-clock figure (`timing_s/*`, `*tokens_per_s`): it differs
    between two runs that are otherwise bit-identical."""
    return key.startswith("timing_s/") or key.endswith("tokens_per_s")


def without_wall_clock(record: dict) -> dict:
    """A metric record without its wall-clock figures (what a rerun reproduces exactly)."""
    return {k: v for k, v in record.items() if not is_wall_clock(k)}


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """Where `MetricsLogger` mirrors a run's metrics on Weights & Biases (`run.wandb=true`).

    Args:
      project: the W&B project (`run.wandb_project`).
      mode: "online" uploads as the run goes (needs `wandb login` or WANDB_API_KEY);
        "offline" writes the W&B files only, for `wandb sync` later (no network);
        "disabled" makes every W&B call a no-op (`run.wandb_mode`).
      run_name: the run's display name; None: the run directory's name.
      config: the run's configuration, logged as the W&B run's config.
      dir: the folder W&B writes its files under (its `wandb/` folder); None: the run directory.

    Example:
      >>> WandbSettings("jaxrl-lp", "offline", config={"run": {"seed": 0}}).mode
      'offline'
    """

    project: str = "jaxrl-lp"
    mode: Literal["online", "offline", "disabled"] = "online"
    run_name: str | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dir: str | None = None

    def __post_init__(self):
        if self.mode not in WANDB_MODES:
            raise ValueError(f"run.wandb_mode={self.mode!r} is not one of {', '.join(WANDB_MODES)}")
        bad = [c for c in _WANDB_PROJECT_FORBIDDEN if c in self.project]
        if not self.project or bad or len(self.project) > 128:
            raise ValueError(f"run.wandb_project={self.project!r} is not a W&B project name: give 1 to "
                             f"128 characters without {' '.join(_WANDB_PROJECT_FORBIDDEN)}")


def import_wandb():
    """The wandb module, imported only when a run asks for it (it is an extra)."""
    try:
        import wandb
    except ImportError as e:
        raise ValueError(f"run.wandb=true needs the wandb package ({e}): "
                         "pip install 'jaxrl-lp[wandb]'") from None
    return wandb


class MetricsLogger:
    """Appends one JSON object per record to `metrics.jsonl` and mirrors scalars to TensorBoard
    and, when asked, to Weights & Biases.

    `metrics.jsonl` is the run's record; `tb/` mirrors it. A resumed run
    passes `keep_records`, the number of records that were written when its
    checkpoint was saved (`lines`): the records after it (written by the
    interrupted run past its last checkpoint, and about to be written again)
    are dropped, and the TensorBoard events are rewritten from what is kept,
    so both hold one record per step and phase across any number of resumes.

    W&B (`wandb`): every record's finite scalars are logged as `{phase}/{key}` at
    W&B step = the run's step, to one W&B run per run directory: its id is kept
    in `run_dir/wandb_id`, and a resumed run continues it (`resume="allow"`).
    W&B's history only moves forward (online, a step below the run's current one
    is dropped with a warning), and an offline run's segments, one
    `wandb/offline-run-*` folder per start, are uploaded in order by
    `wandb sync RUN_DIR/wandb/offline-run-*`. So the steps W&B already holds are
    never sent again: records at or below the last step the interrupted run
    mirrored (the last step of `metrics.jsonl` before it is cut back) or below
    the W&B run's `starting_step` (online) are written to `metrics.jsonl` and
    TensorBoard only, and W&B keeps the first values of those steps, equal to the
    redone ones but for wall-clock figures. Each step is one point on a W&B chart
    across any number of resumes. (A hard kill between two records of one step
    leaves that step's second record out of W&B; `metrics.jsonl` has it.) When W&B
    is first asked for on a resumed run, the kept records are sent first.

    Args:
      run_dir: the run directory.
      keep_records: None for a new run; on resume, the records to keep.
      write: False for the processes of a multi-process run other than process
        0: they count records (`lines`) but write nothing, and start no W&B run.
      wandb: None, or where to mirror the records on W&B. The W&B run starts
        before anything is written, so a refused start (wandb missing, not logged
        in) leaves the run directory as it was.

    Example:
      >>> logger = MetricsLogger(run_dir, wandb=WandbSettings("my-project", "offline"))
      >>> logger.log(1, "sft", {"loss": 2.5})  # metrics.jsonl, tb/ and W&B `sft/loss` at step 1
      >>> logger.close()  # finishes the W&B run
    """

    def __init__(self, run_dir: str | Path, keep_records: int | None = None, write: bool = True,
                 wandb: WandbSettings | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.write = write
        self.wandb_run, self._wandb_next = None, 0
        if not write:
            self.lines, self.tb = keep_records or 0, None
            return
        kept = self.records()
        if wandb is not None:  # `kept` is still all the interrupted run wrote, and mirrored
            new_run = self._start_wandb(wandb, last_sent=max((r["step"] for r in kept), default=-1))
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
        if wandb is not None and new_run and keep_records is not None:  # W&B first asked for on
            # a resumed run: what it has missed
            for r in kept:
                self._to_wandb(r["step"], r["phase"], r)

    def _start_wandb(self, settings: WandbSettings, last_sent: int) -> bool:
        """Starts (or continues) the run directory's W&B run; returns whether it is new."""
        wandb = import_wandb()
        id_path = self.run_dir / "wandb_id"
        new_run = not id_path.exists()
        run_id = ("".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
                  if new_run else id_path.read_text().strip())
        try:
            # create_new: a run of its own, whatever W&B run the caller's process holds.
            self.wandb_run = wandb.init(
                project=settings.project, mode=settings.mode,
                name=settings.run_name or self.run_dir.name, config=dict(settings.config),
                dir=str(settings.dir or self.run_dir), id=run_id, resume="allow", reinit="create_new")
        except wandb.errors.Error as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"run.wandb: W&B could not start the run ({msg}): log in (`wandb login` "
                             "or WANDB_API_KEY), or set run.wandb_mode=offline") from None
        if new_run:
            id_path.write_text(run_id + "\n")
        # Steps W&B holds are not sent again (see the class docstring).
        self._wandb_next = 0 if new_run else max(last_sent + 1, self.wandb_run.starting_step)
        return new_run

    def _to_wandb(self, step: int, phase: str, metrics: dict) -> None:
        if self.wandb_run is None or step < self._wandb_next:
            return
        row = {f"{phase}/{k}": float(v) for k, v in metrics.items()
               if k not in ("step", "phase") and v is not None and np.isfinite(float(v))}
        if row:
            self.wandb_run.log(row, step=int(step))

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
        self._to_wandb(step, phase, metrics)

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
        """Closes the TensorBoard writer and finishes the W&B run (its data written or uploaded).

        W&B's service process is its own per-process one: it serves any later run of
        this process and ends with it (or at `wandb.teardown()`).
        """
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


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
