# %% [markdown]
# # 07 · Your own task: your data, your reward function, the trainer's promise
#
# The trainer takes any task that provides what `jaxrl_lp.tasks.Task` names: splits of
# records, a prompt's token ids and a way to score completions. This notebook brings
# one the way a user does: it writes a JSONL file of records, defines a reward function
# with TRL's signature (`f(prompts, completions, **columns) -> list[float | None]`),
# builds a `DatasetTask` over them and trains it through `run_train(cfg, task)`, with
# the checkpoints, resume, metrics and exactness checks of the built-in tasks. It then
# plots the reward curve, and samples from the trained weights to check that the
# learner's replay is the sampler's bits.
#
# The same task without Python: `jaxrl-lp train --set task.kind=dataset --set
# task.path=sums.jsonl --set task.rewards=myrewards:correct` (docs/guide.md, "Your own
# task").

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
import time
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np

from jaxrl_lp.rl import replay_logprobs
from jaxrl_lp.rollout import SamplingConfig, generate
from jaxrl_lp.rollout.rollout import take_rows
from jaxrl_lp.tasks import DatasetTask, RewardFunction, char_tokenizer_for, check_task, load_records
from jaxrl_lp.train import Checkpointer, apply_overrides, default_config, run_train, validate

# CI sets JAXRL_LP_SMALL=1: a shorter warm-start and fewer GRPO steps.
SMALL = os.environ.get("JAXRL_LP_SMALL", "0") == "1"
print("devices:", jax.devices(), "| SMALL =", SMALL)

# %% [markdown]
# ## 1. The data: a JSONL file of your own
#
# Any columns will do: here `question` holds the prompt and `solution` the reference
# answer, and `carry` is a column of our own that the reward function will read. The
# sums are written the way the built-in arithmetic task writes them (operands padded,
# the answer least significant digit first), a form a 2-layer model learns in minutes.

# %%
data = Path("runs/own_task/sums.jsonl")
data.parent.mkdir(parents=True, exist_ok=True)
with data.open("w") as f:
    for a in range(100):
        for b in range(100):
            f.write(json.dumps({"question": f"{a:02d}+{b:02d}=", "solution": str(a + b)[::-1],
                                "carry": int(a % 10 + b % 10 >= 10)}) + "\n")
records = load_records(data)["train"]  # read with Hugging Face datasets, offline
print(len(records), "records, e.g.", records[0])

# %% [markdown]
# ## 2. A reward function, TRL's signature
#
# It gets the prompts, the completions' text (before EOS) and every other column as a
# keyword, one value per completion, and returns a list of rewards; `None` means "does
# not apply". A task may have several, each weighted; each one's mean is logged as
# `reward/<name>`.

# %%
def correct(prompts, completions, solution, **kwargs):
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]


def carried(completions, solution, carry, **kwargs):
    """Right answers to sums with a carry, the harder half (None for the others)."""
    return [float(c.strip() == s) if k else None for c, s, k in zip(completions, solution, carry)]


task = DatasetTask(records, char_tokenizer_for([r["question"] + r["solution"] for r in records]),
                   [RewardFunction("correct", correct), RewardFunction("carried", carried, 0.0)],
                   prompt_key="question", answer_key="solution")
check_task(task, needs_sft=True)  # what the trainer checks first: one line if anything lacks
print(f"{len(task.train)} train and {len(task.heldout)} held-out records; a prompt: "
      f"{task.prompt_ids(task.train[0])}")

# %% [markdown]
# ## 3. Train it
#
# The embedded default run's model and schedule (a 2-layer, 2-loop Ouro-style model; a
# warm-start on the file's answers, then GRPO), with this task. A finished run in
# `runs/own_task/run` is reused; `grpo.verify_every=5` replays every fifth step's batch
# and stops the run if a bit differs from the sampler's.

# %%
cfg = apply_overrides(default_config(), ["run.out_dir=runs/own_task/run", "run.progress=false",
                                         "grpo.verify_every=5"])
if SMALL:
    cfg = apply_overrides(cfg, ["run.out_dir=runs/own_task/run-small", "sft.steps=300",
                                "grpo.steps=10", "run.eval_every=5", "run.eval_size=64"])
t0 = time.time()
summary = run_train(cfg, task)
print(f"held-out accuracy {summary['initial_accuracy']:.1%} after the warm-start -> "
      f"{summary['final_accuracy']:.1%} after {summary['grpo_steps']} GRPO steps "
      f"({time.time() - t0:.0f} s{', reused' if summary.get('complete') else ''})")

# %% [markdown]
# ## 4. The reward curve
#
# Each GRPO record of `metrics.jsonl` holds each reward function's mean over the step's
# samples (`reward/correct`, and `reward/carried` over the samples it applies to), its
# failures (`reward_failed/<name>`: a function that raised, timed out or returned a
# non-finite value gives that sample `task.failure_reward`) and `replay_verified` on the
# steps whose batch was replayed.

# %%
rows = [json.loads(x) for x in Path(cfg.run.out_dir, "metrics.jsonl").read_text().splitlines()]
grpo = [r for r in rows if r["phase"] == "grpo"]
evals = [r for r in rows if r["phase"] == "eval"]
verified = [r for r in grpo if r["replay_verified"] == 1.0]
print(f"{len(verified)} of {len(grpo)} steps verified, largest mismatch "
      f"{max(r['mismatch_max_abs_dlogp'] for r in verified):.1e}")
assert verified and all(r["mismatch_max_abs_dlogp"] == 0.0 for r in verified)

fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
for key in ("reward/correct", "reward/carried"):
    ax[0].plot([r["step"] for r in grpo], [r[key] for r in grpo], label=key)
ax[0].set_xlabel("step")
ax[0].set_title("sampled completions")
ax[0].legend()
ax[1].plot([r["step"] for r in evals], [r["accuracy"] for r in evals], marker="o")
ax[1].set_xlabel("step")
ax[1].set_title("held-out accuracy (greedy)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Sample from the trained weights, and replay
#
# The sampler records each token's log-prob; the learner's replay reruns the sampler's
# own program with the tokens forced. Under the same policy and weights the two are the
# same bits, whole and for any slice of the batch: what lets GRPO take the sampler's
# log-probs as its own.

# %%
plan = validate(cfg, task)
ckpt = Checkpointer(cfg.run.out_dir, create=False)
params, _ = ckpt.restore_params(model_config=plan.model)
ckpt.close()
tok = task.tokenizer
held = [task.heldout[i] for i in range(8)]
ro = generate(params, plan.model, [task.prompt_ids(r) for r in held], policy=plan.sampler_policy,
              sampling=SamplingConfig(temperature=1.0), max_new_tokens=plan.max_new_tokens,
              num_samples=4, eos_id=tok.eos_id, pad_id=tok.pad_id, loop=plan.loop,
              key=jax.random.PRNGKey(0))
scores = task.rewards(np.asarray(ro.completion_tokens), [r for r in held for _ in range(4)])
for b in range(0, 32, 8):
    print(f"{held[b // 4]['question']} -> {tok.decode(list(np.asarray(ro.completion_tokens[b])))!r}"
          f" (solution {held[b // 4]['solution']}, reward {scores.total_B[b]:.0f})")
mask = np.asarray(ro.completion_mask) > 0
want = np.asarray(ro.logprobs)
for name, rows_ in (("the whole batch", np.arange(32)), ("rows 8..15", np.arange(8, 16))):
    got = np.asarray(replay_logprobs(params, plan.model, plan.learner_policy,
                                     take_rows(ro, rows_)))
    m = mask[rows_]
    differ = int((got[m].view(np.uint32) != want[rows_][m].view(np.uint32)).sum())
    print(f"replay == sampler, {name}: {differ} of {int(m.sum())} sampled tokens differ")
    assert differ == 0
