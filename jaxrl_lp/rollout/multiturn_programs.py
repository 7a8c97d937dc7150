"""The multi-turn sampler's two compiled programs (`rollout.multiturn` runs them).

`chunk_program` prefills a chunk (a prompt, or a turn's last token and an observation)
at a cache slot; `segment_program` decodes one model turn of every active row. Each takes
the tokens to force and a flag, so that sampling and the replay are one executable per
program (`rollout.multiturn`, "Exact by construction").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_lp.rollout.sampling import choose_tokens, token_logprobs
from jaxrl_lp.rollout.step import decode_step, fused_readout, prefill, step_logits

__all__ = ["ENDED_BY", "Segment", "chunk_program", "segment_program"]

# How a model turn ended (the segment's per-row code): still running, EOS, a stop token, or
# the per-turn token limit.
ENDED_BY = ("running", "eos", "stop", "length")
_RUNNING, _EOS, _STOP, _LENGTH = range(4)


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "loop"))
def chunk_program(params, cache, tokens_BxW, positions_BxW, slot, readout_B, forced_on,
                  *, cfg, policy, loop):
    """Prefills a chunk at `slot`; (out at its last slot, cache, read-out step [B], evals).

    Jitted; `cfg`, `policy`, `loop` and the chunk width are static, `slot` traced.
    `readout_B` with `forced_on` replays a looped model's recorded read-out step.
    """
    force = jnp.broadcast_to(forced_on, readout_B.shape) if cfg.is_looped else None
    out, cache, exits, evals = prefill(
        params, cfg, policy, loop, tokens_BxW, positions_BxW, cache,
        readout_B if cfg.is_looped else None, forced_B=force, hidden=fused_readout(policy),
        index=slot)
    return out, cache, exits, evals


class Segment(NamedTuple):
    """The decode segment's `while_loop` state (B rows, T tokens of a turn at most)."""

    i: jax.Array  # [] int32 the turn token being produced
    token: jax.Array  # [B] int32 the last token (fed next)
    length: jax.Array  # [B] int32 tokens of the turn so far
    ended: jax.Array  # [B] int32 `ENDED_BY` code
    cache: dict
    key: jax.Array
    evals: jax.Array  # [] int32 loop-step evaluations
    tokens: jax.Array  # [B, T] int32
    logprobs: jax.Array  # [B, T] f32
    exits: jax.Array  # [B, T] int32


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "loop", "sampling", "turn_tokens",
                                             "stop_ids", "eos_id", "pad_id"))
def segment_program(params, cache, out_B, exit0_B, slot, pos_B, active_B, key, limit,
                    forced_BxT, forced_exits_BxT, forced_on,
                    *, cfg, policy, loop, sampling, turn_tokens, stop_ids, eos_id, pad_id):
    """Decodes one model turn of every active row from `out_B` (the output at the context's
    last slot); samples (`forced_on` False) or replays (True) in one executable.

    Jitted; the statics compile anew, `slot` (the first decode slot), `limit` and the
    arrays are traced. Token 0 of the turn comes from `out_B`; each decode step feeds
    token i-1 of a running row at slot `slot + i - 1`, position `pos_B + i - 1`. A row
    that ended (or is not active) waits: it is computed (a looped model's deferred mode
    skips it) and its slot is marked empty after the step. Sampling stops when no row
    runs or at `turn_tokens`; the replay runs exactly `limit` tokens (the sampler's
    count). Returns the final `Segment`.
    """
    b, t = forced_BxT.shape
    stops = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)
    takes = cfg.is_looped
    force_B = jnp.broadcast_to(forced_on, (b,))

    def pick(out, key, i):
        logits = step_logits(params, cfg, policy, out)
        tok = choose_tokens(logits, key, sampling)
        tok = jnp.where(forced_on, forced_BxT[:, i], tok)
        return tok, token_logprobs(logits, tok, sampling.temperature)

    def ended_by(tok, length):
        code = jnp.where(jnp.isin(tok, stops), _STOP, _RUNNING)
        if eos_id is not None:
            code = jnp.where(tok == eos_id, _EOS, code)
        return jnp.where((code == _RUNNING) & (length >= turn_tokens), _LENGTH, code)

    key, sub = jax.random.split(key)
    tok, lp = pick(out_B, sub, 0)
    running = active_B
    tok = jnp.where(running, tok, pad_id)
    ended = jnp.where(running, ended_by(tok, jnp.ones((b,), jnp.int32)), _RUNNING)
    state = Segment(
        i=jnp.int32(1), token=tok, length=running.astype(jnp.int32),
        ended=ended, cache=cache, key=key, evals=jnp.int32(0),
        tokens=jnp.full((b, t), pad_id, jnp.int32).at[:, 0].set(tok),
        logprobs=jnp.zeros((b, t), jnp.float32).at[:, 0].set(jnp.where(running, lp, 0.0)),
        exits=jnp.zeros((b, t), jnp.int32).at[:, 0].set(jnp.where(running, exit0_B, 0)))

    def live(s: Segment):
        return active_B & (s.ended == _RUNNING)

    def cond(s: Segment):
        go = jnp.where(forced_on, True, jnp.any(live(s)))
        return (s.i < jnp.minimum(limit, t)) & go

    def body(s: Segment):
        run = live(s)
        # A running row feeds its last token at its next position; a waiting one is computed
        # at the position after its last real one and its slot emptied below.
        pos = pos_B + jnp.where(run, s.i - 1, jnp.maximum(s.length - 1, 0))
        exits_in = forced_exits_BxT[:, s.i] if takes else None
        out, cache, exits, ev = decode_step(params, cfg, policy, loop, s.token, pos, s.cache,
                                            slot + s.i - 1, exits_in, active_B=run,
                                            forced_B=force_B if takes else None,
                                            hidden=fused_readout(policy))
        cache = {**cache, "pos": cache["pos"].at[:, slot + s.i - 1].set(
            jnp.where(run, cache["pos"][:, slot + s.i - 1], -1))}
        key, sub = jax.random.split(s.key)
        new, lp = pick(out, sub, s.i)
        new = jnp.where(run, new, pad_id)
        length = s.length + run.astype(jnp.int32)
        ended = jnp.where(run, ended_by(new, length), s.ended)
        return Segment(
            i=s.i + 1, token=jnp.where(run, new, s.token), length=length, ended=ended,
            cache=cache, key=key, evals=s.evals + ev,
            tokens=s.tokens.at[:, s.i].set(new),
            logprobs=s.logprobs.at[:, s.i].set(jnp.where(run, lp, 0.0)),
            exits=s.exits.at[:, s.i].set(jnp.where(run, exits, 0)))

    return jax.lax.while_loop(cond, body, state)
