"""Rounding-location alignment study: the mismatch each f32 region causes when the sampler leaves it out.

The learner runs the `bf16` preset (bf16 compute, every region of
`ALL_REGIONS` in f32: regions only matter when the compute dtype is low
precision). Each arm is a sampler policy (`arm_policy`):

- `all`: the learner's own policy (matched: the mismatch is exactly 0);
- `no_<region>` for each region of `ALL_REGIONS` (`rope`, `swiglu`, `norm`,
  `residual`, `softmax`): `bf16` with that one region rounded as a typical
  inference kernel rounds it;
- `bf16-engine`: every region left out (the preset of that name).

One supervised warm-start (`grpo.steps=0`, learner `bf16`) is run once into
`<out>/sft`; its final weights are the weights of every measurement below.

Mismatch (`mismatch` in the JSON). Per arm, one batch of rollouts is sampled
from the warm-started weights under the arm's policy: the first
`grpo.prompts_per_step` held-out problems, `grpo.group_size` samples each, at
`grpo.temperature`, with the same key for every arm (so the tokens coincide
until the first token the arm's rounding changes). The tokens are each arm's
own samples, as in training: the k1 estimate of `KL(sampler || learner)` needs
tokens drawn from the sampler. The learner then computes the log-probs of
those same tokens under `bf16`:

- `replay` (the figures of the study): the sampler's own step functions run by
  the learner under its policy (`rl.logprobs.replay_logprobs`, the value the
  training program's `hybrid` log-probs take). Same programs on the same
  shapes, so the only difference left is where the two policies round: with
  `all` it is exactly 0.0.
- `dense`: one parallel teacher-forced forward under `bf16`, what a dense
  learner sees: kernel-shape rounding (non-zero even for `all`) plus the region.

Each gives `mismatch_k1`, `mismatch_k3`, `mismatch_max_abs_dlogp` and
`mismatch_prob_err` (`rl.metrics.mismatch_metrics`, token-weighted over the
batch) and `mean_abs_dlogp`.

Training (`arms` in the JSON). Each arm copies `<out>/sft` to `<out>/<arm>`
and resumes it with the same short GRPO run (same seed and prompts, learner
`bf16`, sampler the arm's policy, `loss.correction=none` by default, so the
mismatch goes uncorrected). Per arm from its `metrics.jsonl`: the reward
curve (`reward_mean` per step), the mismatch the training program measured
per step, and the initial and final greedy held-out accuracy (under the arm's
sampler policy). Plots: `alignment_mismatch.png` (per-arm k3 KL and max
|dlogp|), `alignment_reward.png` (reward curves).

Cost: the defaults are 1,200 warm-start steps, `DEFAULT_STEPS` = 10 GRPO steps
per arm and 7 arms; what they took, by part: docs/design/studies.md, "What the
default studies cost". Compiles dominate at these sizes; `--steps` and
`--set model.hidden_size=...` scale the run itself up.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from jaxrl_lp.numerics.policy import ALL_REGIONS, PRESETS, Policy
from jaxrl_lp.studies import common
from jaxrl_lp.studies.common import QUICK_OVERRIDES, make_config, remove_outputs, restore_state

__all__ = ["ARMS", "DEFAULT_STEPS", "LEARNER_POLICY", "OWNED_KEYS", "arm_policy", "check_arms",
           "check_overrides", "measure_mismatch", "run_alignment"]

# The learner's policy: bf16 compute with every region in f32.
LEARNER_POLICY = "bf16"
# `all` (matched), one arm per region left out, and every region left out.
ARMS: tuple[str, ...] = ("all", *(f"no_{r}" for r in ALL_REGIONS), "bf16-engine")
DEFAULT_STEPS = 10
QUICK_STEPS = 3
OUTPUT_FILES = ("alignment.json", "alignment_mismatch.png", "alignment_reward.png")
MISMATCH_KEYS = ("mismatch_k1", "mismatch_k3", "mismatch_max_abs_dlogp", "mismatch_prob_err")


def arm_policy(arm: str) -> Policy:
    """The sampler policy of an arm (module docstring); a ValueError names the valid arms."""
    base = PRESETS[LEARNER_POLICY]
    if arm == "all":
        return base
    if arm == "bf16-engine":
        return PRESETS["bf16-engine"]
    region = arm.removeprefix("no_")
    if not arm.startswith("no_") or region not in ALL_REGIONS:
        raise ValueError(f"alignment: unknown arm {arm!r}; arms are {','.join(ARMS)}")
    return base.replace(f32_regions=base.f32_regions - {region})


# Config keys the study sets itself (per arm); an override of one would be silently replaced.
OWNED_KEYS: tuple[str, ...] = ("grpo.learner_policy", "grpo.sampler_policy", "grpo.steps", "run.out_dir")


def check_overrides(overrides) -> None:
    """A one-line ValueError for an override of a key the study sets itself (`OWNED_KEYS`)."""
    common.check_overrides("alignment", overrides, OWNED_KEYS)


def check_arms(arms) -> tuple[str, ...]:
    """`arms` as a tuple (None: `ARMS`); a one-line ValueError naming the valid arms."""
    return common.check_arms("alignment", arms, ARMS, "arm")


def measure_mismatch(params: dict, mcfg, task, loop, arms, *, num_prompts: int, group_size: int,
                     temperature: float, max_new_tokens: int, seed: int,
                     methods: tuple[str, ...] = ("replay", "dense")) -> dict[str, dict]:
    """Learner (`LEARNER_POLICY`) against each arm's sampler on the arm's own samples.

    Args:
      params: the weights both sides use (sampler and learner alike).
      mcfg, task, loop: the model, the task (its held-out prompts) and the loop spec.
      arms: arm names (`ARMS`).
      num_prompts, group_size, temperature, max_new_tokens: the rollout batch.
      seed: the sampling key (the same for every arm).
      methods: the learner's log-prob methods measured (`replay`, `dense`).

    Returns:
      `{arm: {"policy", "tokens", <method>: {...}}}`, each method's entry
      holding `MISMATCH_KEYS` and `mean_abs_dlogp` as floats.
    """
    import jax
    import jax.numpy as jnp

    from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs
    from jaxrl_lp.rl.metrics import masked_mean, mismatch_metrics
    from jaxrl_lp.rollout.generate import generate
    from jaxrl_lp.rollout.sampling import SamplingConfig

    lpol = PRESETS[LEARNER_POLICY]
    tok = task.tokenizer
    prompts = [task.prompt_ids(task.heldout[i])
               for i in range(min(num_prompts, len(task.heldout)))]
    learner = {m: jit_learner_logprobs(mcfg, lpol, m, loop=loop) for m in methods}
    out = {}
    for arm in arms:
        spol = arm_policy(arm)
        ro = generate(params, mcfg, prompts, policy=spol,
                      sampling=SamplingConfig(temperature=temperature),
                      max_new_tokens=max_new_tokens, num_samples=group_size, eos_id=tok.eos_id,
                      pad_id=tok.pad_id, loop=loop, key=jax.random.PRNGKey(seed))
        entry = {"policy": str(spol), "tokens": int(np.asarray(ro.completion_mask).sum())}
        for method, fn in learner.items():
            lp = fn(params, ro)
            m = mismatch_metrics(lp, ro.logprobs, ro.completion_mask)
            m["mean_abs_dlogp"] = masked_mean(jnp.abs(lp - ro.logprobs), ro.completion_mask)
            entry[method] = {k: float(v) for k, v in m.items()}
        out[arm] = entry
    return out


def _finished_run_with(run_dir: Path, cfg) -> bool:
    # The fair-cast study's test: a finished `sft/` of the same config is reused.
    from jaxrl_lp.studies.fair_cast import _finished_run_with as finished

    return finished(run_dir, cfg)


def _arm_series(records: list[dict]) -> dict[str, list]:
    """Per GRPO step (1..N): reward, accuracy and the mismatch the program measured."""
    grpo = {}
    for r in records:
        if r.get("phase") == "grpo":
            grpo[int(r["step"])] = r  # a repeated step (a resumed run) keeps the latest
    steps = sorted(grpo)
    first = steps[0] - 1 if steps else 0
    keys = ("reward_mean", "accuracy", *MISMATCH_KEYS)
    return {"step": [s - first for s in steps],
            **{k: [grpo[s].get(k) for s in steps] for k in keys}}


def _plot(mismatch: dict[str, dict], series: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(mismatch)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "mismatch_k3", "k3 KL(sampler || learner) per token"),
                           (axes[1], "mismatch_max_abs_dlogp", "max |learner - sampler logp|")):
        for i, method in enumerate(("replay", "dense")):
            vals = [mismatch[a][method][key] for a in arms]
            ax.bar(np.arange(len(arms)) + (i - 0.5) * 0.4, vals, width=0.4,
                   label=f"learner {method}")
        ax.set_xticks(np.arange(len(arms)), arms, rotation=30, fontsize=8)
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(f"sampler with a region left out vs learner {LEARNER_POLICY} (all regions)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "alignment_mismatch.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for arm, s in series.items():
        pts = [(t, v) for t, v in zip(s["step"], s["reward_mean"], strict=True) if v is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=arm)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"GRPO, learner {LEARNER_POLICY}, sampler per arm", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "alignment_reward.png", dpi=100)
    plt.close(fig)


def run_alignment(out_dir: str | Path = "runs/study-alignment", *, steps: int | None = None,
                  sft_steps: int | None = None, arms: tuple[str, ...] | None = None,
                  overrides: tuple[str, ...] = (), quick: bool = False,
                  progress: bool = False) -> dict:
    """Runs the alignment study (module docstring); writes `alignment.json` and two plots.

    Args:
      out_dir: the study directory (`sft/`, one run directory per arm, JSON,
        PNGs). The study's own outputs there are replaced, except a finished
        `sft/` run of the same warm-start config, which is reused.
      steps: GRPO steps per arm (default `DEFAULT_STEPS`, `QUICK_STEPS` with `quick`).
      sft_steps: warm-start steps (default: the default config's `sft.steps`).
      arms: a subset of `ARMS` (None: all).
      overrides: extra `a.b=c` config overrides for every run (model size...).
      quick: a tiny model and batch (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: show the training progress bars.

    Returns:
      The JSON-able result (also in `alignment.json`): `mismatch` per arm,
      `arms` (per-arm training figures and series), `setup`, `timings`.

    Examples:
      >>> r = run_alignment("/tmp/al", quick=True, arms=("all", "no_rope"))  # doctest: +SKIP
      >>> r["mismatch"]["all"]["replay"]["mismatch_max_abs_dlogp"]  # doctest: +SKIP
      0.0
    """
    arms = check_arms(arms)
    check_overrides(overrides)
    steps = steps if steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS)
    if steps < 1:
        raise ValueError(f"alignment: --steps must be >= 1; got {steps}")
    t0 = time.time()
    out = Path(out_dir)
    common = [*(QUICK_OVERRIDES if quick else ()), *overrides,
              f"run.progress={'true' if progress else 'false'}",
              f"grpo.learner_policy={LEARNER_POLICY}"]
    if sft_steps is not None:
        common.append(f"sft.steps={sft_steps}")
    sft_cfg = make_config([*common, "grpo.steps=0", f"grpo.sampler_policy={LEARNER_POLICY}",
                           f"run.out_dir={out / 'sft'}"])
    arm_cfgs = {arm: make_config([
        *common, f"grpo.steps={steps}", f"grpo.sampler_policy={arm_policy(arm)}",
        # Only the initial and the final evaluation.
        f"run.eval_every={steps + 1}", f"run.out_dir={out / arm}"]) for arm in arms}
    reuse = _finished_run_with(out / "sft", sft_cfg)
    # Only what the study writes is replaced; anything else in `out` is left alone.
    remove_outputs(out, [*ARMS, *OUTPUT_FILES, *(() if reuse else ("sft",))])
    out.mkdir(parents=True, exist_ok=True)

    from jaxrl_lp.rollout.step import LoopSpec
    from jaxrl_lp.train.program import run_train

    sft_summary = (json.loads((out / "sft" / "summary.json").read_text()) if reuse
                   else run_train(sft_cfg))
    timings = {"sft_seconds": round(time.time() - t0, 1), "sft_reused": reuse}

    t_m = time.time()
    state, _, task, mcfg, _ = restore_state(sft_cfg)
    g = sft_cfg.grpo
    loop = LoopSpec(g.exit_rule, g.compute_mode).resolve(mcfg)
    max_new = g.max_new_tokens or task.max_completion_tokens
    mismatch = measure_mismatch(state["params"], mcfg, task, loop, arms,
                                num_prompts=g.prompts_per_step, group_size=g.group_size,
                                temperature=g.temperature, max_new_tokens=max_new,
                                seed=sft_cfg.run.seed)
    timings["mismatch_seconds"] = round(time.time() - t_m, 1)

    result_arms, all_series = {}, {}
    for arm in arms:
        t_arm = time.time()
        shutil.copytree(out / "sft", out / arm)
        summary = run_train(arm_cfgs[arm])
        records = [json.loads(x) for x in (out / arm / "metrics.jsonl").read_text().splitlines()
                   if x]
        s = _arm_series(records)
        all_series[arm] = s

        def mean(xs):
            xs = [x for x in xs if x is not None]
            return float(np.mean(xs)) if xs else None

        result_arms[arm] = {
            "sampler_policy": str(arm_policy(arm)),
            "initial_accuracy": summary["initial_accuracy"],
            "final_accuracy": summary["final_accuracy"],
            "mean_reward": mean(s["reward_mean"]),
            "mean_mismatch_k3": mean(s["mismatch_k3"]),
            "max_mismatch_max_abs_dlogp": max((x for x in s["mismatch_max_abs_dlogp"]
                                               if x is not None), default=None),
            "series": s,
        }
        timings[f"{arm}_seconds"] = round(time.time() - t_arm, 1)
    _plot(mismatch, all_series, out)
    result = {
        "study": "alignment",
        "learner_policy": str(PRESETS[LEARNER_POLICY]),
        "mismatch": mismatch,
        "arms": result_arms,
        "setup": {
            "sft_steps": sft_cfg.sft.steps, "grpo_steps": steps, "grpo_lr": g.lr,
            "loss_correction": sft_cfg.loss.correction, "logprobs": g.logprobs,
            "seed": sft_cfg.run.seed, "sft_accuracy": sft_summary["final_accuracy"],
            "mismatch_batch": {"prompts": min(g.prompts_per_step, len(task.heldout)),
                               "group_size": g.group_size, "temperature": g.temperature,
                               "max_new_tokens": max_new, "source": "held-out prompts, "
                               "each arm's own samples, same key"},
            "eval_size": sft_cfg.run.eval_size, "quick": quick, "overrides": list(common),
            "model": {k: getattr(mcfg, k) for k in
                      ("family", "hidden_size", "num_layers", "loop_steps", "intermediate_size")},
            "prompts_per_step": g.prompts_per_step, "group_size": g.group_size,
            "loop": str(loop),
        },
        "timings": dict(timings, total_seconds=round(time.time() - t0, 1)),
    }
    (out / "alignment.json").write_text(json.dumps(result, indent=2))
    return result
