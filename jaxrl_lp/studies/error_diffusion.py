"""Error-diffusion study: binary / ternary weights on a k-bit residual against f32 latents.

(docs/design/error_diffusion.md, "Error diffusion".) Each arm is the supervised warm-start of `jaxrl-lp train`
(the default task and model, `grpo.steps=0`) with one `sft.optimizer`:

- `latent_binary`, `latent_ternary`: the latent-weight baseline, f32 latents
  with AdamW, forward `sign(W) * mean|W|` / BitNet b1.58 codes, straight-through
  (`optim.LatentSTEWeights`); 96 bits of training state per matmul weight.
- `ed_binary_kK`, `ed_ternary_kK`: int8 codes with a K-bit residual trained by
  error diffusion, f32 per-output-channel scales by AdamW (`optim.CodedWeights`).

Per arm: `bits_per_weight` (code bits + K for error diffusion, 96 for the
baseline), the amortized figure (scales and their Adam moments spread over
the coded weights) and the stored one (int8 + int8 = 16), `final_loss` (the
mean training loss of the last `LOSS_WINDOW` steps, each batch drawn fresh),
`final_accuracy` (greedy held-out), `flip_rate_mean` (the fraction of coded
weights whose code changed, per step) and, for error diffusion,
`loss_vs_latent` (final loss / the same levels' baseline final loss - 1) and
`within_10pct`. `error_diffusion.json` holds them and the per-step series;
`loss.png` and `flip_rate.png` plot them.

`steps` and `sft_steps` both set the warm-start steps per arm (the study has
no GRPO phase; when both are given they must agree). Model size and anything
else: `overrides` (`--set model.hidden_size=128`).

Its results (docs/studies/error-diffusion-default.json) and their caveats:
docs/design/error_diffusion.md, "Error diffusion".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from jaxrl_lp.studies.common import QUICK_OVERRIDES, make_config, remove_outputs

__all__ = ["ARMS", "DEFAULT_ARMS", "LOSS_WINDOW", "QUICK_ARMS", "arm_optimizer",
           "run_error_diffusion"]

# Every arm the study knows: the two baselines and error diffusion at k = 2, 4, 8.
ARMS: tuple[str, ...] = (
    "latent_binary", "ed_binary_k2", "ed_binary_k4", "ed_binary_k8",
    "latent_ternary", "ed_ternary_k2", "ed_ternary_k4", "ed_ternary_k8",
)
# The arms run by default: each levels' baseline and error diffusion at k = 4, sized so the
# default study fits the studies' budget on CPU (docs/design/studies.md, "What the default
# studies cost"); `--arms` adds k = 2 and 8.
DEFAULT_ARMS: tuple[str, ...] = ("latent_binary", "ed_binary_k4", "latent_ternary",
                                 "ed_ternary_k4")
# The arms of `quick` (a smoke run).
QUICK_ARMS: tuple[str, ...] = ("latent_binary", "ed_binary_k2", "ed_ternary_k4")
# Training steps averaged for `final_loss` (the per-step loss is one fresh batch's).
LOSS_WINDOW = 50


def arm_optimizer(arm: str) -> str:
    """The `sft.optimizer` of an arm: `latent_binary` -> `latent_ste:binary`, `ed_binary_k4`
    -> `error_diffusion:binary:k=4`."""
    if arm not in ARMS:
        raise ValueError(f"unknown error-diffusion arm {arm!r}; choose from {list(ARMS)}")
    if arm.startswith("latent_"):
        return f"latent_ste:{arm.split('_', 1)[1]}"
    _, levels, k = arm.split("_")
    return f"error_diffusion:{levels}:k={int(k[1:])}"


def _levels(arm: str) -> str:
    return "binary" if "binary" in arm else "ternary"


def _k(arm: str) -> int | None:
    return int(arm.rsplit("_k", 1)[1]) if arm.startswith("ed_") else None


def _series(run_dir: Path) -> tuple[list[float], list[float]]:
    """The warm-start's per-step loss and flip rate from the run's metrics.jsonl."""
    loss, flips = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("phase") == "sft":
            loss.append(float(rec["loss"]))
            flips.append(float(rec.get("flip_rate", 0.0)))
    return loss, flips


def _smooth(x: list[float], n: int) -> np.ndarray:
    x = np.asarray(x, np.float64)
    n = max(1, min(n, len(x)))
    return np.convolve(x, np.ones(n) / n, mode="valid")


def _plot(out: Path, series: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, key, ylabel, log in (("loss.png", "loss", "training loss (25-step mean)", False),
                                   ("flip_rate.png", "flip_rate",
                                    "flip rate per step (25-step mean)", True)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for arm, s in series.items():
            y = _smooth(s[key], 25)
            if log and not np.any(y > 0):
                continue
            ax.plot(np.arange(len(y)) + 1, y, label=arm,
                    linestyle="--" if arm.startswith("latent") else "-")
        ax.set_xlabel("warm-start step")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def run_error_diffusion(out_dir: str | Path = "runs/study-error-diffusion", *,
                        steps: int | None = None, sft_steps: int | None = None,
                        arms: tuple[str, ...] | None = None, overrides: tuple[str, ...] = (),
                        quick: bool = False, progress: bool = False) -> dict:
    """Trains each arm's warm-start and compares them (module docstring).

    Args:
      out_dir: the study directory (one run directory per arm,
        `error_diffusion.json`, `loss.png`, `flip_rate.png`); those are
        replaced if present, nothing else there is touched.
      steps: warm-start steps per arm (either this or `sft_steps`; default the
        default config's 1200, or the quick preset's with `quick`).
      sft_steps: as `steps`.
      arms: a subset of `ARMS` (default `DEFAULT_ARMS`, `QUICK_ARMS` with `quick`).
      overrides: extra `a.b=c` config overrides for every arm (after the defaults).
      quick: a tiny model and task (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: show each arm's progress bar.

    Returns:
      The JSON-able result (also in `error_diffusion.json`).
    """
    from jaxrl_lp.optim import OptimizerSpec
    from jaxrl_lp.studies.common import restore_state
    from jaxrl_lp.train.program import run_train

    if steps is not None and sft_steps is not None and steps != sft_steps:
        raise ValueError(f"--steps {steps} and --sft-steps {sft_steps}: both set this study's "
                         "warm-start steps (it has no GRPO phase); give one")
    n_steps = sft_steps if sft_steps is not None else steps
    arms = tuple(arms) if arms else (QUICK_ARMS if quick else DEFAULT_ARMS)
    for a in arms:
        arm_optimizer(a)  # every arm checked before anything runs
    t0 = time.time()
    out = Path(out_dir)
    remove_outputs(out, (*ARMS, "error_diffusion.json", "loss.png", "flip_rate.png"))
    out.mkdir(parents=True, exist_ok=True)
    # 128 held-out problems (not 256): the study is about the loss; accuracy is a side figure.
    settings = [*(QUICK_OVERRIDES if quick else ("run.eval_size=128",)), *overrides,
                "grpo.steps=0",
                f"run.progress={'true' if progress else 'false'}"]
    if n_steps is not None:
        settings.append(f"sft.steps={n_steps}")
    results, series = {}, {}
    for arm in arms:
        ta = time.time()
        opt = arm_optimizer(arm)
        cfg = make_config([*settings, f"sft.optimizer={opt}", f"run.out_dir={out / arm}"])
        summary = run_train(cfg)
        loss, flips = _series(out / arm)
        state, _, _, _, _ = restore_state(cfg)
        spec = OptimizerSpec.parse(opt)
        bits = spec.weights().state_bits(state["params"], spec.k)
        window = loss[-LOSS_WINDOW:]
        results[arm] = {
            "optimizer": str(spec), "levels": _levels(arm), "k": _k(arm),
            "bits_per_weight": bits["per_weight"],
            "bits_per_weight_amortized": round(bits["per_weight_amortized"], 3),
            "bits_per_weight_stored": bits["stored_per_weight"],
            "coded_weights": bits["coded_weights"],
            "high_precision_params": bits["high_precision_params"],
            "training_state_mib": round(bits["total_bits"] / 8 / 2**20, 4),
            "final_loss": float(np.mean(window)),
            "final_accuracy": summary["final_accuracy"],
            "flip_rate_mean": float(np.mean(flips)),
            "flip_rate_last": float(np.mean(flips[-LOSS_WINDOW:])),
            "seconds": round(time.time() - ta, 1),
        }
        series[arm] = {"loss": loss, "flip_rate": flips}
    for arm, r in results.items():
        base = f"latent_{r['levels']}"
        if arm.startswith("ed_") and base in results:
            rel = r["final_loss"] / results[base]["final_loss"] - 1.0
            r["loss_vs_latent"] = round(rel, 4)
            r["within_10pct"] = bool(rel <= 0.10)
    first = make_config(settings)
    result = {
        "study": "error-diffusion",
        "arms": results,
        "setup": {
            "sft_steps": first.sft.steps, "sft_lr": first.sft.lr,
            "batch_size": first.sft.batch_size, "eval_size": first.run.eval_size,
            "loss_window": LOSS_WINDOW, "quick": quick, "overrides": settings,
            "model": {k: getattr(first.model, k) for k in
                      ("family", "hidden_size", "num_layers", "loop_steps", "intermediate_size")},
            "baseline_bits": "f32 latent 32 + Adam m, v 64 = 96 per weight",
        },
        "timings": {"total_seconds": round(time.time() - t0, 1)},
    }
    (out / "error_diffusion.json").write_text(json.dumps({**result, "series": series}))
    _plot(out, series)
    return result
