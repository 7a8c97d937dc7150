"""The exact replay: a rollout's log-probs recomputed by the executable that sampled it.

The learner needs the sampler's log-probs of the sampled tokens under weights
it names: the sampler's own weights (to verify a rollout, or to take its
recorded values), or later ones (each further update of a batch). A replay
that re-traces the sampler's steps into another program (a `lax.scan`
instead of the sampler's `while_loop`, other fusions, other batch shapes)
computes the same mathematics with other roundings: on a GPU such a replay
differs from the sampler by ~1e-6, and on any platform a slice of rows is a
program of another shape.

`replay_logprobs` does not re-trace anything. It calls `sampler_program`,
the jitted program `generate` ran, with the rollout's recorded tokens (and
a looped model's exit steps) forced, at the shape of the call that sampled
them, each row in the place it had in that call:

- the whole batch: the sampler's executable on the sampler's inputs; the
  log-probs are its bits by construction (with its weights and policy);
- a slice of rows (minibatches, micro-batches, a filtered refill), or rows
  gathered from several calls (`concat_rollouts`): per call, the missing
  rows are filled with a copy of a present one and the call's executable
  runs at its own shape. A row's values then depend on its own inputs
  alone, given that no operation reduces across rows (matmuls, norms,
  attention and the read-out reduce within a row; in deferred mode a row
  that has exited is frozen whatever the others do): the one assumption
  left, which the tests check against the whole batch bit for bit, the GPU
  tier on a GPU, and every run at its own shapes (`train.probe`).

A rollout records what that needs (`Rollout.calls`, `call_rows`,
`call_keys`; `generate` writes them); a rollout built by hand is replayed as
one call of its own shape. A speculative sampler's call runs its own program
(`rollout.speculative.speculative_program`) the same way: the recorded tokens,
verification counts and exit steps forced in place of the drafts (a speculative
rollout that records no calls re-traces its verification chunks,
`rollout.speculative.replay_speculative`).

The replay is a host-level call (it runs compiled programs, one per sampler
call); inside a traced function use `traced_replay_logprobs`, the same steps
traced into that program (the former construction: the sampler's bits only
where the compiler compiles the two programs alike).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.loop import MODEL_DEFAULT
from jaxrl_lp.numerics.invariant import invariant_forms, opaque_zero
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.parallel.context import use_mesh
from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules, param_shardings
from jaxrl_lp.parallel.shard import put_tree, to_host
from jaxrl_lp.rollout.generate import (
    Rollout,
    SamplerCall,
    call_inputs,
    one_device,
    program_for,
    tree_devices,
)
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.speculative import drafter_stand_in, replay_speculative, speculative_program
from jaxrl_lp.rollout.step import (
    LoopSpec,
    decode_step,
    fused_readout,
    prefill,
    step_logprobs,
    transposes,
)

__all__ = ["ReplayProgram", "prompt_positions", "replay_logprobs", "rollout_loop",
           "traced_replay_logprobs"]


def rollout_loop(ro: Rollout, cfg: ModelConfig, loop: LoopSpec | None = None) -> LoopSpec:
    """The loop spec to read `ro` with: its own, checked against `cfg` and an expected `loop`.

    Raises:
      ValueError: the rollout was sampled with another loop spec than `loop`
        (resolved against `cfg`), or is not one `cfg`'s model can replay.
    """
    spec = LoopSpec.parse(ro.loop)
    if spec.exit_rule == MODEL_DEFAULT:
        raise ValueError(f"rollout records an unresolved loop spec {spec}; a rollout from "
                         "`generate` records the rule it ran")
    try:
        own = spec.resolve(cfg)
    except ValueError as e:
        raise ValueError(f"rollout sampled with loop spec {spec} cannot be read by this "
                         f"model: {e}") from None
    if own != spec:
        raise ValueError(f"rollout sampled with loop spec {spec} cannot be read by this "
                         f"{'looped' if cfg.is_looped else 'dense'} model (it reads {own})")
    if loop is not None and LoopSpec.parse(loop).resolve(cfg) != own:
        raise ValueError(
            f"rollout was sampled with loop spec {own} but the learner was asked to compute "
            f"{LoopSpec.parse(loop).resolve(cfg)}; a rollout's log-probs are taken with the "
            "schedule it was sampled with: pass loop=None to read it from the rollout, or "
            "sample with the spec the learner expects")
    return own


def refuse_multiturn(ro: Rollout, where: str) -> None:
    """A multi-turn rollout (`Rollout.env_mask`) is replayed by its own programs; refused here
    with the function that replays it named."""
    if ro.env_mask is not None:
        raise ValueError(f"{where}: a multi-turn rollout (observations prefilled between "
                         "turns) is replayed by rollout.multiturn.replay_multiturn, not by the "
                         "single-turn sampler's program")


def prompt_positions(prompt_BxP: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Positions of left-padded prompts: -1 on padding, 0..n-1 on the n real tokens."""
    p = prompt_BxP.shape[1]
    pos = jnp.arange(p, dtype=jnp.int32)[None] - (p - lengths_B[:, None])
    return jnp.where(pos >= 0, pos, -1).astype(jnp.int32)


def traced_replay_logprobs(params: dict, cfg: ModelConfig, policy: Policy, ro: Rollout, *,
                           loop: LoopSpec | None = None) -> jax.Array:
    """The sampler's steps traced over the recorded tokens and schedule: [B, N].

    The traceable replay, for use inside another program (a gradient through
    it, the hybrid's value inside a step given none). It runs the sampler's
    `prefill` and `decode_step` in a `lax.scan`: a program of its own, so
    its values are the sampler's only where the compiler compiles both alike
    (on XLA:CPU at the sampler's batch shape; on a GPU they differ by ~1e-6).
    The exact replay is `replay_logprobs` (module docstring).

    A speculative rollout (`ro.verify_tokens > 0`) is replayed by
    `rollout.speculative.replay_speculative`: its recorded verification chunks,
    not one-token steps (not differentiable; use `hybrid` for gradients).
    Differentiable except in deferred mode (its early-stopping loop is a
    `while_loop`); use `hybrid` for gradients there.
    """
    refuse_multiturn(ro, "traced_replay_logprobs")
    policy = require(policy, "traced_replay_logprobs")
    loop = rollout_loop(ro, cfg, loop)
    if ro.verify_tokens:  # a speculative rollout: re-run its verification chunks
        return replay_speculative(params, cfg, policy, ro, loop)
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    # As the sampler (`generate`) decoded: the same copy of the weights, in its layout.
    params = unstack_layers(params, transpose=transposes(ro.decode_layout, ro.invariant_form),
                            policy=policy)
    cache = unstack_cache(init_cache(cfg, policy, b, p + n), cfg)
    positions = prompt_positions(ro.prompt_tokens, ro.prompt_lengths)
    fused = fused_readout(policy)  # the steps return what the sampler's did
    with invariant_forms(opaque_zero(ro.weights_version),  # the sampler's forms
                         ro.invariant_form if ro.decode_layout == "invariant" else None):
        return _traced_steps(params, cfg, policy, loop, ro, cache, positions, fused)


def _traced_steps(params, cfg, policy, loop, ro, cache, positions, fused):
    """`traced_replay_logprobs`' steps on the decode copy of the weights."""
    p, n = ro.prompt_tokens.shape[1], ro.completion_tokens.shape[1]
    out, cache, _, _ = prefill(params, cfg, policy, loop, ro.prompt_tokens, positions, cache,
                               readout_steps_B=ro.exit_steps[:, 0] if cfg.is_looped else None,
                               hidden=fused)
    lp0 = step_logprobs(params, cfg, policy, out, ro.completion_tokens[:, 0], ro.temperature)

    def body(cache, j):
        out, cache, _, _ = decode_step(
            params, cfg, policy, loop, ro.completion_tokens[:, j - 1],
            ro.prompt_lengths + j - 1, cache, p + j - 1,
            exit_steps_B=ro.exit_steps[:, j] if cfg.is_looped else None,
            active_B=ro.completion_mask[:, j] > 0, hidden=fused)  # as the sampler ran it
        return cache, step_logprobs(params, cfg, policy, out, ro.completion_tokens[:, j],
                                    ro.temperature)

    _, rest = jax.lax.scan(body, cache, jnp.arange(1, n, dtype=jnp.int32))
    return jnp.concatenate([lp0[:, None], rest.T], axis=1)


@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def _speculative(params, cfg, policy, ro, loop):
    return replay_speculative(params, cfg, policy, ro, loop)


def _calls(ro: Rollout, mesh: Mesh | None):
    """(calls, [B, 2] host (call, row) of each row, [C, ...] keys) of `ro`; a rollout without
    recorded calls is one call of its own shape on `mesh` (no EOS: every slot is decoded)."""
    if ro.call_rows is not None:
        return ro.calls, np.asarray(to_host(ro.call_rows)), ro.call_keys
    b, p = ro.prompt_tokens.shape
    call = SamplerCall(b, p, SamplingConfig(temperature=ro.temperature), None, 0, mesh=mesh)
    rows = np.stack([np.zeros(b, np.int32), np.arange(b, dtype=np.int32)], 1)
    return (call,), rows, jax.random.PRNGKey(0)[None]


def _placed(params, cfg: ModelConfig, call: SamplerCall, rules: ShardingRules):
    """`params` where `call` held its weights: sharded by the rules on its mesh, whole on its
    one device without one (a data-only sampler's replica; the learner may shard them)."""
    if call.mesh is None:
        devices = tree_devices(params)
        want = call.device or next(iter(devices), jax.devices()[0])
        return params if devices <= {want} else jax.device_put(params, want)
    if isinstance(params.get("layers"), tuple):  # unstacked by the caller: as they come
        return params
    return put_tree(params, param_shardings(params, cfg, call.mesh, rules))


def _refuse_traced(*trees) -> None:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees)):
        raise ValueError(
            "replay_logprobs reruns the sampler's compiled program and cannot be traced inside "
            "another jit: call it outside, or use traced_replay_logprobs (the same steps traced "
            "into your program; the sampler's bits only where the compiler compiles them "
            "alike)")


def replay_logprobs(params: dict, cfg: ModelConfig, policy: Policy, ro: Rollout, *,
                    loop: LoopSpec | None = None, mesh: Mesh | None = None,
                    rules: ShardingRules = DEFAULT_RULES) -> jax.Array:
    """Log-probs [B, N] of the rollout's tokens under `params`, by the sampler's own program.

    Runs `sampler_program` with the recorded tokens and exit steps forced,
    once per sampler call the rows came from, at that call's shape, each row
    in its place (module docstring). With the sampler's weights and policy
    (and mesh) the values are `ro.logprobs` bit for bit, for the whole batch
    and for any slice of it; under other weights or another policy they are
    the sampler's computation of those (the learner's replay under its
    weights, the mismatch under its policy). 0 off the completion mask (as
    the sampler records). Not differentiable and not traceable: it calls
    compiled programs (`traced_replay_logprobs` is the traceable form).

    Each call replays on the mesh it ran on (`SamplerCall.mesh`), the
    weights placed there as the sampler held them (a no-op where the sampler
    shares the learner's mesh; a copy to one device for a data-only sampler's
    replicas).

    Args:
      params: the weights to replay under, as the sampler takes them (stacked
        or unstacked in the rollout's decode layout).
      cfg: the model to replay with.
      policy: the numerics to replay with.
      ro: the rollout (`generate`'s, sliced, or concatenated).
      loop: the loop spec the caller expects the rollout to have, or None.
      mesh: the mesh of a rollout that records no calls (built by hand).
      rules: the sharding rules the calls ran under.

    Raises:
      ValueError: inside a trace, or a rollout of another loop spec than `loop`.

    Examples:
      >>> ro = generate(params, cfg, prompts, key=key, sampling=SamplingConfig())
      >>> lp = replay_logprobs(params, cfg, policy, take_rows(ro, np.arange(2)))
    """
    refuse_multiturn(ro, "replay_logprobs")
    policy = require(policy, "replay_logprobs")
    _refuse_traced(params, ro)
    loop = rollout_loop(ro, cfg, loop)
    if ro.verify_tokens and ro.call_rows is None:  # built by hand: its chunks, re-traced
        return _speculative(params, cfg, policy, ro, loop)
    b, n = ro.completion_tokens.shape
    calls, where, keys = _calls(ro, mesh)
    host = {f: np.asarray(to_host(getattr(ro, f))) for f in
            ("prompt_tokens", "prompt_lengths", "completion_tokens", "exit_steps",
             "verify_counts") if getattr(ro, f) is not None}
    version = int(np.asarray(to_host(ro.weights_version)).reshape(-1)[0])
    out = None
    for c, call in enumerate(calls):
        mine = np.flatnonzero(where[:, 0] == c)
        if not mine.size:
            continue
        at = where[mine, 1]
        src = np.full(call.rows, mine[0])  # rows of the call not in `ro`: a copy of one that is
        src[at] = mine
        prompts = host["prompt_tokens"][src][:, host["prompt_tokens"].shape[1] - call.prompt_width:]
        lengths = host["prompt_lengths"][src]
        positions = np.arange(call.prompt_width, dtype=np.int32)[None] - (
            call.prompt_width - lengths[:, None])
        positions = np.where(positions >= 0, positions, -1).astype(np.int32)
        held = _placed(params, cfg, call, rules)
        device = None if call.mesh else one_device(held)
        counts = host["verify_counts"][src] if call.speculative else None
        args = call_inputs(prompts, positions, lengths, keys[c], version,
                           host["completion_tokens"][src], host["exit_steps"][src], True,
                           call.mesh, rules, device, counts)
        kw = dict(cfg=cfg, policy=policy, loop=loop, sampling=call.sampling, max_new_tokens=n,
                  eos_id=call.eos_id, pad_id=call.pad_id, layout=ro.decode_layout)
        if call.speculative:
            spec = call.speculative
            lp = speculative_program(held, drafter_stand_in(spec, device), *args,
                                     dcfg=spec.drafter_cfg, spec=spec.spec, **kw)[0].logprobs
        else:
            lp = program_for(ro.decode_layout)(held, *args, mesh=call.mesh, rules=rules,
                                               record=call.record, form=ro.invariant_form,
                                               **kw).logprobs
        if len(calls) == 1 and call.rows == b and (at == np.arange(b)).all():
            # The whole call, in its order, placed as the rollout's rows are (a sampler of its
            # own ran it on its devices).
            want = getattr(ro.logprobs, "sharding", None)
            return lp if want is None or lp.sharding == want else jax.device_put(lp, want)
        # Calls may have run on other devices (a sampler's replicas): rows gathered on the host.
        out = np.zeros((b, n), np.float32) if out is None else out
        out[mine] = np.asarray(to_host(lp))[at]
    return jnp.asarray(out)


class ReplayProgram:
    """`fn(params, rollout) -> log-probs [B, N]`: `replay_logprobs` with fixed model and numerics.

    What `rl.logprob_programs.jit_learner_logprobs` returns for `replay` and `hybrid`
    (the hybrid's value is the replay's). Not jitted itself: each call runs
    the sampler's compiled program (`replay_logprobs`). `trace` and `lower`
    give the traced replay of the same steps at the rollout's shape (abstract
    rollouts too): the planner's cost model and the lowering checks.
    """

    packs = False

    def __init__(self, cfg: ModelConfig, policy: Policy, *, loop: LoopSpec | None = None,
                 mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES):
        self.cfg, self.policy, self.loop, self.mesh, self.rules = cfg, policy, loop, mesh, rules

    def __call__(self, params, ro: Rollout) -> jax.Array:
        refuse_multiturn(ro, "ReplayProgram")
        return replay_logprobs(params, self.cfg, self.policy, ro, loop=self.loop, mesh=self.mesh,
                               rules=self.rules)

    def _traced(self):
        def fn(params, ro):
            with use_mesh(self.mesh, self.rules):
                return traced_replay_logprobs(params, self.cfg, self.policy, ro, loop=self.loop)
        return jax.jit(fn)

    def trace(self, params, ro: Rollout):
        """`jax.jit(...).trace` of the traced replay at `ro`'s shape (arrays or abstract): the
        same steps as the sampler's program with known trip counts, for the planner's cost
        walk and the lowering checks. A call runs the sampler's program itself."""
        return self._traced().trace(params, ro)

    def lower(self, params, ro: Rollout):
        """`jax.jit(...).lower` of the traced replay at `ro`'s shape (`trace`)."""
        return self._traced().lower(params, ro)
