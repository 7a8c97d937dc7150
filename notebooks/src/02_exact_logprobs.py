# %% [markdown]
# # 02 · Exact log-probs: the learner sees what the sampler saw
#
# GRPO's importance ratio `pi_learner(token) / pi_sampler(token)` should be
# exactly 1 at the weights the sampler used. It is not when the learner computes
# log-probs with a different program than the sampler: one parallel
# teacher-forced forward (`dense`) rounds differently from token-by-token decoding
# over a KV cache, and at bf16 the difference is visible. jaxrl_lp's learner
# offers three ways:
#
# - `dense`: one parallel forward, differentiable; close to the sampler, not equal;
# - `replay`: the sampler's own prefill and decode steps, run over the recorded
#   tokens: equal to the sampler's log-probs bit for bit;
# - `hybrid = stop_gradient(replay) + (dense - stop_gradient(dense))`: replay's
#   values with dense's gradient (the bracket is exactly 0.0).

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
import warnings

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from jaxrl_lp.models import ModelConfig, from_pretrained, init_params, save_hf_checkpoint
from jaxrl_lp.numerics import Policy
from jaxrl_lp.rl import dense_logprobs, learner_logprobs, mismatch_metrics, replay_logprobs
from jaxrl_lp.rollout import SamplingConfig, generate

# CI sets JAXRL_LP_SMALL=1: shorter samples. 16 rows (4 prompts x 4 samples).
SMALL = os.environ.get("JAXRL_LP_SMALL", "0") == "1"
PROMPTS, SAMPLES, NEW_TOKENS = 4, 4, (24 if SMALL else 64)
print("SMALL =", SMALL)

# %% [markdown]
# ## 1. A Hugging Face checkpoint directory
#
# We make one from a random Qwen3-style config: with `transformers` when it is
# installed (as on Colab), else with jaxrl_lp's own writer. Either way the
# directory holds `config.json` and `model.safetensors`, and
# `jaxrl_lp.models.from_pretrained` loads it, as it loads a downloaded
# Qwen3 or Ouro checkpoint.

# %%
HF_DIR = "runs/random-qwen3-hf"
shape = dict(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=32, intermediate_size=384, max_position_embeddings=256)
try:
    warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    hf_config = transformers.Qwen3Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        max_position_embeddings=shape["max_position_embeddings"], tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(hf_config).save_pretrained(HF_DIR)
    print("written by transformers", transformers.__version__)
except ImportError:
    cfg = ModelConfig(family="qwen3", qk_norm=True, **shape)
    save_hf_checkpoint(HF_DIR, cfg, init_params(cfg, jax.random.PRNGKey(0)))
    print("written by jaxrl_lp.models.save_hf_checkpoint")
print(sorted(os.listdir(HF_DIR)))

model = from_pretrained(HF_DIR)
cfg, params = model.config, model.params()
print(f"loaded: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")

# %% [markdown]
# ## 2. Sample, then compute the learner's log-probs three ways
#
# The sampler (`generate`) records the log-prob of every token it draws. We
# sample under two precision policies: `fp32`, and `bf16` (bf16 compute with f32
# accumulation; on CPU the bf16 values are carried in f32 arrays, with every
# rounding site of a GPU run). The dense log-probs are one jitted forward; the
# replay is the sampler's own compiled program run again with the recorded tokens
# forced (`replay_logprobs`: nothing is compiled for it); the hybrid's value is
# that replay, passed in as the GRPO step passes it.

# %%
rng = np.random.default_rng(0)
prompts = [list(rng.integers(1, cfg.vocab_size, n)) for n in rng.integers(4, 12, PROMPTS)]


def logprobs_three_ways(name):
    policy = Policy.parse(name)
    ro = generate(params, cfg, prompts, policy=policy, sampling=SamplingConfig(temperature=1.0),
                  max_new_tokens=NEW_TOKENS, num_samples=SAMPLES, key=jax.random.PRNGKey(1))
    dense = jax.jit(lambda p, r: dense_logprobs(p, cfg, policy, r)[0])(params, ro)
    replay = replay_logprobs(params, cfg, policy, ro)
    hybrid = jax.jit(lambda p, r, v: learner_logprobs(p, cfg, policy, r, "hybrid",
                                                      replay_BxN=v)[0])(params, ro, replay)
    return ro, {"dense": dense, "replay": replay, "hybrid": hybrid}


results = {policy: logprobs_three_ways(policy) for policy in ("fp32", "bf16")}

print(f"{'policy':6} {'method':7} {'max |learner - sampler|':>24} {'k3 KL':>10} {'bit-equal':>10}")
for policy, (ro, lps) in results.items():
    mask = np.asarray(ro.completion_mask) > 0
    for method, lp in lps.items():
        m = mismatch_metrics(lp, ro.logprobs, ro.completion_mask)
        same = np.array_equal(np.asarray(lp)[mask].view(np.uint32),
                              np.asarray(ro.logprobs)[mask].view(np.uint32))
        print(f"{policy:6} {method:7} {float(m['mismatch_max_abs_dlogp']):24.3e} "
              f"{float(m['mismatch_k3']):10.2e} {str(same):>10}")
        if method != "dense":
            assert same, (policy, method)

# %% [markdown]
# `replay` and `hybrid` give the sampler's values bit for bit, under both
# policies, by construction: the executable that sampled computes them again
# from the same inputs, and a slice of rows is replayed with each row in its
# place in the sampler's batch, so minibatches are exact too (on a GPU as well:
# `docs/bench/replay-h200.json`). `import jaxrl_lp` also asks XLA to round where
# the program rounds (`--xla_allow_excess_precision=false`; with XLA's default
# a fusion may skip a bf16 round trip, and 64-row bf16 batches differed by
# about 6e-3 nats). `dense` is off by rounding: its sums over the whole
# sequence round apart from the sampler's one-token steps, at fp32 in the last
# bits and at bf16 by a bf16 step wherever a product lands on the other side of
# a rounding boundary. How often that happens depends on the kernels: on a CPU
# whose weights-major products run in narrow tiles the sampler multiplies a
# `[out, in]` copy of its weights (the decode layout `transposed`,
# `ro.decode_layout`; elsewhere `as_stored`) and at this size its bf16 products
# mostly round as the dense forward's do; on a GPU, or at another size or CPU,
# that need not hold (not measured there).
# That gap is the *training-inference mismatch* that TIS/MIS corrections exist
# to patch up, here removed at its source.

# %%
fig, ax = plt.subplots(1, 2, figsize=(13, 4))
for i, (policy, (ro, lps)) in enumerate(results.items()):
    mask = np.asarray(ro.completion_mask) > 0
    d = np.abs(np.asarray(lps["dense"]) - np.asarray(ro.logprobs))[mask]
    bins = np.logspace(-9, 0, 46)
    ax[0].hist(np.clip(d, 1e-9, None), bins=bins, alpha=0.6, color=f"C{i}",
               label=f"dense, {policy} ({(d > 0).mean():.0%} of tokens differ)")
    ax[1].plot(np.abs(np.asarray(lps["dense"]) - np.asarray(ro.logprobs)).max(0), color=f"C{i}",
               label=f"dense, {policy}")
ax[0].set(xscale="log", xlabel="|learner log-prob - sampler log-prob| (nats; 0 drawn at 1e-9)",
          ylabel="tokens", title="Dense learner vs sampler, per token")
ax[0].legend(title="replay and hybrid: 0 on every token")
ax[1].set(yscale="log", xlabel="completion position", ylabel="max over sequences (nats)",
          title="Dense mismatch along the completion")
ax[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. What the dense learner gets wrong
#
# At the behaviour weights every PPO ratio `exp(logp_learner - logp_sampler)`
# should be 1, so the first update of each batch is the plain policy gradient.
# With dense log-probs the ratios scatter around 1, and every correction that
# reads them (clipping, TIS/MIS weights) acts on rounding noise. The hybrid's
# ratios are exactly 1, while its gradient is exactly the dense gradient: the
# learner's update is unchanged, only the values it is measured against are the
# sampler's.

# %%
ro, lps = results["bf16"]
mask = np.asarray(ro.completion_mask) > 0
ratio = {m: np.exp(np.asarray(lps[m]) - np.asarray(ro.logprobs))[mask] for m in ("dense", "hybrid")}
for m, r in ratio.items():
    print(f"{m:6}: ratio min {r.min():.6f}  max {r.max():.6f}  tokens with ratio != 1: "
          f"{(r != 1).mean():.1%}")

adv = jnp.asarray(rng.normal(size=ro.logprobs.shape[0]), jnp.float32)


def surrogate(method):
    def f(p):
        lp = learner_logprobs(p, cfg, Policy.parse("bf16"), ro, method)[0]
        return jnp.sum(lp * adv[:, None] * ro.completion_mask)
    return jax.jit(jax.grad(f))(params)


g_dense, g_hybrid = surrogate("dense"), surrogate("hybrid")
same_grad = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_hybrid)))
print("hybrid gradient == dense gradient, bit for bit:", same_grad)
assert same_grad and (ratio["hybrid"] == 1).all()

fig, ax = plt.subplots(figsize=(7, 3.6))
# float64 bins: the ratios may sit within a few f32 steps of 1.
ax.hist(ratio["dense"].astype(np.float64), bins=60, color="C1", alpha=0.8, label="dense (bf16)")
ax.axvline(1.0, color="C2", lw=2, label="hybrid / replay: exactly 1")
ax.set(xlabel="PPO ratio at the behaviour weights", ylabel="tokens",
       title="Importance ratios that should all be 1")
ax.legend()
fig.tight_layout()
plt.show()
