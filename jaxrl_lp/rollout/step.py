"""The two forward computations a rollout is made of: prefill and one decode step.

The sampler runs them inside its `while_loop`; the learner's `replay` log-probs
run the *same* functions over the recorded tokens and schedule, which is what
makes the two agree bit for bit. Do not re-derive them elsewhere.

Neither is jitted itself: both are traced inside `generate`'s and the
learner's jitted programs, where `cfg`, `policy` and `loop` are static.

The sampled tokens' log-probs come from a step's output by `step_logprobs`,
which the sampler and the replay both call: `token_logprobs` of the step's
logits, on every platform. Where the policy lets the fused log-prob kernel run
(`kernels.logprob.fused_readout`) the steps return the final hidden state and
the logits are `step_logits` of it; elsewhere the steps return the logits.
The sampler needs a step's `[B, V]` logits to choose its token anyway, so the
fused kernel (`kernels.readout_logprobs`) would only read the lm head a second
time: it serves the learner's dense read-out and the SFT loss, where it saves
the `[B, N, V]` logits (docs/design/kernels.md, "Kernels on GPU and TPU").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.kernels.fake_quant import INVARIANT_FORMATS
from jaxrl_lp.kernels.logprob import fused_readout
from jaxrl_lp.models.blocks import lm_logits
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.layers import TransposedWeight
from jaxrl_lp.models.loop import ExitSchedule, LoopSpec
from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics import invariant
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.sampling import token_logprobs

__all__ = ["DECODE_LAYOUTS", "LoopSpec", "cpu_layout", "decode_layout", "decode_step",
           "fused_readout", "prefill", "step_logits", "step_logprobs", "transposes"]

# How the sampler's decode copy of the weights is laid out (`Rollout.decode_layout`):
# `as_stored` slices the stacked layers; `transposed` copies the plain matmul weights and
# the lm head `[out, in]` (`models.blocks.unstack_layers(transpose=True)`); `invariant` takes
# the batch-invariant forms (`numerics.invariant`: the sampler's program traced inside
# `invariant_forms`, compiled with its options) on `transposed`'s copy where its form reads
# the weights `[out, in]` (`InvariantForm.columns`), else on `as_stored`'s, and the learner's
# parallel forward reproduces it bit for bit (`rl.logprobs`' `invariant` method).
DECODE_LAYOUTS = ("as_stored", "transposed", "invariant")


def transposes(layout: str, form: invariant.InvariantForm | None) -> bool:
    """Whether a decode in `layout` (and, for `invariant`, its `form`) reads the `[out, in]`
    copy of the matmul weights (`unstack_layers(transpose=True)`)."""
    return layout == "transposed" or (layout == "invariant" and form is not None
                                      and form.columns is not None)


def decode_layout(params, policy: Policy, mesh=None, layout: str | None = None,
                  form: invariant.InvariantForm | None = None) -> str:
    """The decode layout a sampler uses for `params` (`layout` given: that one, checked).

    `transposed` where the weights live on CPU devices, one device (no mesh)
    and the policy has no `matmul_format` (docs/design/hot_path.md, "The decode's
    weights"), on a CPU whose weights-major products run in narrow column tiles
    (`cpu_layout`): XLA:CPU streams an `[out, in]` weight at a few rows faster there;
    where the tile is wide the stored weights are the faster.
    Elsewhere `as_stored`: GPU and TPU multiply the stored weights at full
    speed, a mesh's rules name the stored axes, and the MX formats quantize
    along the stored contraction axis. Params unstacked by the caller keep
    the layout they were unstacked in. The platform is the one the weights
    are committed to, which is the one the sampler's program is compiled
    for; abstract or traced weights (`jax.ShapeDtypeStruct`, inside another
    jit) take `as_stored` unless `layout` says otherwise.

    `invariant` (asked for, never picked) takes the batch-invariant forms
    (`numerics.invariant`) on the copy its form reads (`transposes`); it is refused where those are not proven
    (`invariant.unsupported`: another platform than CPU, a mesh), except in a `form` whose
    products are fixed tiles (`InvariantForm.tiles`), asked for by name.

    Raises:
      ValueError: an unknown `layout`, or `transposed` / `invariant` where it cannot apply.
    """
    layers = params["layers"]
    if isinstance(layers, tuple):  # unstacked by the caller
        leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, TransposedWeight))
        found = ("transposed" if any(isinstance(x, TransposedWeight) for x in leaves)
                 else "as_stored")
        if layout == "invariant" and found == ("transposed" if transposes(
                layout, form if form is not None else invariant.form_for(0)) else "as_stored"):
            return layout  # the copy this CPU's invariant form reads
        if layout is not None and layout != found:
            raise ValueError(f"decode_layout: params unstacked as {found!r}, asked for "
                             f"{layout!r}; pass the stacked params")
        return found
    if layout is not None:
        if layout not in DECODE_LAYOUTS:
            raise ValueError(f"decode_layout: {layout!r} is not one of {DECODE_LAYOUTS}")
        fmt = policy.matmul_format
        if layout != "as_stored" and (mesh is not None or fmt is not None and not (
                layout == "invariant" and fmt in INVARIANT_FORMATS)):
            raise ValueError(f"decode_layout: {layout!r} is for one device and plain "
                             "matmuls (no mesh, no matmul_format"
                             + (f"; invariant takes {', '.join(INVARIANT_FORMATS)}"
                                if layout == "invariant" else "") + ")")
        if layout == "invariant":
            leaf = next((x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)
                         and not isinstance(x, jax.core.Tracer)), None)
            platform = None if leaf is None else next(iter(leaf.devices())).platform
            if (why := invariant.unsupported(platform or "cpu", mesh, form)) is not None:
                raise ValueError(f"decode_layout: 'invariant': {why}")
        return layout
    if mesh is not None or policy.matmul_format is not None:
        return "as_stored"
    leaf = next((x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)), None)
    if leaf is None or isinstance(leaf, jax.core.Tracer):
        return "as_stored"
    return cpu_layout() if {d.platform for d in leaf.devices()} == {"cpu"} else "as_stored"


def cpu_layout() -> str:
    """The decode layout of plain weights on this CPU: `transposed` where its weights-major
    products run in column tiles of at most `invariant.MAX_COLUMN_TILE` (the probe of
    `invariant.column_tile`; a decode's few rows then fill a tile), `as_stored` where the
    tile is wider (docs/design/hot_path.md, "The decode's weights", races both by CPU).
    `transposed` where no tile holds or JAX's backend is not the CPU (nothing to probe)."""
    if jax.default_backend() != "cpu":
        return "transposed"
    tile = invariant.column_tile()
    return "as_stored" if tile is not None and tile > invariant.MAX_COLUMN_TILE else "transposed"


def step_logits(params, cfg: ModelConfig, policy: Policy, out_BxX) -> jax.Array:
    """The logits [B, V] (or [B, T, V]) of a step's output: the lm head applied when it is
    the hidden state, to `[B, 1, D]` rows as the forward applies it (so XLA compiles the same
    product: on CPU a `[B, D]` one read the f32 head every step instead of its bf16 copy)."""
    if not fused_readout(policy):
        return out_BxX
    if out_BxX.ndim == 2:
        return lm_logits(params, out_BxX[:, None], cfg, policy)[:, 0]
    return lm_logits(params, out_BxX, cfg, policy)


def step_logprobs(params, cfg: ModelConfig, policy: Policy, out_BxX, tokens_B,
                  temperature: float, logits_BxV: jax.Array | None = None) -> jax.Array:
    """Log-probs [B] f32 of `tokens_B` from a step's output (the sampler's and the replay's).

    `out_BxX` is what `prefill` / `decode_step` returned with
    `hidden=fused_readout(policy)`; the log-probs are `token_logprobs` of its
    logits: `logits_BxV` (the ones the sampler sampled from), else
    `step_logits` of it, computed here on the same shapes.
    """
    if logits_BxV is None:
        logits_BxV = step_logits(params, cfg, policy, out_BxX)
    return token_logprobs(logits_BxV, tokens_B, temperature)


def prefill(params, cfg: ModelConfig, policy: Policy, loop: LoopSpec, prompt_BxP, positions_BxP,
            cache, readout_steps_B=None, *, forced_B=None, hidden: bool = False,
            tape: dict | None = None, index=0):
    """Runs the (left-padded) prompts through the model at full depth, writing slots [0, P).

    `index` (an int or an int32 scalar) moves the chunk to slots [index, index + P): a
    multi-turn episode's observations are prefilled on the cache that holds its context
    (`rollout.multiturn`).

    Returns (logits [B, V] at the last slot, cache, exit step [B] of the last
    slot, loop evaluations). `readout_steps_B` replays a recorded read-out step
    (with `forced_B`, bool [B]: on those rows only; the rule reads out the others).
    With `hidden` the first output is the final hidden state [B, D] instead.
    `tape` receives a dense model's weight products (`models.dense_forward`).
    """
    if not cfg.is_looped:
        logits, cache, _ = forward(params, cfg, policy, prompt_BxP, positions_BxP, cache, index,
                                   hidden=hidden, tape=tape)
        return logits[:, -1], cache, jnp.zeros(prompt_BxP.shape[:1], jnp.int32), jnp.int32(1)
    if tape is not None:
        raise ValueError("prefill: tape (recorded weight products) is for dense models")
    schedule = None
    grid = lambda x_B: None if x_B is None else jnp.broadcast_to(x_B[:, None], prompt_BxP.shape)
    if readout_steps_B is not None:
        schedule = ExitSchedule(readout_BxT=grid(readout_steps_B), forced_BxT=grid(forced_B))
    # A prompt runs at full depth in either compute mode; the rule picks its read-out.
    logits, cache, out = forward(params, cfg, policy, prompt_BxP, positions_BxP, cache, index,
                                 loop=LoopSpec(loop.exit_rule, "dense"), schedule=schedule,
                                 hidden=hidden)
    exits = out.exit_steps[:, -1]
    if readout_steps_B is not None:
        exits = readout_steps_B if forced_B is None else jnp.where(forced_B, readout_steps_B,
                                                                   exits)
    return logits[:, -1], cache, exits, out.loop_evals


def decode_step(params, cfg: ModelConfig, policy: Policy, loop: LoopSpec, tokens_B, positions_B,
                cache, index, exit_steps_B=None, active_B=None, *, forced_B=None,
                hidden: bool = False, tape: dict | None = None):
    """One token per sequence at cache slot `index`.

    Returns (logits [B, V] or, with `hidden`, the final hidden state [B, D],
    cache, exit step [B], loop evaluations). With
    `exit_steps_B` the recorded schedule is replayed instead of the exit rule
    (with `forced_B`, bool [B]: on those rows only).
    `active_B` (bool) marks the sequences still generating: in deferred mode
    the others are not computed (their outputs are meaningless) and do not
    keep the loop over steps running. `tape` receives a dense model's weight
    products (`models.dense_forward`).
    """
    if not cfg.is_looped:
        logits, cache, _ = forward(params, cfg, policy, tokens_B[:, None], positions_B[:, None],
                                   cache, index, hidden=hidden, tape=tape)
        return logits[:, 0], cache, jnp.zeros(tokens_B.shape, jnp.int32), jnp.int32(1)
    if tape is not None:
        raise ValueError("decode_step: tape (recorded weight products) is for dense models")
    column = lambda x_B: None if x_B is None else x_B[:, None]
    schedule = ExitSchedule(depth_BxT=column(exit_steps_B), active_BxT=column(active_B),
                            forced_BxT=None if exit_steps_B is None else column(forced_B))
    logits, cache, out = forward(params, cfg, policy, tokens_B[:, None], positions_B[:, None],
                                 cache, index, loop=loop, schedule=schedule,
                                 early_stop=loop.compute_mode == "deferred", hidden=hidden)
    return logits[:, 0], cache, out.exit_steps[:, 0], out.loop_evals
