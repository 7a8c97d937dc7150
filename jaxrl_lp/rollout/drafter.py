"""Drafters of speculative rollouts: the looped target at fewer loop steps, or a dense model.

Self-speculation (`SpecConfig(drafter="self", loops=m)`): the looped target
run for its first m loop steps, reading out after step m - 1. It shares the
target's weights and its KV cache: a loop step r < m of a drafted token reads
and writes the target's cache at step r, and what it needs of the committed
tokens there is exactly what the target's verification wrote (the first m
steps of the full model). The verification forward then overwrites every
slot the draft wrote. No cache of its own, no catching up. Its steps go
through `rowwise_forward` like the verification (one row: in place; more:
per-row, by vmap): on CPU a lean step of its own, writing all rows at one
shared slot range, cost more per round (docs/design/speculative.md, "Speculative
rollouts").

Dense drafter (`drafter="dense"`): a small Qwen3-style model with its own
bounded cache of `sink + window` slots: slot p for the first `sink`
positions, then a ring, position p >= sink at slot `sink + (p - sink) % window`.
The cache does not grow with the context. With `rebase`, each row's window
positions are shifted by a common offset so that the drafter never sees a
position at or beyond its trained length L: RoPE attention depends on
position differences only, so a common shift of the window leaves the
window's own attention unchanged, and the sinks stay at 0..sink-1. When a
row's next positions would reach L, its offset jumps so that the oldest
window token sits at `sink`, and the cached window keys are rotated back by
the jump (a RoPE rotation by -delta, in f32) together with their slot
positions. The constraint `sink + window + k <= L` keeps every position
below L. Its prompt prefill keeps the first `sink` and the last `window`
prompt tokens; after a verification it re-feeds the token it had not seen
(the last draft, when all k were accepted).

A drafter only proposes: exactness never depends on it (the verification
decides), so its arithmetic need not match anything bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.loop import LoopSpec
from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.rows import rowwise_forward
from jaxrl_lp.rollout.sampling import SamplingConfig, first_argmax, gumbel_max
from jaxrl_lp.rollout.sampling import _filter as filter_logits  # the sampler's own filter
from jaxrl_lp.rollout.spec_config import SpecConfig

__all__ = ["DraftState", "draft", "init_draft", "sampling_probs", "self_drafter_config"]


class DraftState(NamedTuple):
    """The drafter's part of the speculative loop state (B rows)."""

    cache: dict  # the dense drafter's bounded cache (empty for self-speculation)
    offset: jax.Array  # [B] int32 re-basing offset of the window positions
    need_prev: jax.Array  # [B] bool: the last committed-but-one token was never fed
    max_pos: jax.Array  # [] int32 largest position the drafter was fed
    steps: jax.Array  # [] int32 drafter token steps run (one per row batch per token)


def self_drafter_config(cfg: ModelConfig, loops: int) -> ModelConfig:
    """The looped target truncated to `loops` loop steps, reading out after the last."""
    return cfg.replace(loop_steps=loops, exit_rule="full")


def sampling_probs(logits_BxV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The distribution `sample_tokens` draws from: softmax of the filtered, tempered logits (f32)."""
    return jax.nn.softmax(filter_logits(logits_BxV.astype(jnp.float32) / sampling.temperature,
                                        sampling), axis=-1)


def _choose(logits_BxV, key, sampling: SamplingConfig):
    """A draft token and the drafter's distribution q [B, V] (None when greedy)."""
    if sampling.greedy:
        return first_argmax(logits_BxV, axis=-1), None
    scaled = filter_logits(logits_BxV.astype(jnp.float32) / sampling.temperature, sampling)
    tok = gumbel_max(key, scaled)
    return tok, jax.nn.softmax(scaled, axis=-1)


def _slot(spec: SpecConfig, p_B):
    """A dense drafter's cache slot of position p: sinks, then a ring of `window` slots."""
    return jnp.where(p_B < spec.sink, p_B, spec.sink + (p_B - spec.sink) % spec.window)


def _rebased(spec: SpecConfig, p, offset):
    return jnp.where(p < spec.sink, p, p - offset) if spec.rebase else p


def init_draft(spec: SpecConfig, dparams, dcfg: ModelConfig | None, policy: Policy,
               prompt_BxP, lengths_B, pad_id: int) -> DraftState:
    """The drafter's state after the prompt (a dense drafter prefills its bounded cache).

    The prefill chunk is laid out by slot: slot j < sink holds position j, ring
    slot `sink + r` the newest prompt position p with (p - sink) % window == r.
    Attention is by positions, so the slot order does not matter.
    """
    b, p = prompt_BxP.shape
    zero_B = jnp.zeros((b,), jnp.int32)
    if spec.drafter == "self":
        return DraftState({}, zero_B, jnp.zeros((b,), bool), jnp.max(lengths_B) - 1,
                          jnp.int32(0))
    s, w = spec.sink, spec.window
    j = jnp.arange(s + w, dtype=jnp.int32)[None]
    n = lengths_B[:, None]
    ring = (n - 1) - jnp.mod(n - 1 - j, w)  # ring slot j: the newest p with (p - s) % w == j - s
    pos = jnp.where(j < s, j, ring)
    valid = jnp.where(j < s, j < n, ring >= s)
    idx = jnp.clip(p - n + pos, 0, p - 1)
    toks = jnp.where(valid, jnp.take_along_axis(prompt_BxP, idx, axis=1), pad_id)
    offset = jnp.maximum(0, lengths_B - w - s) if spec.rebase else zero_B
    rpos = jnp.where(valid, _rebased(spec, pos, offset[:, None]), -1).astype(jnp.int32)
    cache = unstack_cache(init_cache(dcfg, policy, b, s + w), dcfg)
    _, cache, _ = forward(dparams, dcfg, policy, toks, rpos, cache, 0)
    return DraftState(cache, offset.astype(jnp.int32), jnp.zeros((b,), bool), jnp.max(rpos),
                      jnp.int32(1))


def _rotate_back(spec: SpecConfig, dcfg: ModelConfig, cache: dict, delta_B) -> dict:
    """Shifts every window slot back by delta_B positions: its key rotated by -delta (RoPE), its
    position lowered (slots that would fall below the sinks are dropped)."""
    hd = dcfg.head_dim
    inv_freq = 1.0 / (dcfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = -delta_B.astype(jnp.float32)[:, None] * inv_freq  # [B, Dh/2]
    emb = jnp.concatenate([ang, ang], axis=-1)[:, None, None, :]  # [B, 1, 1, Dh]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    window = (jnp.arange(cache["pos"].shape[1]) >= spec.sink)[None, None, :, None]

    def rot(k_BxKxSxDh):
        x = k_BxKxSxDh.astype(jnp.float32)  # a rotation of stored keys: f32, rounded once
        x1, x2 = jnp.split(x, 2, axis=-1)
        y = x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
        return jnp.where(window, y, x).astype(k_BxKxSxDh.dtype)

    pos = cache["pos"]
    shifted = pos - delta_B[:, None]
    in_window = (jnp.arange(pos.shape[1]) >= spec.sink)[None] & (pos >= 0)
    pos = jnp.where(in_window, jnp.where(shifted >= spec.sink, shifted, -1), pos)
    return {**cache, "k": tuple(rot(k) for k in cache["k"]), "pos": pos}


def draft(spec: SpecConfig, state: DraftState, params, cfg: ModelConfig, dparams,
          dcfg: ModelConfig | None, policy: Policy, sampling: SamplingConfig, target_cache: dict,
          last_B, prev_B, pos_B, slot_B, key):
    """Drafts k tokens after `last_B` (at position `pos_B`, target slot `slot_B`).

    Returns (drafts [B, k] int32, the drafter's distributions q [B, k, V] f32
    (None when greedy), the target cache (written by the self-drafter), state).
    """
    k = spec.k
    keys = [None] * k if sampling.greedy else jax.random.split(key, k)
    if spec.drafter == "self":
        cfg_m = self_drafter_config(cfg, spec.loops)
        loop_m = LoopSpec("full", "dense")

        def feed(cache, x_B, j):
            out, cache, _ = rowwise_forward(params, cfg_m, policy, x_B[:, None],
                                            (pos_B + j)[:, None], cache, slot_B + j, loop=loop_m)
            return out[:, 0], cache

        dcache = target_cache
        max_pos = jnp.maximum(state.max_pos, jnp.max(pos_B) + k - 1)
        offset = state.offset
    else:
        trained = dcfg.max_position_embeddings
        offset = state.offset
        dcache = state.cache
        if spec.rebase:  # the offset jumps where this phase's positions would reach L
            jump = pos_B + k - 1 - offset > trained - 1
            new = jnp.where(jump, pos_B - spec.window - spec.sink, offset)
            delta = new - offset
            dcache = jax.lax.cond(jnp.any(delta > 0),
                                  lambda c: _rotate_back(spec, dcfg, c, delta), lambda c: c, dcache)
            offset = new

        def feed(cache, x_B, j):
            p = pos_B + j
            out, cache, _ = rowwise_forward(dparams, dcfg, policy, x_B[:, None],
                                            _rebased(spec, p, offset)[:, None], cache,
                                            _slot(spec, p))
            return out[:, 0], cache

        # The token before `last` was never fed when every draft was accepted: feed it first.
        dcache = jax.lax.cond(jnp.any(state.need_prev),
                              lambda c: feed(c, prev_B, -1)[1], lambda c: c, dcache)
        max_pos = jnp.maximum(state.max_pos, jnp.max(_rebased(spec, pos_B + k - 1, offset)))

    # Unrolled (k is small): a scan carrying the caches costs more per step on CPU than the
    # drafter's own arithmetic at these sizes.
    x, toks, qs = last_B, [], []
    for j in range(k):
        logits, dcache = feed(dcache, x, j)
        x, q = _choose(logits, keys[j], sampling)
        toks.append(x)
        qs.append(q)
    drafts = jnp.stack(toks, axis=1)
    q = None if sampling.greedy else jnp.stack(qs, axis=1)
    steps = state.steps + k
    if spec.drafter == "self":
        return drafts, q, dcache, state._replace(max_pos=max_pos, steps=steps)
    return drafts, q, target_cache, DraftState(dcache, offset, state.need_prev, max_pos, steps)
