"""The looped decoder (Ouro / LoopLM family) as a pure function.

A stack of L sandwich-norm layers is applied R times with shared weights. After
each loop step r the final RMSNorm gives h_r, which is both the next step's
input and the hidden state read out at step r. The exit gate gives
`lambda_r = sigmoid(gate(h_r))` and the exit distribution of `models.loop`
(computed as the steps run, in the reference code's order).

Read-outs: `exit` (the logits of h at each token's exit step, chosen by the
`LoopSpec`'s exit rule or a recorded `ExitSchedule`; by default the model's
own rule, `ModelConfig.exit_rule`, which for an Ouro checkpoint is the read-out
of its reference code) and `expected` (the p-weighted mixture of every step's
logits, the training read-out).

Compute modes:
  `dense`: every token runs all R steps; the exit rule only picks the read-out.
  `deferred`: a token stops computing at its exit step e. Its hidden state is
    frozen and its K/V at deeper steps d > e are its step-e K/V, so a later
    token's query at step d reads it at step min(d, e). With `early_stop=True`
    (the sampler; no gradients) the loop over steps ends once every token has
    exited and the remaining cache slots are filled from the exit-step K/V.

Loop steps are 0-based here: an exit step e means e + 1 loop steps were run.

Packed (`packing`, the learner's forward without a cache): every per-token
array (hidden states, the last K/V, exit decisions, the schedule) holds the
packed rows `[S, M, ...]` of `models.packing` instead of the `[B, T]` grid,
in both compute modes; only attention runs on the grid (`attend_packed`).
Each token's loop steps are the same operations as unpacked, on other rows.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_lp.models.blocks import (
    attend,
    attend_packed,
    embed,
    lm_logits,
    mlp,
    over_layers,
    project_qkv,
    residual_add,
)
from jaxrl_lp.models.cache import write_positions
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.dense import default_positions
from jaxrl_lp.models.layers import dot, rms_norm
from jaxrl_lp.models.loop import ExitSchedule, LoopSpec
from jaxrl_lp.models.packing import Packing, pack
from jaxrl_lp.models.remat import Remat, remat_layer
from jaxrl_lp.numerics.policy import Policy

__all__ = ["LoopedOutput", "looped_forward"]


class LoopedOutput(NamedTuple):
    """What a looped forward returns (packed: `[S, M, ...]` for `[B, T, ...]`).

    logits: [B, T, V] f32, per the read-out.
    cache: the updated cache, or None.
    exit_steps: [B, T] int32, 0-based exit step of every token.
    exit_pdf: [B, T, R] f32 exit distribution (zeros at steps not computed).
    loop_evals: int32 scalar, loop steps evaluated (R, or fewer with early stop).
    """

    logits: jax.Array
    cache: dict | None
    exit_steps: jax.Array
    exit_pdf: jax.Array
    loop_evals: jax.Array


def _gate(params, hn_BxTxD, policy):
    acc = dot(hn_BxTxD, params["exit_gate"]["kernel"], policy)[..., 0]
    # The gate is read in f32: its bias and sigmoid decide exits, not activations.
    return jax.nn.sigmoid(acc + params["exit_gate"]["bias"].astype(jnp.float32)[0])


class _LoopCarry(NamedTuple):
    """The state carried from one loop step to the next (shapes per chunk of T tokens)."""

    h: jax.Array  # [B, T, D] the next step's input (frozen for exited tokens in deferred mode)
    k_last: jax.Array  # [L, B, T, K, Dh] each layer's K at the last step computed
    v_last: jax.Array  # [L, B, T, K, Dh] each layer's V at the last step computed
    exited: jax.Array  # [B, T] bool: the token has exited (in deferred mode: stopped computing)
    exit_step: jax.Array  # [B, T] int32 0-based exit step (R - 1 until decided)
    h_exit: jax.Array  # [B, T, D] the normed hidden state read out
    remaining: jax.Array  # [B, T] f32 exit probability mass not yet assigned
    cum: jax.Array  # [B, T] f32 cumulative exit probability
    cache: dict | None  # the KV cache, written in place


class _StepsState(NamedTuple):
    """The `while_loop` state of an early-stopping (deferred) loop over steps."""

    r: jax.Array  # [] int32 the next loop step
    carry: _LoopCarry
    pdf_RxBxT: jax.Array  # [R, B, T] f32 exit distribution (zeros at steps not computed)


def looped_forward(
    params: dict,
    cfg: ModelConfig,
    policy: Policy,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array | None = None,
    cache: dict | None = None,
    cache_index: jax.Array | int = 0,
    *,
    loop: LoopSpec | None = None,
    schedule: ExitSchedule | None = None,
    readout: Literal["exit", "expected"] = "exit",
    early_stop: bool = False,
    remat: Remat | bool = False,
    hidden: bool = False,
    packing: Packing | None = None,
) -> LoopedOutput:
    """Logits of a looped decoder, reading and writing an optional [R, L, ...] KV cache.

    Not jitted itself: it is traced inside the sampler's, the learner's and the
    tests' jitted programs. `loop`, `readout`, `early_stop` and `remat` are
    Python values that shape the program (static for the caller's jit);
    `schedule` holds arrays.

    Args:
      params, cfg, policy, tokens_BxT, positions_BxT, cache, cache_index: as in
        `dense_forward`.
      loop: the exit rule and compute mode (`models.loop.LoopSpec`); default
        the model's own exit rule (`cfg.exit_rule`) in dense mode.
      schedule: per-token schedule data (`ExitSchedule`): a recorded exit
        schedule to replay instead of the rule (`depth_BxT`), read-out steps
        that differ from it (`readout_BxT`), live sequences (`active_BxT`,
        deferred mode only).
      readout: `exit` or `expected`.
      early_stop: in deferred mode, stop looping once every token has exited
        (a `lax.while_loop`: for sampling and replay, not differentiable).
      remat: what each layer's backward recomputes (`models.remat.Remat`; `True` is
        `layers`).
      hidden: with the `exit` read-out, `logits` holds the normed hidden state
        read out [B, T, D] (compute precision) instead, for the fused log-prob.
      packing: compute only these slots (`models.packing`; no cache, the
        `exit` read-out, no early stop): module docstring. The schedule is
        given on the grid and packed here; the outputs are packed rows.

    Returns:
      A `LoopedOutput`.
    """
    loop = (loop or LoopSpec()).resolve(cfg)
    exit_rule = loop.rule
    schedule = schedule or ExitSchedule()
    if readout not in ("exit", "expected"):
        raise ValueError(f"readout must be 'exit' or 'expected'; got {readout!r}")
    if hidden and readout != "exit":
        raise ValueError("hidden=True returns the exit read-out's hidden state; the expected "
                         "read-out is a mixture of logits and has none")
    if early_stop and (loop.compute_mode != "deferred" or readout != "exit"):
        raise ValueError("early_stop needs compute_mode='deferred' and readout='exit'")
    if packing is not None and (cache is not None or early_stop or readout != "exit"):
        raise ValueError("a packed looped forward (packing=) has no KV cache, no early stop "
                         "and the exit read-out")
    deferred = loop.compute_mode == "deferred"
    R, L = cfg.loop_steps, cfg.num_layers
    cache_index = jnp.asarray(cache_index, jnp.int32)
    if positions_BxT is None:
        positions_BxT = default_positions(tokens_BxT, cache_index)
    if cache is not None:
        cache = write_positions(cache, positions_BxT, cache_index)
    # Per-token arrays: the [B, T] grid, or the packed rows [S, M].
    tok = (lambda x: x) if packing is None else (lambda x: pack(x, packing))
    schedule = ExitSchedule(*(None if x is None else tok(x) for x in schedule))
    positions = tok(positions_BxT)
    b, t = positions.shape
    h0 = embed(params, tok(tokens_BxT), policy)
    kv_shape = (L, b, t, cfg.num_kv_heads, cfg.head_dim)
    # Dense mode runs the deferred graph with freezing switched off by a value XLA cannot
    # fold: the two modes then compile to the same arithmetic (same fusions, same FMA
    # contractions), so deferred mode without early exits is bit-identical to dense mode.
    freeze = jax.lax.optimization_barrier(jnp.asarray(deferred))

    def decide(r, lam, remaining, cum):
        """Exit decision at step r from the running exit distribution (reference order)."""
        p = jnp.where(r < R - 1, lam * remaining, remaining)
        cum = cum + p
        if schedule.depth_BxT is not None and schedule.forced_BxT is None:
            now = r == schedule.depth_BxT
        elif exit_rule.kind == "full":
            now = jnp.full((b, t), r == R - 1)
        elif exit_rule.kind == "fixed":
            now = jnp.full((b, t), r == exit_rule.steps - 1)
        else:
            now = ((cum >= exit_rule.threshold) & (r + 1 >= exit_rule.min_loops)) | (r == R - 1)
        if schedule.depth_BxT is not None and schedule.forced_BxT is not None:
            now = jnp.where(schedule.forced_BxT, r == schedule.depth_BxT, now)
        return p, remaining * (1.0 - lam), cum, now

    def loop_step(r, c: _LoopCarry):
        frozen = c.exited & freeze

        def layer(layer_carry, xs):
            h_l, ck, cv = layer_carry
            lp, l, kl_l, vl_l = xs
            x = rms_norm(h_l, lp["attn_norm_in"], cfg.rms_eps, policy)
            q, k, v = project_qkv(lp, x, positions, cfg, policy)
            # Deferred: an exited token presents its exit-step K/V at deeper steps.
            k = jnp.where(frozen[..., None, None], kl_l.astype(k.dtype), k)
            v = jnp.where(frozen[..., None, None], vl_l.astype(v.dtype), v)
            if packing is not None:
                a, kv = attend_packed(lp, q, k, v, positions_BxT, policy, packing), None
            else:
                a, kv = attend(lp, q, k, v, positions_BxT, policy,
                               None if ck is None else (ck, cv), l, (r,), cache_index,
                               None if c.cache is None else c.cache["pos"])
            ck, cv = (None, None) if kv is None else kv
            h_l = residual_add(h_l, rms_norm(a, lp["attn_norm_out"], cfg.rms_eps, policy), policy)
            m = mlp(lp, rms_norm(h_l, lp["mlp_norm_in"], cfg.rms_eps, policy), policy)
            h_l = residual_add(h_l, rms_norm(m, lp["mlp_norm_out"], cfg.rms_eps, policy), policy)
            return (h_l, ck, cv), (k, v)

        layer = remat_layer(layer, remat)
        ck = None if c.cache is None else c.cache["k"]
        cv = None if c.cache is None else c.cache["v"]
        (h_out, ck, cv), (k_all, v_all) = over_layers(layer, (c.h, ck, cv), params["layers"],
                                                      (c.k_last, c.v_last))
        hn = rms_norm(h_out, params["final_norm"], cfg.rms_eps, policy)
        lam = _gate(params, hn, policy)
        p, remaining, cum, now = decide(r, lam, c.remaining, c.cum)
        newly = now & ~c.exited
        read_now = newly
        if schedule.readout_BxT is not None:
            read_now = (r == schedule.readout_BxT if schedule.forced_BxT is None
                        else jnp.where(schedule.forced_BxT, r == schedule.readout_BxT, newly))
        # The next step's input: the normed state (f32 carrier when the residual is f32);
        # a frozen (deferred, exited) token keeps its state.
        carry = _LoopCarry(
            h=jnp.where(frozen[..., None], c.h, hn.astype(c.h.dtype)),
            k_last=k_all, v_last=v_all, exited=c.exited | newly,
            exit_step=jnp.where(newly, r, c.exit_step),
            h_exit=jnp.where(read_now[..., None], hn, c.h_exit),
            remaining=remaining, cum=cum,
            cache=None if c.cache is None else {**c.cache, "k": ck, "v": cv},
        )
        return carry, (hn, p)

    active = schedule.active_BxT
    carry0 = _LoopCarry(
        h=h0,
        k_last=jnp.zeros(kv_shape, policy.carrier_dtype),
        v_last=jnp.zeros(kv_shape, policy.carrier_dtype),
        exited=jnp.zeros((b, t), bool) if active is None else ~active & freeze,
        exit_step=jnp.full((b, t), R - 1, jnp.int32),
        h_exit=jnp.zeros((b, t, cfg.hidden_size), policy.carrier_dtype),
        remaining=jnp.ones((b, t), jnp.float32),
        cum=jnp.zeros((b, t), jnp.float32),
        cache=cache,
    )

    if early_stop:
        def cond(s: _StepsState):
            return (s.r < R) & ~jnp.all(s.carry.exited)

        def body(s: _StepsState):
            carry, (_, p) = loop_step(s.r, s.carry)
            return _StepsState(s.r + 1, carry, s.pdf_RxBxT.at[s.r].set(p))

        n, carry, pdf_R = jax.lax.while_loop(cond, body, _StepsState(
            jnp.zeros((), jnp.int32), carry0, jnp.zeros((R, b, t), jnp.float32)))
        cache = carry.cache
        if cache is not None:
            cache = _fill_deferred(cache, carry.k_last, carry.v_last, n, cache_index)
        hn_steps = None
    else:
        carry, (hn_steps, pdf_R) = jax.lax.scan(
            lambda c, r: loop_step(r, c), carry0, jnp.arange(R, dtype=jnp.int32)
        )
        n = jnp.asarray(R, jnp.int32)
        cache = carry.cache

    pdf = jnp.moveaxis(pdf_R, 0, -1)
    if readout == "expected":
        logits_R = jax.vmap(lambda hn: lm_logits(params, hn, cfg, policy))(hn_steps)
        logits = jnp.einsum("rbtv,btr->btv", logits_R, pdf, precision=jax.lax.Precision.HIGHEST)
    else:
        logits = carry.h_exit if hidden else lm_logits(params, carry.h_exit, cfg, policy)
    return LoopedOutput(logits, cache, carry.exit_step, pdf, n)


def _fill_deferred(cache, kl, vl, n_steps, cache_index):
    """Fills the chunk's slots at steps >= n_steps (never computed) from the last K/V.

    `kl`, `vl`: [L, B, T, K, Dh], each layer's K/V at the last step computed.
    """
    def fill(buf, last):
        """buf [R, ..., S, Dh]; last: buf's shape without R, with the chunk's T slots."""
        zero = jnp.zeros((), jnp.int32)
        r = buf.shape[0]
        start = (zero,) * (buf.ndim - 2) + (cache_index, zero)
        chunk = jax.lax.dynamic_slice(buf, start, (r, *last.shape))
        skipped = (jnp.arange(r) >= n_steps).reshape((r,) + (1,) * last.ndim)
        chunk = jnp.where(skipped, last[None].astype(buf.dtype), chunk)
        return jax.lax.dynamic_update_slice(buf, chunk, start)

    def fill_all(buf, last_LxBxTxKxDh):
        last = jnp.swapaxes(last_LxBxTxKxDh, 2, 3)  # the cache's [L, B, K, T, Dh]
        if isinstance(buf, tuple):  # per-layer buffers [R, B, K, S, Dh]
            return tuple(fill(b, last[i]) for i, b in enumerate(buf))
        return fill(buf, last)  # [R, L, B, K, S, Dh]: all layers in one slice

    return {**cache, "k": fill_all(cache["k"], kl), "v": fill_all(cache["v"], vl)}
