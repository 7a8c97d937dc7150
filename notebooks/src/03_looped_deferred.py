# %% [markdown]
# # 03 · Looped models: exit distributions, deferred decoding, the replayed schedule
#
# An Ouro-style looped model runs its shared layers `R` times per token. After
# each loop step `r` an exit gate gives a probability `lambda_r`; the exit
# distribution is `p_r = lambda_r * prod_{s<r} (1 - lambda_s)` (the last step
# takes the rest). An exit rule such as `threshold:0.5` reads a token out at the
# first step whose cumulative exit probability reaches 0.5.
#
# In `dense` compute mode every token still runs all `R` steps (only the read-out
# moves); in `deferred` mode a token stops computing at its exit, and a decode
# step stops looping once every token of the batch has exited. The sampler
# records each token's exit step, and the learner replays exactly that schedule.

# %%
# Installs jaxrl_lp when it is missing (Colab, a fresh kernel); does nothing when it is installed.
# PIP_SOURCE: "jaxrl-lp", a git URL ("git+https://github.com/OWNER/jaxrl_lp.git") or a local checkout.
PIP_SOURCE = "jaxrl-lp"
try:
    import jaxrl_lp  # noqa: F401
except ImportError:
    %pip install -q {PIP_SOURCE}

# %%
import os
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from jaxrl_lp.models import LoopSpec, ModelConfig, init_params, looped_forward
from jaxrl_lp.numerics import Policy
from jaxrl_lp.rl import dense_logprobs, learner_logprobs, replay_logprobs
from jaxrl_lp.rollout import SamplingConfig, generate

# CI sets JAXRL_LP_SMALL=1: shorter decodes, fewer timing repeats.
SMALL = os.environ.get("JAXRL_LP_SMALL", "0") == "1"
WIDTH, NEW_TOKENS, REPEATS = 128, (32 if SMALL else 64), (3 if SMALL else 7)
print("SMALL =", SMALL)

# %% [markdown]
# ## 1. A looped model whose tokens exit at different steps
#
# A randomly initialized gate gives every token `lambda ~ 0.5`. A trained Ouro
# model's gates differ from token to token and from step to step, so we widen
# the gate's random weights (a kernel of std `2 / sqrt(D)`: the gate reads the
# final-normed hidden state, whose RMS is about 1) and give it a bias of -1.

# %%
R = 4
cfg = ModelConfig(family="ouro", vocab_size=256, hidden_size=WIDTH, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=WIDTH // 4, intermediate_size=3 * WIDTH,
                  qk_norm=False, loop_steps=R, max_position_embeddings=256)
params = init_params(cfg, jax.random.PRNGKey(0))
gate_kernel = 2.0 / np.sqrt(cfg.hidden_size) * jax.random.normal(jax.random.PRNGKey(2),
                                                                  (cfg.hidden_size, 1))
params["exit_gate"] = {"kernel": gate_kernel, "bias": jnp.full((1,), -1.0, jnp.float32)}
policy = Policy.parse("fp32")
RULE = "threshold:0.5"

tokens = jax.random.randint(jax.random.PRNGKey(2), (1, 40), 1, cfg.vocab_size)
out = jax.jit(lambda p, t: looped_forward(p, cfg, policy, t, loop=LoopSpec(RULE)))(params, tokens)
pdf, exits = np.asarray(out.exit_pdf[0]), np.asarray(out.exit_steps[0])

fig, ax = plt.subplots(figsize=(13, 3.4))
im = ax.imshow(pdf.T, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1)
ax.plot(np.arange(len(exits)), exits, "r.", ms=9, label=f"exit step under {RULE}")
ax.set(xlabel="token position", ylabel="loop step r (0-based)", yticks=range(R),
       title="Exit distribution p_r per token")
fig.colorbar(im, ax=ax, label="p_r")
ax.legend(loc="upper right")
fig.tight_layout()
plt.show()
print("tokens exiting at each step:", np.bincount(exits, minlength=R))


# %% [markdown]
# ## 2. Dense vs deferred decoding
#
# The same prompts are decoded under the same exit rule, once in each compute
# mode (temperature 1, fixed key: a random model's greedy output repeats one
# token). Each call is compiled first, then timed. `loop_evals` counts the loop
# steps the decode steps ran: `R` per step in dense mode, the deepest exit of the
# batch (plus one) in deferred mode.

# %%
def decode(mode, batch):
    prompts = np.random.default_rng(batch).integers(1, cfg.vocab_size, (batch, 16)).tolist()
    return lambda: jax.block_until_ready(generate(
        params, cfg, prompts, policy=policy, sampling=SamplingConfig(temperature=1.0),
        max_new_tokens=NEW_TOKENS, loop=LoopSpec(RULE, mode), key=jax.random.PRNGKey(3)))


timing = {}
for batch in (1, 8):
    for mode in ("dense", "deferred"):
        run = decode(mode, batch)
        ro = run()  # compiles
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            ro = run()
            times.append(time.perf_counter() - t0)
        timing[batch, mode] = (min(times) / NEW_TOKENS * 1e3, int(ro.loop_evals), ro)
        print(f"batch {batch}, {mode:8}: {timing[batch, mode][0]:.2f} ms per decode step, "
              f"{int(ro.loop_evals)} loop steps for {NEW_TOKENS - 1} decode steps")

fig, ax = plt.subplots(1, 2, figsize=(12, 3.6))
for i, batch in enumerate((1, 8)):
    ms = [timing[batch, m][0] for m in ("dense", "deferred")]
    evals = [timing[batch, m][1] / (NEW_TOKENS - 1) for m in ("dense", "deferred")]
    ax[0].bar(np.arange(2) + 0.4 * i, ms, 0.4, label=f"batch {batch}")
    ax[1].bar(np.arange(2) + 0.4 * i, evals, 0.4, label=f"batch {batch}")
for a, ylabel, title in ((ax[0], "ms per decode step", "Decode time"),
                         (ax[1], "loop steps per decode step", "Loop steps run")):
    a.set(xticks=[0.2, 1.2], xticklabels=["dense", "deferred"], ylabel=ylabel, title=title)
    a.set_xlabel("compute mode")
    a.legend()
ax[1].axhline(R, ls="--", color="gray", label=f"R = {R}")
ax[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# One sequence decodes with fewer loop steps per token in deferred mode, and is
# faster for it. A batch loops until its deepest token has exited, so with 8
# sequences some token nearly always needs the last step: deferred mode then
# runs all `R` steps too and gains little. The fixed part of a decode step
# (embedding, read-out, sampling, the loop's control) does not shrink either;
# `jaxrl-lp bench sampler` measures both effects on larger models.

# %% [markdown]
# ## 3. The exit schedule the learner replays
#
# A deferred rollout records, for every completion token, the exit step of the
# forward that produced it (`Rollout.exit_steps`) and its loop spec. The
# learner's `replay` runs the sampler's own compiled program with those tokens
# and exit steps forced and gets the sampler's log-probs bit for bit; `dense` applies the same schedule in one
# parallel forward. Reading a deferred rollout as if it were dense would be
# silently wrong, so it is refused.

# %%
ro = timing[8, "deferred"][2]
replay = replay_logprobs(params, cfg, policy, ro)  # the sampler's program, tokens forced
dense = jax.jit(lambda p, r: dense_logprobs(p, cfg, policy, r)[0])(params, ro)
mask = np.asarray(ro.completion_mask) > 0
print("replay == sampler, bit for bit:", np.array_equal(np.asarray(replay)[mask], np.asarray(ro.logprobs)[mask]))
print(f"dense (same schedule), max |diff|: {np.abs(np.asarray(dense) - np.asarray(ro.logprobs))[mask].max():.2e}")
assert np.array_equal(np.asarray(replay)[mask], np.asarray(ro.logprobs)[mask])
try:
    learner_logprobs(params, cfg, policy, ro, "dense", loop=LoopSpec(RULE, "dense"))
except ValueError as e:
    print("refused:", e)

fig, ax = plt.subplots(figsize=(13, 3.4))
im = ax.imshow(np.asarray(ro.exit_steps), aspect="auto", cmap="magma", vmin=0, vmax=R - 1,
               interpolation="nearest")
ax.set(xlabel="completion token", ylabel="sequence",
       title=f"Recorded exit steps of a deferred rollout ({ro.loop.exit_rule}, {ro.loop.compute_mode})")
fig.colorbar(im, ax=ax, label="exit step (0-based)", ticks=range(R))
fig.tight_layout()
plt.show()
