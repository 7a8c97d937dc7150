# %% [markdown]
# # 06 · Tools and turns: an environment of your own, replayed bit for bit
#
# A multi-turn task gives each episode an environment: the sampler decodes a model
# turn until a stop token, EOS or the per-turn limit, hands the turn to the
# environment, prefills its observation on the KV cache it holds, and decodes the next
# turn. This notebook trains the embedded calculator task
# (`configs/multiturn_tools.py`: the model may call a calculator with `EXPR?` and
# reads the answer `VALUE;`), plots its solve and tool-use rates, then writes an
# environment of its own in a few lines, samples episodes with it and checks that the
# replay of those episodes (`jaxrl_lp.rollout.replay_multiturn`) is the sampler's bits.

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

from jaxrl_lp.envs import CalculatorEnv, CalculatorTask, EnvRunner, StepResult
from jaxrl_lp.models import ModelConfig
from jaxrl_lp.rollout import SamplingConfig, replay_multiturn
from jaxrl_lp.train import (
    Checkpointer,
    GRPOConfig,
    RunConfig,
    SFTConfig,
    TaskConfig,
    TrainConfig,
    apply_overrides,
    run_train,
    validate,
)
from jaxrl_lp.train.episodes import sample_episodes

# CI sets JAXRL_LP_SMALL=1: a shorter warm-start and fewer GRPO steps.
SMALL = os.environ.get("JAXRL_LP_SMALL", "0") == "1"
print("devices:", jax.devices(), "| SMALL =", SMALL)

# %% [markdown]
# ## 1. Train the calculator task
#
# The config of `jaxrl-lp train --config configs/multiturn_tools.py`, written out: a
# 2-layer dense model, a warm-start whose episodes call the calculator on 30% of the
# problems (3-digit by 2-digit products), then GRPO on episodes of up to 3 turns. A
# finished run in `runs/multiturn` is reused.

# %%
cfg = TrainConfig(
    model=ModelConfig(family="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=192, qk_norm=True, loop_steps=1,
                      max_position_embeddings=64, rope_theta=10_000.0),
    task=TaskConfig(kind="calculator", ops="*", max_digits=3, second_digits=2, max_turns=3,
                    tool_fraction=0.3),
    sft=SFTConfig(steps=600, batch_size=64, lr=3e-3),
    grpo=GRPOConfig(steps=40, prompts_per_step=16, group_size=8, lr=3e-4, verify_every=5),
    run=RunConfig(out_dir="runs/multiturn", eval_every=10, eval_size=128, checkpoint_every=20,
                  progress=False))
if SMALL:
    cfg = apply_overrides(cfg, ["run.out_dir=runs/multiturn-small", "sft.steps=300",
                                "grpo.steps=12", "run.eval_every=4", "run.eval_size=64"])
t0 = time.time()
summary = run_train(cfg)
print(f"held-out solve rate {summary['initial_accuracy']:.1%} after the warm-start -> "
      f"{summary['final_accuracy']:.1%} after {summary['grpo_steps']} GRPO steps "
      f"({time.time() - t0:.0f} s{', reused' if summary.get('complete') else ''})")

# %% [markdown]
# ## 2. What GRPO changed
#
# Each GRPO record of `metrics.jsonl` carries the episodes' metrics: `accuracy` (the
# share solved), `tool_use` (the share that called the calculator), `tool_solved` (of
# those, the share solved), `turns_per_episode`, and `replay_verified` on the steps
# whose batch was replayed and found equal to the sampler's bits.

# %%
records = [json.loads(x) for x in Path(cfg.run.out_dir, "metrics.jsonl").read_text().splitlines()]
grpo = [r for r in records if r["phase"] == "grpo"]
evals = [r for r in records if r["phase"] == "eval"]
steps = [r["step"] for r in grpo]
verified = [r for r in grpo if r.get("replay_verified") == 1.0]
print(f"{len(verified)} of {len(grpo)} steps verified, largest mismatch "
      f"{max(r['mismatch_max_abs_dlogp'] for r in verified):.1e}")
assert verified and all(r["mismatch_max_abs_dlogp"] == 0.0 for r in verified)

fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
for key in ("accuracy", "tool_use", "tool_solved"):
    ax[0].plot(steps, [r[key] for r in grpo], label=key)
ax[0].set_xlabel("step")
ax[0].set_title("sampled episodes")
ax[0].legend()
ax[1].plot([r["step"] for r in evals], [r["accuracy"] for r in evals], marker="o")
ax[1].set_xlabel("step")
ax[1].set_title("held-out solve rate (greedy)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. An environment of your own
#
# An environment has two methods: `reset(record)` returns the prompt's token ids, and
# `step(turn)` answers a model turn with a `StepResult` (an observation, a reward,
# whether the episode ended). `CalculatorEnv` is the task's own. Here a variant gives
# a second chance: a wrong answer gets the observation `err;` and one more turn, and
# only a right answer earns the reward. A task makes one environment per episode
# (`make_env`).

# %%
class SecondChance(CalculatorEnv):
    def reset(self, problem):
        self.wrong = 0
        return super().reset(problem)

    def step(self, turn):
        result = super().step(turn)
        if turn.ended_by == "eos" and result.reward == 0.0 and self.wrong == 0:
            self.wrong, self.done = 1, False  # one more try
            return StepResult(observation="err;", info={**result.info, "second_chance": True})
        return result


class SecondChanceTask(CalculatorTask):
    def make_env(self):
        return SecondChance(self)


plan = validate(cfg)
task = SecondChanceTask(max_turns=4)
ckpt = Checkpointer(cfg.run.out_dir, create=False)
params, _ = ckpt.restore_params()
ckpt.close()

# %% [markdown]
# ## 4. Episodes, and their replay
#
# `sample_episodes` runs G episodes of each record (the environments stepped on host
# threads by an `EnvRunner`, with a per-call timeout). The rollout records every token
# with its origin: `completion_mask` marks the policy's tokens (the loss covers them),
# `env_mask` the observations. `replay_multiturn` reruns the sampler's own programs
# with the recorded tokens forced: its log-probs are the sampler's, bit for bit.

# %%
runner = EnvRunner(timeout_s=5.0)
records = [task.heldout[i] for i in range(8)]
mt = sample_episodes(params, plan.model, task, records, group_size=4, policy=plan.sampler_policy,
                     sampling=SamplingConfig(temperature=1.0), loop=plan.loop,
                     key=jax.random.PRNGKey(0), runner=runner)
runner.close()
ro = mt.rollout
tok = task.tokenizer
for b in range(0, 32, 8):
    n = int((np.asarray(ro.completion_mask[b]) + np.asarray(ro.env_mask[b])).sum())
    pieces, origin = [], None
    for t, is_env in zip(np.asarray(ro.completion_tokens[b, :n]), np.asarray(ro.env_mask[b, :n])):
        if is_env != origin:
            pieces.append("  [env] " if is_env else "  [model] ")
            origin = is_env
        pieces.append(tok.decode([int(t)], skip_special=False))
    print(f"{tok.decode(list(np.asarray(ro.prompt_tokens[b])), skip_special=True)}"
          f"{''.join(pieces)}  -> reward {mt.rewards[b]:.0f} ({mt.reasons[b]})")

second = sum(1 for row in mt.infos for i in row if isinstance(i, dict) and i.get("second_chance"))
print(f"\nsolved {np.mean(mt.rewards >= 1):.0%} of 32 episodes; {second} second chances taken")
replayed = np.asarray(replay_multiturn(params, plan.model, plan.learner_policy, mt))
mask = np.asarray(ro.completion_mask) > 0
differ = int((replayed[mask].view(np.uint32) != np.asarray(ro.logprobs)[mask].view(np.uint32)).sum())
print(f"replay == sampler: {differ} of {int(mask.sum())} policy tokens differ")
assert differ == 0
