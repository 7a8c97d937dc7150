"""Backward-state study: does the backward reuse the forward's rounded operands or round afresh?

Quantized matmuls (`kernels.fake_quant.quantized_matmul`) have two backward
rules (docs/design/studies.md, "Numerics studies"): `reuse` reads the forward's rounded operands (codes and
scales), `fresh` re-quantizes the saved f32 operands, and the cotangent, along
the backward's own reduction axes. Arms are matmul formats (`ARMS`: `none`,
`fp8`, `mxfp8`, `mxfp4`, `nvfp4`); each runs under the policy
`p=f32,c=f32,mm=<format>,bwd=<reuse|fresh>` (`arm_policy`): f32 compute, so
the only rounding is the format's.

Loss curves (`curves` in the JSON, `backward_state_loss.png`). From the same
initial weights and on the same batches (the training program's seed and data
order), `steps` supervised steps (default `DEFAULT_STEPS`) of the training
program's warm-start step (`rl.train_step.make_sft_step`, AdamW with warmup and
cosine decay over `steps`) under the f32 policy (`f32`, the reference) and
under each format and rule (`<format>-<rule>`). Per run: the per-step loss and
gradient norm, the final loss, the mean of the last 10 losses and the greedy
held-out accuracy of the final weights served in f32
(`final_accuracy_f32_served`: one sampler program for every arm).

Gradients (`gradients` in the JSON, `backward_state_grad.png`), measured at
the weights W of the `f32` run after `sft_steps` steps (default: its end;
0: the initial weights). On `NUM_BATCHES` random warm-start batches b (the
task's training set, `sft.batch_size` each, a seed of their own) the gradient
w.r.t. the f32 master weights is read out of that same step
(`capture_gradient`) under the f32 policy (`g32_b`) and each arm's two
policies (`gq_b`). All norms are global (every parameter, flattened; sums in
f64). Per format:

- `rel_diff_reuse_fresh`: mean over b of `|g_reuse_b - g_fresh_b| / |g_fresh_b|`
  (and its `max`); `bit_equal`: whether the two are equal bit for bit on every
  batch (the `none` format must be: without quantization the rules coincide).
- per rule: `rel_error`, mean over b of `|gq_b - g32_b| / |g32_b|`;
  `bias_rel`, `|mean_b(gq_b - g32_b)| / |mean_b g32_b|`: the error that
  survives averaging over batches (the bias of the quantized gradient as an
  estimate of the f32 one); `cosine`, between `mean_b gq_b` and `mean_b g32_b`;
  `bias_over_noise`, `|mean_b e_b| / sqrt(mean_b |e_b|^2 / n)` with
  `e_b = gq_b - g32_b`: about 1 when the per-batch errors average out as
  independent zero-mean noise would, up to `sqrt(n)` (4 with the default 16
  batches) when the error is the same on every batch (systematic: the
  weights' rounding is the same on every batch).

The runs are the study's own loop over the program's step, not `run_train`:
one compiled step per policy serves both the curve and the gradients (compiles
dominate the study's cost on CPU), and no run directories are written.

Cost: the defaults are `DEFAULT_STEPS` = 100 steps per run and five formats, and
the step compiles dominate; what they took, by part: docs/design/studies.md, "What
the default studies cost". `--steps`, `--sft-steps` and `--set
model.hidden_size=...` scale it up.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxrl_lp.numerics.policy import FP32, Policy
from jaxrl_lp.studies import common
from jaxrl_lp.studies.common import QUICK_OVERRIDES, make_config, remove_outputs

__all__ = ["ARMS", "BACKWARDS", "DEFAULT_STEPS", "OWNED_KEYS", "ArmStep", "CapturedGradient",
           "arm_policy", "capture_gradient", "check_arms", "check_overrides", "gradient_figures",
           "run_backward_state"]

# Matmul formats compared (`none`: no quantization, where the two rules must agree).
ARMS: tuple[str, ...] = ("none", "fp8", "mxfp8", "mxfp4", "nvfp4")
BACKWARDS: tuple[str, ...] = ("reuse", "fresh")
DEFAULT_STEPS = 100
QUICK_STEPS = 30
NUM_BATCHES = 16
# The gradient batches are drawn with seed `run.seed + GRADIENT_SEED_OFFSET`, apart from training's.
GRADIENT_SEED_OFFSET = 7919
OUTPUT_FILES = ("backward_state.json", "backward_state_loss.png", "backward_state_grad.png")


def arm_policy(fmt: str, backward: str) -> Policy:
    """`p=f32,c=f32,mm=<fmt>,bwd=<backward>`; a ValueError names the valid formats."""
    if fmt not in ARMS:
        raise ValueError(f"backward-state: unknown format {fmt!r}; formats are {','.join(ARMS)}")
    return Policy(matmul_format=None if fmt == "none" else fmt, backward=backward)


# Config keys the study sets itself (per arm); an override of one would be silently replaced.
OWNED_KEYS: tuple[str, ...] = (
    "grpo.learner_policy", "grpo.sampler_policy", "grpo.steps", "sft.steps", "run.out_dir")


def check_overrides(overrides) -> None:
    """A one-line ValueError for an override of a key the study sets itself (`OWNED_KEYS`)."""
    common.check_overrides("backward-state", overrides, OWNED_KEYS)


def check_arms(arms) -> tuple[str, ...]:
    """`arms` as a tuple (None: `ARMS`); a one-line ValueError naming the valid formats."""
    return common.check_arms("backward-state", arms, ARMS, "format")


class CapturedGradient(NamedTuple):
    """State of `capture_gradient`: the gradient of the last update (the params' pytree)."""

    grad: object


def capture_gradient():
    """An optax transform that passes the gradient on unchanged and keeps it as its state.

    First in an `optax.chain`, it reads out the exact gradient a train step
    computes (loss, policy and masking all as the step has them), while the
    rest of the chain updates the parameters as usual.
    """
    import jax
    import jax.numpy as jnp
    import optax

    def init(params):
        return CapturedGradient(jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del state, params
        return grads, CapturedGradient(grads)

    return optax.GradientTransformation(init, update)


class ArmStep:
    """One policy's warm-start step (`make_sft_step`, the program's warm-start optimizer
    after `capture_gradient`): it trains the loss curve and measures the gradients."""

    def __init__(self, mcfg, policy: Policy, sft_opt):
        import optax

        from jaxrl_lp.rl.train_step import make_sft_step

        self.opt = optax.chain(capture_gradient(), sft_opt)
        self.step = make_sft_step(mcfg, policy, self.opt)

    def gradient(self, params, tokens, mask) -> np.ndarray:
        """The flat f32 gradient at `params` (numpy); `params` is left as it is."""
        import jax
        import jax.numpy as jnp
        from jax.flatten_util import ravel_pytree

        p = jax.tree.map(jnp.copy, params)  # the step donates its params and state
        _, state, _ = self.step(p, self.opt.init(p), jnp.asarray(tokens), jnp.asarray(mask))
        return np.asarray(ravel_pytree(state[0].grad)[0])

    def train(self, params, batches, snapshot_at: int | None = None):
        """Trains from `params` on `batches`; returns `(series, final params, snapshot)`."""
        import jax
        import jax.numpy as jnp

        p = jax.tree.map(jnp.copy, params)
        state = self.opt.init(p)
        series = {"step": [], "loss": [], "grad_norm": []}
        snapshot = p if snapshot_at == 0 else None
        for i, (tokens, mask) in enumerate(batches, start=1):
            p, state, m = self.step(p, state, jnp.asarray(tokens), jnp.asarray(mask))
            series["step"].append(i)
            for k in ("loss", "grad_norm"):
                v = float(m[k])
                series[k].append(v if math.isfinite(v) else None)
            if i == snapshot_at:
                snapshot = jax.tree.map(jnp.copy, p)
        return series, p, snapshot


class _Moments:
    """Running sums over batches of one gradient series against the f32 one (f64)."""

    def __init__(self):
        self.n, self.sum_q, self.sum_e, self.sum_e2, self.sum_rel = 0, 0.0, 0.0, 0.0, 0.0

    def add(self, gq: np.ndarray, g32: np.ndarray) -> None:
        e = gq.astype(np.float64) - g32.astype(np.float64)
        self.n += 1
        self.sum_q = self.sum_q + gq.astype(np.float64)
        self.sum_e = self.sum_e + e
        self.sum_e2 += float(e @ e)
        self.sum_rel += float(np.linalg.norm(e) / max(np.linalg.norm(g32), 1e-30))

    def figures(self, mean_g32: np.ndarray) -> dict:
        n = self.n
        mean_e, mean_q = self.sum_e / n, self.sum_q / n
        noise = math.sqrt(self.sum_e2 / n / n)
        nq, n32 = np.linalg.norm(mean_q), np.linalg.norm(mean_g32)
        return {
            "rel_error": self.sum_rel / n,
            "bias_rel": float(np.linalg.norm(mean_e) / max(n32, 1e-30)),
            "cosine": float(mean_q @ mean_g32 / max(nq * n32, 1e-30)),
            "bias_over_noise": float(np.linalg.norm(mean_e) / noise) if noise > 0 else 0.0,
        }


def gradient_figures(params: dict, batches, grad_fns: dict, reference) -> dict[str, dict]:
    """The gradient figures of the module docstring for each format, over `batches`.

    Args:
      params: the weights the gradients are taken at (f32 master weights).
      batches: a list of `(tokens_BxL, mask_BxL)` warm-start batches.
      grad_fns: `{(format, backward): fn(params, tokens, mask) -> flat gradient}`
        for each format measured and both rules.
      reference: the same for the f32 policy.

    Returns:
      `{format: {"rel_diff_reuse_fresh", "rel_diff_reuse_fresh_max", "bit_equal",
      "reuse": {...}, "fresh": {...}}}`.
    """
    g32 = [reference(params, t, m) for t, m in batches]
    mean_g32 = np.mean([g.astype(np.float64) for g in g32], axis=0)
    out = {}
    for fmt in dict.fromkeys(f for f, _ in grad_fns):
        moments = {b: _Moments() for b in BACKWARDS}
        rel, equal = [], True
        for (tokens, mask), g_ref in zip(batches, g32, strict=True):
            gs = {b: grad_fns[fmt, b](params, tokens, mask) for b in BACKWARDS}
            for b in BACKWARDS:
                moments[b].add(gs[b], g_ref)
            d = gs["reuse"].astype(np.float64) - gs["fresh"].astype(np.float64)
            rel.append(float(np.linalg.norm(d) / max(np.linalg.norm(gs["fresh"]), 1e-30)))
            equal = equal and bool(np.array_equal(gs["reuse"], gs["fresh"]))
        out[fmt] = {"rel_diff_reuse_fresh": float(np.mean(rel)),
                    "rel_diff_reuse_fresh_max": float(np.max(rel)), "bit_equal": equal,
                    **{b: moments[b].figures(mean_g32) for b in BACKWARDS}}
    return out


def _plot(grads: dict[str, dict], curves: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"reuse": "-", "fresh": "--"}
    ref = curves["f32"]["series"]
    ax.plot(ref["step"], ref["loss"], color="black", linewidth=1.5, label="f32", alpha=0.6)
    for i, fmt in enumerate(grads):
        for b in BACKWARDS:
            c = curves.get(f"{fmt}-{b}", {})
            if c and not c.get("same_as"):
                c = c["series"]
                loss = [np.nan if v is None else v for v in c["loss"]]
                ax.plot(c["step"], loss, styles[b], color=f"C{i}", label=f"{fmt} {b}",
                        linewidth=1.0)
    ax.set_xlabel("supervised step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title("supervised loss per matmul format and backward rule", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "backward_state_loss.png", dpi=100)
    plt.close(fig)

    fmts = list(grads)
    x = np.arange(len(fmts))
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = [("|g_reuse - g_fresh| / |g_fresh|", [grads[f]["rel_diff_reuse_fresh"] for f in fmts]),
            *((f"bias vs f32 ({b})", [grads[f][b]["bias_rel"] for f in fmts]) for b in BACKWARDS)]
    for i, (label, vals) in enumerate(bars):
        ax.bar(x + (i - 1) * 0.27, vals, width=0.27, label=label)
    ax.set_xticks(x, fmts)
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylim(0.0, 2.0 * max(1.0, *(v for _, vals in bars for v in vals)))
    ax.set_title("gradient: reuse vs fresh, and bias against the f32 gradient", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "backward_state_grad.png", dpi=100)
    plt.close(fig)


def run_backward_state(out_dir: str | Path = "runs/study-backward-state", *,
                       steps: int | None = None, sft_steps: int | None = None,
                       arms: tuple[str, ...] | None = None, overrides: tuple[str, ...] = (),
                       quick: bool = False, progress: bool = False) -> dict:
    """Runs the backward-state study (module docstring); writes its JSON and two plots.

    Args:
      out_dir: the study directory (JSON, PNGs); the study's own outputs there
        are replaced, nothing else is touched.
      steps: supervised steps of each loss-curve run (default `DEFAULT_STEPS`,
        `QUICK_STEPS` with `quick`).
      sft_steps: steps of the f32 run at whose weights the gradients are
        measured (0 to `steps`; default `steps`).
      arms: a subset of `ARMS` (formats; None: all).
      overrides: extra `a.b=c` config overrides for every run (model size...).
      quick: a tiny model and batch (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: print one line per finished run.

    Returns:
      The JSON-able result (also in `backward_state.json`).
    """
    arms = check_arms(arms)
    check_overrides(overrides)
    steps = steps if steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS)
    at = steps if sft_steps is None else sft_steps
    if steps < 1:
        raise ValueError(f"backward-state: --steps must be >= 1; got {steps}")
    if not 0 <= at <= steps:
        raise ValueError(f"backward-state: --sft-steps (where the gradients are measured on the "
                         f"f32 run) must be between 0 and --steps={steps}; got {at}")
    num_batches = NUM_BATCHES
    t0 = time.time()
    out = Path(out_dir)
    settings = [*(QUICK_OVERRIDES if quick else ()), *overrides, "grpo.steps=0",
                f"sft.steps={steps}", f"run.out_dir={out}"]
    cfg = make_config(settings)  # validated (with every override) before anything is written
    remove_outputs(out, OUTPUT_FILES)
    out.mkdir(parents=True, exist_ok=True)

    from jaxrl_lp.data.pipeline import sft_loader
    from jaxrl_lp.rollout.step import LoopSpec
    from jaxrl_lp.train.evaluation import evaluate
    from jaxrl_lp.train.program import initial_state

    plan, state, _ = initial_state(cfg)
    task, mcfg, sft_opt = plan.task, plan.model, plan.optimizers[0]
    params0 = state.params
    pad = task.tokenizer.pad_id
    # The training program's data order (its seed), and batches of their own for the gradients.
    train_it = iter(sft_loader(task.train, task.sft_example, cfg.sft.batch_size, cfg.run.seed, pad,
                               seq_len=plan.seq_len))
    train_batches = [(b.tokens_BxL, b.loss_mask_BxL) for b in (next(train_it) for _ in range(steps))]
    grad_it = iter(sft_loader(task.train, task.sft_example, cfg.sft.batch_size,
                              cfg.run.seed + GRADIENT_SEED_OFFSET, pad, seq_len=plan.seq_len))
    grad_batches = [(b.tokens_BxL, b.loss_mask_BxL) for b in (next(grad_it) for _ in range(num_batches))]
    g = cfg.grpo
    loop = LoopSpec(g.exit_rule, g.compute_mode).resolve(mcfg)
    max_new = g.max_new_tokens or task.max_completion_tokens

    def accuracy(params):
        # Served in f32 for every arm: one sampler program (what the weights learned).
        return evaluate(params, mcfg, task, FP32, loop, cfg.run.eval_size, max_new)

    timings = {}
    curves: dict[str, dict] = {}

    def curve(name, arm):
        t_r = time.time()
        series, final, snap = arm.train(params0, train_batches,
                                        snapshot_at=at if name == "f32" else None)
        finite = [x for x in series["loss"] if x is not None]
        curves[name] = {"final_loss": series["loss"][-1],
                        "mean_last10_loss": float(np.mean(finite[-10:])) if finite else None,
                        "final_accuracy_f32_served": accuracy(final), "series": series}
        timings[f"{name}_seconds"] = round(time.time() - t_r, 1)
        if progress:
            print(f"backward-state: {name}: final loss {series['loss'][-1]} "
                  f"({timings[f'{name}_seconds']} s)", flush=True)
        return snap

    # The f32 run first: the gradients are measured at its weights after `at` steps.
    f32_arm = ArmStep(mcfg, FP32, sft_opt)
    weights = curve("f32", f32_arm)
    f32 = FP32
    # `none-reuse` is the f32 policy itself (`p=f32,c=f32,mm=none,bwd=reuse`): its step and run.
    arms_by_policy = {(f, b): f32_arm if arm_policy(f, b) == f32 else
                      ArmStep(mcfg, arm_policy(f, b), sft_opt) for f in arms for b in BACKWARDS}
    t_g = time.time()
    grads = gradient_figures(weights, grad_batches,
                             {k: a.gradient for k, a in arms_by_policy.items()}, f32_arm.gradient)
    timings["gradient_seconds"] = round(time.time() - t_g, 1)
    for (fmt, b), arm in arms_by_policy.items():
        if arm is f32_arm:
            curves[f"{fmt}-{b}"] = dict(curves["f32"], same_as="f32")
        else:
            curve(f"{fmt}-{b}", arm)
    _plot(grads, curves, out)
    result = {
        "study": "backward-state",
        "gradients": grads,
        "curves": curves,
        "setup": {
            "policies": {f"{f}-{b}": str(arm_policy(f, b)) for f in arms for b in BACKWARDS},
            "steps": steps, "gradient_weights": f"the f32 run after {at} steps",
            "num_batches": num_batches, "batch_size": cfg.sft.batch_size, "sft_lr": cfg.sft.lr,
            "seed": cfg.run.seed, "eval_size": cfg.run.eval_size, "quick": quick,
            "overrides": list(settings),
            "model": {k: getattr(mcfg, k) for k in
                      ("family", "hidden_size", "num_layers", "loop_steps", "intermediate_size")},
        },
        "timings": dict(timings, total_seconds=round(time.time() - t0, 1)),
    }
    (out / "backward_state.json").write_text(json.dumps(result, indent=2))
    return result
