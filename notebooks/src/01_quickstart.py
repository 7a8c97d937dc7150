# %% [markdown]
# # 01 · Quickstart: train the default run, plot it, read its completions
#
# `jaxrl-lp train` with no arguments runs the embedded default job: a small
# looped (Ouro-style: 2 layers x 2 loop steps) language model learns two-digit
# addition on CPU, first by a supervised warm-start (1,200 steps of 128
# sequences), then by 60 GRPO steps. On a 2-core CPU it takes about 3 minutes;
# on a Colab GPU runtime, less. Answers are written least significant digit
# first (`08+84=` -> `29`, i.e. 92), which a small model learns far faster.

# %%
# Installs jaxrl_lp when it is missing (Colab, a fresh kernel); does nothing when it is installed.
# PIP_SOURCE: "jaxrl-lp", a git URL ("git+https://github.com/OWNER/jaxrl_lp.git") or a local checkout.
PIP_SOURCE = "jaxrl-lp"
try:
    import jaxrl_lp  # noqa: F401
except ImportError:
    %pip install -q {PIP_SOURCE}

# %%
import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

# CI sets JAXRL_LP_SMALL=1: a much shorter run that exercises every cell (its accuracy stays low).
SMALL = os.environ.get("JAXRL_LP_SMALL", "0") == "1"
RUN = "runs/quickstart-small" if SMALL else "runs/quickstart"
FLAGS = ("--set sft.steps=300 --set grpo.steps=10 --set run.eval_every=5 --set run.eval_size=64"
         if SMALL else "")
print("SMALL =", SMALL)

# %% [markdown]
# ## 1. Train
#
# Any config key can be changed with `--set key=value` (`jaxrl-lp train --help`
# lists them all with their defaults). We only choose the run directory and
# turn the progress bars off, which would flood a notebook's output. Running
# the cell again resumes the run from its newest checkpoint; a finished run is
# left as it is.

# %%
!jaxrl-lp train --set run.out_dir={RUN} --set run.progress=false {FLAGS}

# %%
summary = json.loads(Path(RUN, "summary.json").read_text())  # printed by the command above
print("the run directory holds:", sorted(p.name for p in Path(RUN).iterdir() if p.name != ".lock"))

# %% [markdown]
# ## 2. Plot the run
#
# `metrics.jsonl` has one JSON record per step and phase: `sft` (the warm-start
# loss), `grpo` (reward, loss, the sampler/learner mismatch, ...) and `eval`
# (greedy accuracy on 256 held-out problems). The run also wrote the same plots
# as PNG files and TensorBoard events (`tb/`).

# %%
records = [json.loads(line) for line in Path(RUN, "metrics.jsonl").read_text().splitlines()]
sft = [r for r in records if r["phase"] == "sft"]
grpo = [r for r in records if r["phase"] == "grpo"]
evals = [r for r in records if r["phase"] == "eval"]
start = summary["sft_steps"]

fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
ax[0].plot([r["step"] for r in sft], [r["loss"] for r in sft], lw=0.8, label="per step")
ax[0].set(xlabel="warm-start step", ylabel="cross-entropy (nats / token)",
          title="Warm-start loss", yscale="log")
ax[0].legend()
steps = np.array([r["step"] - start for r in grpo])
reward = np.array([r["reward_mean"] for r in grpo])
ax[1].plot(steps, reward, lw=0.8, alpha=0.6, label="mean reward per step")
k = min(5, len(reward))
ax[1].plot(steps[k - 1:], np.convolve(reward, np.ones(k) / k, "valid"), label=f"{k}-step mean")
ax[1].set(xlabel="GRPO step", ylabel="reward (exact answer)", title="GRPO reward")
ax[1].legend()
ax[2].plot([r["step"] - start for r in evals], [r["accuracy"] for r in evals], "o-", color="C2",
           label="greedy, held-out")
ax[2].set(xlabel="GRPO step", ylabel="accuracy", title="Held-out accuracy", ylim=(0, 1))
ax[2].legend()
fig.tight_layout()
plt.show()
print(f"held-out accuracy {summary['initial_accuracy']:.1%} after the warm-start -> "
      f"{summary['final_accuracy']:.1%} after GRPO")

# %% [markdown]
# ## 3. Sample from the trained model
#
# The run's checkpoints are orbax directories; `Checkpointer.restore_params`
# reads the weights back as a plain pytree. `validate(cfg)` rebuilds what the
# run used (the task with its tokenizer, the model config, the loop spec), and
# `generate` is the same jitted sampler the training loop ran.

# %%
from jaxrl_lp.data import completion_text
from jaxrl_lp.rollout import SamplingConfig, generate
from jaxrl_lp.train import Checkpointer, load_config, validate

cfg = load_config(str(Path(RUN, "config.json")))
plan = validate(cfg)
task, tok = plan.task, plan.task.tokenizer
ckpt = Checkpointer(RUN, create=False)
params, meta = ckpt.restore_params()
ckpt.close()

problems = [task.heldout[i] for i in range(12)]
ro = generate(params, plan.model, [task.prompt_ids(p) for p in problems],
              sampling=SamplingConfig(greedy=True), max_new_tokens=plan.max_new_tokens,
              eos_id=tok.eos_id, pad_id=tok.pad_id, loop=plan.loop)
print(f"checkpoint step {meta['step']}, greedy completions of held-out problems:\n")
print(f"{'prompt':>10}  {'completion':>10}  {'read back':>9}  {'answer':>6}  ok")
for p, ids in zip(problems, np.asarray(ro.completion_tokens)):
    text = completion_text(ids, tok)
    shown = "(no EOS)" if text is None else text
    read = "" if text is None else text[::-1]  # least significant digit first
    print(f"{task.prompt_text(p):>10}  {shown:>10}  {read:>9}  {p.answer:>6}  "
          f"{'yes' if task.reward(text, p) == 1.0 else 'no'}")

# %% [markdown]
# ## 4. Score a checkpoint
#
# `evaluate_run` is what `jaxrl-lp eval --run runs/quickstart` prints: the greedy
# held-out accuracy of a run's latest checkpoint (or `step=...`), read with the
# run's own config. Other commands take the run further:
# `jaxrl-lp convert run-to-hf --run runs/quickstart --out DIR` writes a Hugging
# Face directory, and `jaxrl-lp sample` generates from one.

# %%
from jaxrl_lp.train import evaluate_run

print(evaluate_run(cfg))
