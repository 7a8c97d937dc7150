"""Speculative rollouts: draft k tokens, verify them in one target forward, accept exactly.

Each iteration of the jitted `while_loop` (state `_SpecState`):

1. The drafter (`rollout.drafter`: the looped target at fewer loop steps, or a
   small dense model with a bounded, re-based cache) proposes k tokens
   d_1..d_k after each row's last committed token x, with distributions q_i.
2. One target forward over the chunk [x, d_1, ..., d_k] (k + 1 tokens, written
   into the target's KV cache at the row's own slots) gives the target's
   distributions p_0..p_k.
3. Acceptance (Leviathan et al. / Chen et al.): d_i is accepted with
   probability min(1, p_{i-1}(d_i) / q_i(d_i)) while all before it were; at
   the first rejection a token is drawn from the residual
   `norm(max(p - q, 0))`, and when all k are accepted a bonus token from p_k.
   Every emitted token is then distributed exactly as the target's sampler
   would draw it (p is the filtered, tempered distribution `sample_tokens`
   draws from). Greedy mode drafts argmaxes and accepts the longest prefix
   that equals the target's argmaxes, then emits the target's argmax.
4. The row commits a + 1 tokens (fewer at EOS or the token budget); rows
   commit different counts and so write their next chunks at different cache
   slots (`rollout.rows.rowwise_forward`).

Design decisions:
- Cache layout: row b's completion token j sits at slot P + j - 1 when fed,
  as in plain decoding, so a slot's position is fixed per row; a chunk's
  rejected tail holds K/V at positions above every later query until it is
  overwritten (the next chunk starts at the first of those slots), so it is
  never read by a committed token. Cache length P + N + k.
- Log-probs: the target's (`step_logprobs` of the verification chunk at the
  emitted token, f32 after temperature, unfiltered), as plain sampling records.
- Exactness record: the rollout carries `verify_tokens` (k + 1, static),
  `verify_counts` [B, N] (tokens each row committed at each iteration) and
  its sampler call (`SamplerCall.speculative`). The learner's replay
  (`rollout.replay`) runs the sampler's own compiled program
  (`speculative_program`) with the recorded tokens, counts and exit steps
  forced in place of the drafts, at the call's batch shape with each row
  in its place: the same prefill and the same chunk forwards at the same
  slots. Inputs at the rejected positions differ (the drafts are not
  recorded) but a committed token's output never reads them (causal by
  position; a masked slot's softmax weight is exactly 0), so replay ==
  sampler bit for bit, for the whole batch and any slice of it.
- Looped targets run in `dense` compute mode (every loop step); a deferred
  speculative rollout is refused.
- Sharding: the speculative sampler runs without a mesh (a clear error).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.fingerprint import tree_fingerprint
from jaxrl_lp.numerics.policy import FP32, Policy, require
from jaxrl_lp.rollout.drafter import DraftState, draft, init_draft, sampling_probs
from jaxrl_lp.rollout.generate import Forced, Rollout, SamplerCall, call_inputs, one_device
from jaxrl_lp.rollout.request import check_request
from jaxrl_lp.rollout.rollout import SpecCall
from jaxrl_lp.rollout.rows import put_chunk, rowwise_forward, take_chunk
from jaxrl_lp.rollout.sampling import (
    SamplingConfig,
    choose_tokens,
    first_argmax,
    gumbel_max,
    token_logprobs,
)
from jaxrl_lp.rollout.sampling import _filter as filter_logits  # the sampler's own filter
from jaxrl_lp.rollout.spec_config import SpecConfig
from jaxrl_lp.rollout.step import (
    LoopSpec,
    decode_layout,
    fused_readout,
    prefill,
    step_logits,
    step_logprobs,
)

__all__ = ["SpecConfig", "SpecStats", "accept_drafts", "chunk_logprobs", "drafter_cache_bytes",
           "drafter_stand_in", "load_drafter", "replay_speculative", "spec_call",
           "speculative_generate", "speculative_program"]


class SpecStats(NamedTuple):
    """Counters of one speculative rollout (scalars)."""

    iterations: jax.Array  # [] int32 verification forwards (after the prefill)
    proposed: jax.Array  # [] int32 drafted tokens of live rows
    accepted: jax.Array  # [] int32 of them accepted
    committed: jax.Array  # [] int32 tokens committed by verifications (all rows)
    draft_steps: jax.Array  # [] int32 drafter token steps
    max_draft_position: jax.Array  # [] int32 largest position the drafter was fed

    @property
    def acceptance_rate(self) -> float:
        return float(self.accepted) / max(float(self.proposed), 1.0)

    def tokens_per_target_forward(self, rows: int) -> float:
        """Tokens committed per row per verification forward (plain decoding: 1)."""
        return float(self.committed) / max(float(self.iterations) * rows, 1.0)


class _SpecState(NamedTuple):
    """The speculative `while_loop` state (B rows, N new tokens at most, k drafts)."""

    it: jax.Array  # [] int32 verification iteration
    n: jax.Array  # [B] int32 tokens committed so far (>= 1: the prefill's)
    done: jax.Array  # [B] bool the row produced EOS or N tokens
    cache: dict  # the target's KV cache, P + N + k slots
    draft: DraftState  # the drafter's cache and counters
    key: jax.Array  # the sampling PRNG key
    loop_evals: jax.Array  # [] int32 target loop-step evaluations of the verifications
    seq: jax.Array  # [B, P + N + k + 1] int32 prompt then committed tokens (slack after)
    logprobs: jax.Array  # [B, N + k + 1] f32 target log-probs of committed tokens
    exit_steps: jax.Array  # [B, N + k + 1] int32 exit step of the forward that produced each
    counts: jax.Array  # [B, N] int32 tokens committed per row at each iteration
    proposed: jax.Array  # [] int32 drafted tokens of live rows
    accepted: jax.Array  # [] int32 accepted drafts of live rows


def chunk_logprobs(params, cfg: ModelConfig, policy: Policy, out_BxTxX, tokens_BxT,
                   temperature: float, logits_BxTxV: jax.Array | None = None) -> jax.Array:
    """`step_logprobs` of every position of a chunk's output: [B, T] f32 (sampler and replay).

    `logits_BxTxV` are the chunk's `step_logits` (the sampler passes the ones it
    accepted drafts by; computed here, on the same [B, T] shape, when not given).
    """
    b, t = tokens_BxT.shape
    if logits_BxTxV is None:
        logits_BxTxV = step_logits(params, cfg, policy, out_BxTxX)
    flat = lambda x: x.reshape(b * t, x.shape[-1])
    return step_logprobs(params, cfg, policy, flat(out_BxTxX), tokens_BxT.reshape(-1), temperature,
                         flat(logits_BxTxV)).reshape(b, t)


def accept_drafts(drafts_BxK, q_BxKxV, logits_BxK1xV, key, sampling: SamplingConfig):
    """The rejection rule: returns (accepted drafts a [B] int32, emitted tokens [B, k + 1]).

    Emitted token t < a is draft t + 1; token a is the residual sample (or the
    bonus from p_k when a == k); tokens after a are meaningless.
    """
    b, k = drafts_BxK.shape
    if sampling.greedy:
        fix = first_argmax(logits_BxK1xV, axis=-1)
        ok = drafts_BxK == fix[:, :k]
    else:
        v = logits_BxK1xV.shape[-1]
        p = sampling_probs(logits_BxK1xV.reshape(b * (k + 1), v), sampling).reshape(b, k + 1, v)
        ku, kr, kb = jax.random.split(key, 3)
        pd = jnp.take_along_axis(p[:, :k], drafts_BxK[..., None], axis=-1)[..., 0]
        qd = jnp.take_along_axis(q_BxKxV, drafts_BxK[..., None], axis=-1)[..., 0]
        ok = jax.random.uniform(ku, (b, k)) * qd < pd  # u < p/q, without dividing
        resid = jnp.maximum(p[:, :k] - q_BxKxV, 0.0)
        # p == q leaves no residual (and no rejection can have happened): fall back to p.
        some = jnp.sum(resid, axis=-1, keepdims=True) > 0
        fix_k = gumbel_max(kr, jnp.log(jnp.where(some, resid, p[:, :k])))
        scaled = filter_logits(logits_BxK1xV[:, k].astype(jnp.float32) / sampling.temperature,
                               sampling)
        bonus = gumbel_max(kb, scaled)
        fix = jnp.concatenate([fix_k, bonus[:, None]], axis=1).astype(jnp.int32)
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    t = jnp.arange(k + 1)[None]
    drafts = jnp.concatenate([drafts_BxK, jnp.zeros((b, 1), jnp.int32)], axis=1)
    fix_a = jnp.take_along_axis(fix, a[:, None], axis=1)
    return a, jnp.where(t < a[:, None], drafts, fix_a)


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "spec", "policy", "loop", "sampling",
                                             "max_new_tokens", "eos_id", "pad_id", "layout"))
def speculative_program(params, dparams, prompt_BxP, positions_BxP, lengths_B, key, version,
                        forced: Forced | None, *, cfg, dcfg, spec, policy, loop, sampling,
                        max_new_tokens, eos_id, pad_id, layout):
    """The speculative sampler's compiled program: samples (`forced.on` False) or replays (True).

    Jitted. Static: the configs, `spec`, `policy`, `loop`, `sampling`,
    `max_new_tokens`, `eos_id`, `pad_id`, `layout` (the decode layout of the
    target's and the drafter's weights, `rollout.step.decode_layout`) and the
    prompt shapes. Nothing donated. Returns (`Rollout`, `SpecStats`).

    As `generate.sampler_program` for the plain sampler: `forced.on` is traced,
    so sampling and its replay are one executable. Replaying, the program
    takes the recorded tokens as each verification chunk (the committed
    tokens after the row's last one, in place of the drafts), the recorded
    counts as what each row commits, and a looped target's recorded exit
    steps. The drafter still runs (its drafts unused; the verification
    rewrites every cache slot a self-drafter wrote), so a dense drafter's
    weights may be zeros of their shapes (`drafter_stand_in`). `forced=None`
    compiles the sampler without that input. Called by
    `speculative_generate`, `rollout.replay` and `bench speculative`.
    """
    b, p = prompt_BxP.shape
    n, k = max_new_tokens, spec.k
    transpose = layout == "transposed"
    params = unstack_layers(params, transpose=transpose, policy=policy)
    dparams = None if dparams is None else unstack_layers(dparams, transpose=transpose,
                                                                 policy=policy)
    cache = unstack_cache(init_cache(cfg, policy, b, p + n + k), cfg)
    fused = fused_readout(policy)
    # What the replay takes, laid out as the sampler's `seq` and `exit_steps` (k + 1 slack).
    takes = forced is not None
    force_B = jnp.broadcast_to(forced.on, (b,)) if takes and cfg.is_looped else None
    if takes:
        recorded = jnp.concatenate([forced.tokens_BxN, jnp.zeros((b, k + 1), jnp.int32)], axis=1)
        depth = jnp.concatenate([forced.exit_steps_BxN,
                                 jnp.full((b, k + 1), cfg.loop_steps - 1, jnp.int32)], axis=1)
    out, cache, exit0, _ = prefill(
        params, cfg, policy, loop, prompt_BxP, positions_BxP, cache,
        forced.exit_steps_BxN[:, 0] if force_B is not None else None, forced_B=force_B,
        hidden=fused)
    key, sub = jax.random.split(key)
    logits0 = step_logits(params, cfg, policy, out)
    tok = choose_tokens(logits0, sub, sampling)
    if takes:
        tok = jnp.where(forced.on, forced.tokens_BxN[:, 0], tok)
    lp = token_logprobs(logits0, tok, sampling.temperature)
    t_k1 = jnp.arange(k + 1)[None]
    evals = cfg.loop_steps  # a dense-mode verification runs every loop step

    def cond(s: _SpecState):
        return (s.it < n - 1) & ~jnp.all(s.done)

    def body(s: _SpecState):
        if sampling.greedy:  # no draws: the key is carried unused
            key, kd, ka = s.key, None, None
        else:
            key, kd, ka = jax.random.split(s.key, 3)
        slot = p + s.n - 1  # the last committed token's slot (and its index in `seq`)
        last = take_chunk(s.seq, slot, 1)[:, 0]
        prev = take_chunk(s.seq, slot - 1, 1)[:, 0]
        pos = lengths_B + s.n - 1

        # Replaying, the drafter runs as it did and the recorded tokens replace its drafts (a
        # `lax.cond` skipping it slowed the sampler: docs/design/replay.md).
        drafts, q, cache, dstate = draft(spec, s.draft, params, cfg, dparams, dcfg, policy,
                                         sampling, s.cache, last, prev, pos, slot, kd)
        if takes:
            drafts = jnp.where(forced.on, take_chunk(recorded, s.n, k), drafts)
        chunk = jnp.concatenate([last[:, None], drafts], axis=1)
        out, cache, exits = rowwise_forward(
            params, cfg, policy, chunk, pos[:, None] + t_k1, cache, slot, loop=loop,
            depth_BxT=take_chunk(depth, s.n, k + 1) if force_B is not None else None,
            forced_B=force_B, hidden=fused)
        logits = step_logits(params, cfg, policy, out)
        a, emitted = accept_drafts(drafts, q, logits, ka, sampling)
        if takes:
            emitted = jnp.where(forced.on, take_chunk(recorded, s.n, k + 1), emitted)
        lps = chunk_logprobs(params, cfg, policy, out, emitted, sampling.temperature, logits)
        count = a + 1
        hit = jnp.zeros((b, k + 1), bool) if eos_id is None else (emitted == eos_id) & (t_k1 < count[:, None])
        count = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, count)
        count = jnp.where(s.done, 0, jnp.minimum(count, n - s.n)).astype(jnp.int32)
        if takes:
            count = jnp.where(forced.on, forced.counts_BxN[:, s.it], count)
        hit = hit & (t_k1 < count[:, None])
        live = ~s.done
        new_n = s.n + count
        return _SpecState(
            it=s.it + 1, n=new_n, done=s.done | jnp.any(hit, axis=1) | (new_n >= n),
            cache=cache, draft=dstate._replace(need_prev=a == k), key=key,
            loop_evals=s.loop_evals + evals,
            seq=put_chunk(s.seq, emitted, p + s.n),
            logprobs=put_chunk(s.logprobs, lps, s.n),
            exit_steps=put_chunk(s.exit_steps, exits, s.n),
            counts=jax.lax.dynamic_update_slice(s.counts, count[:, None], (jnp.int32(0), s.it)),
            proposed=s.proposed + k * jnp.sum(live).astype(jnp.int32),
            accepted=s.accepted + jnp.sum(jnp.where(live, a, 0)).astype(jnp.int32))

    width = n + k + 1
    seq = jnp.full((b, p + width), pad_id, jnp.int32).at[:, :p].set(prompt_BxP).at[:, p].set(tok)
    state = _SpecState(
        it=jnp.int32(0), n=jnp.ones((b,), jnp.int32),
        done=jnp.full((b,), n <= 1) if eos_id is None else (tok == eos_id) | (n <= 1),
        cache=cache, draft=init_draft(spec, dparams, dcfg, policy, prompt_BxP, lengths_B, pad_id),
        key=key, loop_evals=jnp.int32(0), seq=seq,
        logprobs=jnp.zeros((b, width), jnp.float32).at[:, 0].set(lp),
        exit_steps=jnp.zeros((b, width), jnp.int32).at[:, 0].set(exit0),
        counts=jnp.zeros((b, n), jnp.int32), proposed=jnp.int32(0), accepted=jnp.int32(0))
    s = jax.lax.while_loop(cond, body, state)
    mask = jnp.arange(n)[None] < s.n[:, None]
    ro = Rollout(
        prompt_tokens=prompt_BxP, prompt_lengths=lengths_B,
        completion_tokens=jnp.where(mask, s.seq[:, p:p + n], pad_id),
        completion_mask=mask.astype(jnp.float32),
        logprobs=jnp.where(mask, s.logprobs[:, :n], 0.0),
        exit_steps=jnp.where(mask, s.exit_steps[:, :n], 0),
        loop_evals=s.loop_evals, weights_version=jnp.asarray(version, jnp.int32),
        policy=policy, loop=loop, temperature=sampling.temperature,
        verify_counts=s.counts, verify_tokens=k + 1, decode_layout=layout,
        call_rows=jnp.stack([jnp.zeros((b,), jnp.int32), jnp.arange(b, dtype=jnp.int32)], 1))
    stats = SpecStats(iterations=s.it, proposed=s.proposed, accepted=s.accepted,
                      committed=jnp.sum(s.counts), draft_steps=s.draft.steps,
                      max_draft_position=s.draft.max_pos)
    return ro, stats


def drafter_stand_in(call: SpecCall, device: jax.Device | None):
    """Zeros of a call's dense drafter's weights (None for self-speculation), on `device`,
    committed as `speculative_generate` holds the real ones: what the replay passes to
    `speculative_program`, whose drafts it replaces with the recorded tokens."""
    if call.drafter_tree is None:
        return None
    device = device or jax.devices()[0]
    leaves = [jnp.zeros(shape, dtype, device=device) for shape, dtype in call.drafter_leaves]
    return jax.tree_util.tree_unflatten(call.drafter_tree, leaves)


def drafter_cache_bytes(spec: SpecConfig, drafter_cfg: ModelConfig | None, policy: Policy,
                        batch: int) -> int:
    """Bytes of the drafter's own KV cache (0 for self-speculation, which shares the target's).

    It depends on `sink + window`, never on the context length.
    """
    if spec.drafter == "self":
        return 0
    shapes = jax.eval_shape(lambda: init_cache(drafter_cfg, policy, batch,
                                               spec.sink + spec.window))
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes)))


@functools.cache
def load_drafter(path: str) -> tuple[dict, ModelConfig]:
    """A dense drafter's (params, config) from a Hugging Face safetensors directory (cached)."""
    from jaxrl_lp.models.hf_io import load_hf_params, read_hf_config

    cfg = read_hf_config(path)
    return load_hf_params(path, cfg), cfg


def speculative_generate(
    params: dict,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    spec: SpecConfig | str,
    *,
    drafter: tuple[dict, ModelConfig] | None = None,
    policy: Policy = FP32,
    sampling: SamplingConfig = SamplingConfig(greedy=True),
    max_new_tokens: int = 32,
    num_samples: int = 1,
    eos_id: int | None = None,
    pad_id: int = 0,
    loop: LoopSpec = LoopSpec(),
    key: jax.Array | None = None,
    weights_version: int = 0,
    mesh=None,
    with_stats: bool = False,
):
    """`generate`, by speculative decoding: the same `Rollout` (target log-probs), fewer target steps.

    The sampled tokens are distributed exactly as `generate`'s (greedy: the
    same tokens up to the rounding of a chunk forward against a one-token
    step). The rollout records its verification chunks for the learner's replay.

    `params`, `cfg`, `prompts`, `policy`, `sampling`, `max_new_tokens`,
    `num_samples`, `eos_id`, `pad_id`, `loop`, `key` and `weights_version` are
    as in `generate`.

    Args:
      spec: the drafter and k (`SpecConfig` or its string, e.g. `self:loops=1,k=4`).
      drafter: (params, config) of a dense drafter (`spec.drafter == "dense"`).
      mesh (Mesh | None): must be None (the speculative sampler runs unsharded).
      with_stats: also return the `SpecStats`.

    Returns:
      (Rollout | tuple[Rollout, SpecStats]): A `Rollout`, or (`Rollout`,
        `SpecStats`) with `with_stats`.

    Raises:
      ValueError: a bad request, as `generate` (`rollout.request.check_request`);
        a missing or mismatched spec or drafter; a mesh; a deferred loop spec.

    Examples:
      >>> ro = speculative_generate(params, cfg, [[1, 2, 3]], "self:loops=1,k=4")
    """
    spec = SpecConfig.parse(spec)
    if spec is None:
        raise ValueError("speculative_generate needs a speculative spec, e.g. 'self:loops=1,k=4'")
    if mesh is not None:
        raise ValueError("speculative rollouts run without a device mesh; sample with "
                         "`generate` on a mesh, or drop the mesh")
    # The request's checks before the drafter is loaded: those `generate` makes, and k
    # draft slots of cache beyond the completion.
    req = check_request(prompts, cfg, sampling=sampling, max_new_tokens=max_new_tokens,
                        num_samples=num_samples, eos_id=eos_id, pad_id=pad_id, key=key,
                        draft_slots=spec.k)
    if drafter is None and spec.drafter == "dense" and spec.path:
        drafter = load_drafter(spec.path)
    dparams, dcfg = drafter if drafter is not None else (None, None)
    if spec.drafter == "self" and drafter is not None:
        raise ValueError("self-speculation drafts with the target itself; pass no drafter")
    spec = spec.resolve(cfg, dcfg)
    policy = require(policy, "speculative_generate")
    loop = LoopSpec.parse(loop).resolve(cfg)
    if loop.compute_mode != "dense":
        raise ValueError(f"speculative rollouts verify in dense compute mode; got loop spec {loop}")
    device = one_device(params)
    if dparams is not None:  # held on the target's device, as the replay holds its stand-in
        dparams = jax.device_put(dparams, device)
    zeros = np.zeros((req.tokens_BxP.shape[0], max_new_tokens), np.int32)
    args = call_inputs(req.tokens_BxP, req.positions_BxP, req.lengths_B, req.key,
                       weights_version, zeros, zeros, False, device=device, counts_BxN=zeros)
    ro, stats = speculative_program(params, dparams, *args, cfg=cfg, dcfg=dcfg, spec=spec,
                                    policy=policy, loop=loop, sampling=sampling,
                                    max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                                    layout=decode_layout(params, policy))
    # What the replay calls the program with again (`rollout.replay`): the target's weights
    # are compared by their digest; the drafts are replaced, so the drafter's shapes suffice.
    call = SamplerCall(*req.tokens_BxP.shape, sampling, eos_id, pad_id, device=device,
                       speculative=spec_call(spec, dparams, dcfg))
    ro = dataclasses.replace(ro, weights_digest=tree_fingerprint(params), calls=(call,),
                             call_keys=jnp.expand_dims(req.key, 0))
    return (ro, stats) if with_stats else ro


def spec_call(spec: SpecConfig, dparams, dcfg: ModelConfig | None) -> SpecCall:
    """The `SpecCall` a speculative rollout records: `spec` resolved, and the dense drafter's
    config and weight shapes (`drafter_stand_in` rebuilds zeros of them)."""
    if dparams is None:
        return SpecCall(spec)
    leaves, tree = jax.tree_util.tree_flatten(dparams)
    return SpecCall(spec, dcfg, tree, tuple((tuple(x.shape), np.dtype(x.dtype).name)
                                            for x in leaves))


def replay_speculative(params: dict, cfg: ModelConfig, policy: Policy, ro: Rollout,
                       loop: LoopSpec) -> jax.Array:
    """The speculative sampler's target computation traced into the caller's program: [B, N].

    Runs the same prefill and, for each recorded iteration, the same k + 1
    token verification chunk at the same slots (`ro.verify_counts`), with the
    recorded exit schedule: a program of its own, so its values are the
    sampler's only where the compiler compiles both alike (on XLA:CPU at the
    sampler's batch shape). The exact replay is the sampler's own program
    (`speculative_program` with the tokens forced, which `rollout.replay`
    runs); this is the traceable form (`traced_replay_logprobs`) and the
    replay of a speculative rollout that records no calls. 0 off the mask.
    Not differentiable (a `while_loop`; the hybrid learner takes its gradient
    from the dense forward). Not jitted itself.
    """
    if not ro.verify_tokens or ro.verify_counts is None:
        raise ValueError("replay_speculative needs a speculative rollout (verify_tokens > 0)")
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    t = ro.verify_tokens
    k = t - 1
    params = unstack_layers(params, transpose=ro.decode_layout == "transposed", policy=policy)
    cache = unstack_cache(init_cache(cfg, policy, b, p + n + k), cfg)
    lengths = ro.prompt_lengths
    ppos = jnp.arange(p, dtype=jnp.int32)[None] - (p - lengths[:, None])
    ppos = jnp.where(ppos >= 0, ppos, -1).astype(jnp.int32)
    fused = fused_readout(policy)
    out, cache, _, _ = prefill(params, cfg, policy, loop, ro.prompt_tokens, ppos, cache,
                               readout_steps_B=ro.exit_steps[:, 0] if cfg.is_looped else None,
                               hidden=fused)
    lp0 = step_logprobs(params, cfg, policy, out, ro.completion_tokens[:, 0], ro.temperature)
    comp = jnp.concatenate([ro.completion_tokens, jnp.zeros((b, t), jnp.int32)], axis=1)
    seq = jnp.concatenate([ro.prompt_tokens, comp], axis=1)
    depth = jnp.concatenate([ro.exit_steps, jnp.full((b, t), cfg.loop_steps - 1, jnp.int32)],
                            axis=1)
    iters = jnp.max(jnp.sum(ro.verify_counts > 0, axis=1))
    lps = jnp.zeros((b, n + t), jnp.float32).at[:, 0].set(lp0)
    ts = jnp.arange(t)[None]

    def body(carry):
        i, n_B, cache, lps = carry
        slot = p + n_B - 1
        out, cache, _ = rowwise_forward(
            params, cfg, policy, take_chunk(seq, slot, t), lengths[:, None] + n_B[:, None] - 1 + ts,
            cache, slot, loop=loop, depth_BxT=take_chunk(depth, n_B, t) if cfg.is_looped else None,
            hidden=fused)
        lp = chunk_logprobs(params, cfg, policy, out, take_chunk(comp, n_B, t), ro.temperature)
        return i + 1, n_B + ro.verify_counts[:, i], cache, put_chunk(lps, lp, n_B)

    _, _, _, lps = jax.lax.while_loop(lambda c: c[0] < iters, body,
                                      (jnp.int32(0), jnp.ones((b,), jnp.int32), cache, lps))
    return jnp.where(ro.completion_mask > 0, lps[:, :n], 0.0)
