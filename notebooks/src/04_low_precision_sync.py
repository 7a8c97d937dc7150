# %% [markdown]
# # 04 · Low-precision sync: Fair Cast, ternary export, the seven sync checks
#
# The learner keeps f32 master weights; the sampler runs a low-precision copy
# that an *exporter* makes from them at every step (`jaxrl_lp.sync`). Three
# things can go wrong, and each has a tool:
#
# 1. RL updates are tiny. Rounded to bf16 by round-to-nearest, most of them
#    vanish, and the served copy lags the master (**Fair Cast**: stochastic
#    rounding or error feedback instead).
# 2. A quantized export can serve codes the model was not trained with
#    (**ternary export** paths and their code disagreement).
# 3. The copy the sampler holds can differ from what was exported, or be stale
#    (**the seven sync checks**).

# %%
# Installs jaxrl_lp when it is missing (Colab, a fresh kernel); does nothing when it is installed.
# PIP_SOURCE: "jaxrl-lp", a git URL ("git+https://github.com/OWNER/jaxrl_lp.git") or a local checkout.
PIP_SOURCE = "jaxrl-lp"
try:
    import jaxrl_lp  # noqa: F401
except ImportError:
    %pip install -q {PIP_SOURCE}

# %%
import dataclasses
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from jaxrl_lp.models import init_params
from jaxrl_lp.numerics import Policy
from jaxrl_lp.sync import (
    CHECK_NAMES,
    LAG_THRESHOLD,
    ROUNDINGS,
    TERNARY_PATHS,
    SamplerState,
    cast,
    code_disagreement,
    expected_layout,
    hash_served,
    progress_init,
    progress_update,
    quantize,
    run_sync_checks,
    staleness_init,
    staleness_update,
    ternary,
)
from jaxrl_lp.train import default_config, validate

# CI sets JAXRL_LP_SMALL=1: fewer simulated RL steps.
SMALL = os.environ.get("JAXRL_LP_SMALL", "0") == "1"
STEPS = 30 if SMALL else 100
print("SMALL =", SMALL)

# The default run's model (a 2-layer, 2-loop Ouro-style decoder), randomly initialized.
cfg = validate(default_config()).model
master = init_params(cfg, jax.random.PRNGKey(0))
print(f"{sum(x.size for x in jax.tree.leaves(master)):,} parameters")

# %% [markdown]
# ## 1. Fair Cast: does the served bf16 copy follow the master?
#
# RL from a released bf16 checkpoint starts with master weights on the bf16
# grid. We apply Adam-like updates at an RL learning rate (`1e-6` per element
# and step, in a mostly consistent direction) and export after every step with
# each rounding of `cast("bf16", rounding)`. *Served progress* is
# `<s_t - s_0, m_t - m_0> / |m_t - m_0|^2`: 1 when the served copy has moved as
# far as the master along the master's path, 0 when it has not moved. The *lag*
# is the first step where it reaches 0.5.

# %%
w0 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), master)
rng = np.random.default_rng(0)
direction = jax.tree.map(lambda x: rng.normal(size=x.shape), w0)
deltas = jax.tree.map(lambda g: jnp.asarray(
    -1e-6 * np.sign(g + 0.5 * rng.normal(size=(STEPS, *g.shape))), jnp.float32), direction)

fair_cast = {}
for rounding in ROUNDINGS:
    exporter = cast("bf16", rounding, seed=0)

    def step(carry, delta, exporter=exporter):
        m, state, prog, stale = carry
        m = jax.tree.map(jnp.add, m, delta)
        served, state = exporter.apply(m, state)
        stale, metrics = staleness_update(stale, served)
        prog, progress = progress_update(prog, served, m)
        return (m, state, prog, stale), (progress, metrics["retention"])

    s0, state = exporter.apply(w0, exporter.init(w0))
    carry = (w0, state, progress_init(s0, w0), staleness_init(s0))
    (_, _, prog, _), (progress, retention) = jax.jit(lambda c, x: jax.lax.scan(step, c, x))(carry, deltas)
    fair_cast[rounding] = (np.asarray(progress), np.asarray(retention), int(prog.lag))
    lag = int(prog.lag)
    print(f"{rounding:15}: final progress {float(progress[-1]):.2f}, lag "
          f"{'never' if lag < 0 else f'{lag} steps'}, mean update retention {float(retention.mean()):.1%}")

fig, ax = plt.subplots(1, 2, figsize=(13, 3.8))
t = np.arange(1, STEPS + 1)
ax[0].plot(t, np.ones(STEPS), "k:", label="f32 sampler (reference)")
for rounding, (progress, retention, lag) in fair_cast.items():
    ax[0].plot(t, progress, label=f"bf16 {rounding} (lag {'-' if lag < 0 else lag})")
    ax[1].plot(t, retention, label=f"bf16 {rounding}")
ax[0].axhline(LAG_THRESHOLD, color="gray", ls="--", lw=0.8)
ax[0].set(xlabel="RL step", ylabel="served progress", title="Does the served copy follow the master?")
ax[0].legend()
ax[1].set(xlabel="RL step", ylabel="fraction of weights changed", yscale="log",
          title="Update retention per export")
ax[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Round-to-nearest freezes the served copy: an element moves only once its master
# has drifted half a bf16 ulp, which at `lr = 1e-6` takes hundreds of steps.
# Stochastic rounding moves it by the master's displacement in expectation from
# the first step; error feedback carries the rounding error forward and catches
# up within a few steps. `jaxrl-lp study fair-cast` measures the same on real
# GRPO runs, with held-out accuracy.
#
# ## 2. Ternary export: which codes does the sampler serve?
#
# A model trained with ternary weights (BitNet b1.58: `gamma = mean|W|`, codes
# in {-1, 0, 1}, straight-through to f32 latents) is exported by one of three
# paths. The legacy path rounds the latents to bf16 first and requantizes, so a
# few codes near a rounding boundary flip; `direct_codes` serves the training
# quantizer's codes; `bf16_fixed_point` nudges bf16 values until the legacy
# quantizer gives the training codes back.

# %%
disagreement = {}
for path in TERNARY_PATHS:
    exporter = ternary(path)
    served, _ = exporter.apply(master, exporter.init(master))
    disagreement[path] = code_disagreement(master, served)
    total = np.mean(list(disagreement[path].values()))
    print(f"{path:20}: codes differing from training, mean over tensors {total:.3%}")

tensors = list(disagreement[TERNARY_PATHS[0]])
fig, ax = plt.subplots(figsize=(12, 3.8))
x = np.arange(len(tensors))
for i, path in enumerate(TERNARY_PATHS):
    ax.bar(x + 0.27 * (i - 1), [100 * disagreement[path][k] for k in tensors], 0.27, label=path)
ax.set(xticks=x, xlabel="exported tensor", ylabel="codes that differ (%)",
       title="Ternary export: code disagreement with the training quantizer")
ax.set_xticklabels([k.split("/")[-1] for k in tensors], rotation=30)
ax.legend(title="export path")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The seven sync checks catch an injected fault
#
# `run_sync_checks` compares what the exporter wrote with what the sampler
# holds: (1) layout, (2) byte hashes, (3) scales, (4) weights version and cache
# version, (5) tensors that are not quantized arrive bit-exact, (6) the codes
# are a fixed point of re-quantization, (7) on probe tokens the learner's and the
# sampler's forwards give the same log-probs (bit-equal for matched policies).
# We export the master as MXFP8, check a clean transfer, then inject one fault
# at a time.

# %%
exporter = quantize("mxfp8")
VERSION = 7
written, _ = exporter.apply(master, exporter.init(master), VERSION)
expected = expected_layout(exporter, master)
probe = np.random.default_rng(1).integers(1, cfg.vocab_size, (2, 12))


def transfer(tree):
    """What the sampler receives: a host round trip of every array."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)


def edit(tree, path, fn):
    """A copy of the served tree with the leaf at `path` replaced by `fn(leaf)`."""
    tree = jax.tree.map(lambda x: x, tree, is_leaf=lambda x: dataclasses.is_dataclass(x))
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = fn(node[path[-1]])
    return tree


def flip_bit(q):
    codes = np.asarray(q.codes).copy()
    codes.reshape(-1).view(np.uint8)[7] ^= 0x04
    return dataclasses.replace(q, codes=jnp.asarray(codes))


def set_scale(q, value):
    s = np.asarray(q.scales.astype(jnp.float32)).copy()
    s.reshape(-1)[3] = value
    return dataclasses.replace(q, scales=jnp.asarray(s).astype(q.scales.dtype))


def rescale(q, factor=4.0):  # same values, codes that are not what the quantizer gives
    return dataclasses.replace(q, codes=(q.codes.astype(jnp.float32) / factor).astype(q.codes.dtype),
                               scales=(q.scales.astype(jnp.float32) * factor).astype(q.scales.dtype))


def one_ulp(x):
    return x.at[3].set(jnp.nextafter(x[3], jnp.float32(2)))


# fault: (changes the sampler's copy, changes the exporter's output, sampler version, cache version, sampler policy)
FAULTS = {
    "clean": (None, None, VERSION, VERSION, "fp32"),
    "tensor dropped": (lambda t: edit(t, ("layers",), lambda d: {k: v for k, v in d.items() if k != "k_proj"}),
                       None, VERSION, VERSION, "fp32"),
    "payload bit flipped": (lambda t: edit(t, ("layers", "q_proj"), flip_bit), None, VERSION, VERSION, "fp32"),
    "NaN block scale": (lambda t: edit(t, ("layers", "up_proj"), lambda q: set_scale(q, np.nan)),
                        None, VERSION, VERSION, "fp32"),
    "stale weights": (None, None, VERSION - 1, VERSION - 1, "fp32"),
    "stale KV cache": (None, None, VERSION, VERSION - 1, "fp32"),
    "norm 1 ulp off": (lambda t: edit(t, ("final_norm",), one_ulp), None, VERSION, VERSION, "fp32"),
    "codes not canonical": (None, lambda t: edit(t, ("layers", "gate_proj"), rescale), VERSION, VERSION, "fp32"),
    "sampler runs bf16": (None, None, VERSION, VERSION, "bf16"),
}

outcome = {}
for fault, (held_fault, written_fault, version, cache_version, sampler_policy) in FAULTS.items():
    out = written_fault(written) if written_fault else written
    held = transfer(out)
    if held_fault:
        held = held_fault(held)
    sampler = SamplerState(held, version, cache_version, Policy.parse(sampler_policy))
    report = run_sync_checks(out, hash_served(out), sampler, expected, VERSION, master=master,
                             cfg=cfg, probe_tokens=probe, learner_policy=Policy.parse("fp32"))
    outcome[fault] = [r.passed for r in report.results]
    if fault == "clean":
        print(report, "\n")
        assert report.passed
    else:
        assert not report.passed, fault
        print(f"{fault}: caught by {', '.join(r.name for r in report.failures)}")
        print("   ", report.failures[0].details[:150])

# %%
grid = np.array([outcome[f] for f in FAULTS], float)
fig, ax = plt.subplots(figsize=(10, 4.6))
ax.imshow(grid, cmap=plt.matplotlib.colors.ListedColormap(["#d62728", "#2ca02c"]), vmin=0, vmax=1,
          aspect="auto")
ax.set(xticks=range(len(CHECK_NAMES)), yticks=range(len(FAULTS)), xlabel="sync check",
       ylabel="injected fault", title="Which check catches which fault (MXFP8 export)")
ax.set_xticklabels(CHECK_NAMES, rotation=30, ha="right")
ax.set_yticklabels(list(FAULTS))
ax.legend(handles=[Patch(color="#2ca02c", label="passed"), Patch(color="#d62728", label="failed")],
          loc="upper left", bbox_to_anchor=(1.01, 1))
fig.tight_layout()
plt.show()
