"""The looped decoder (Ouro / LoopLM family) as a pure function, with exit rules.

A stack of L sandwich-norm layers is applied R times with shared weights. After
each loop step r the final RMSNorm gives h_r, which is both the next step's
input and the hidden state read out at step r. The exit gate gives
`lambda_r = sigmoid(gate(h_r))` and the exit distribution

    p_r = lambda_r * prod_{j<r} (1 - lambda_j)   for r < R - 1,
    p_{R-1} = prod_{j<R-1} (1 - lambda_j)          (the remaining mass).

Read-outs: `exit` (the logits of h at each token's exit step, chosen by an
`ExitRule`; with the default rule `full` that is the last step, as the Hugging
Face Ouro code does) and `expected` (the p-weighted mixture of every step's
logits, the training read-out).

Compute modes:
  `dense`: every token runs all R steps; the exit rule only picks the read-out.
  `deferred`: a token stops computing at its exit step e. Its hidden state is
    frozen and its K/V at deeper steps d > e are its step-e K/V, so a later
    token's query at step d reads it at step min(d, e). With `early_stop=True`
    (the sampler; no gradients) the loop over steps ends once every token has
    exited and the remaining cache slots are filled from the exit-step K/V.

Loop steps are 0-based here: an exit step e means e + 1 loop steps were run.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_lp.models.blocks import (
    attend,
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
from jaxrl_lp.numerics.policy import Policy

__all__ = ["ExitRule", "LoopedOutput", "exit_distribution", "looped_forward"]


@dataclasses.dataclass(frozen=True)
class ExitRule:
    """Which loop step a token exits at.

    kind: `full` (the last step), `fixed` (after `steps` loop steps, 1..R) or
      `threshold` (the first step whose cumulative exit probability reaches
      `threshold`, once at least `min_loops` steps have run; the last step if
      none does).
    String forms: `full`, `fixed:2`, `threshold:0.9`, `threshold:0.9:2`.
    """

    kind: Literal["full", "fixed", "threshold"] = "full"
    steps: int = 0
    threshold: float = 1.0
    min_loops: int = 1

    def __post_init__(self):
        if self.kind not in ("full", "fixed", "threshold"):
            raise ValueError(f"ExitRule.kind must be 'full', 'fixed' or 'threshold'; got {self.kind!r}")
        if self.kind == "fixed" and self.steps < 1:
            raise ValueError(f"ExitRule fixed(k) needs k >= 1 loop steps; got {self.steps}")
        if self.kind == "threshold" and not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"ExitRule threshold must be in (0, 1]; got {self.threshold}")
        if self.min_loops < 1:
            raise ValueError(f"ExitRule.min_loops must be >= 1; got {self.min_loops}")

    @classmethod
    def parse(cls, spec: str | ExitRule) -> ExitRule:
        if isinstance(spec, ExitRule):
            return spec
        parts = spec.split(":")
        try:
            if parts[0] == "full" and len(parts) == 1:
                return cls("full")
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", steps=int(parts[1]))
            if parts[0] == "threshold" and len(parts) in (2, 3):
                ml = int(parts[2]) if len(parts) == 3 else 1
                return cls("threshold", threshold=float(parts[1]), min_loops=ml)
        except ValueError as e:
            raise ValueError(f"bad exit rule {spec!r}: {e}") from None
        raise ValueError(
            f"bad exit rule {spec!r}; use 'full', 'fixed:K' or 'threshold:T[:MIN_LOOPS]'"
        )

    def __str__(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "fixed":
            return f"fixed:{self.steps}"
        return f"threshold:{self.threshold}:{self.min_loops}"

    def check(self, loop_steps: int) -> None:
        if self.kind == "fixed" and self.steps > loop_steps:
            raise ValueError(f"exit rule fixed:{self.steps} exceeds the model's {loop_steps} loop steps")


class LoopedOutput(NamedTuple):
    """What a looped forward returns.

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


def exit_distribution(lambdas_RxBxT: jax.Array) -> jax.Array:
    """The exit distribution p [B, T, R] from per-step gate probabilities (module docstring)."""
    r = lambdas_RxBxT.shape[0]
    survive = jnp.cumprod(1.0 - lambdas_RxBxT, axis=0)
    before = jnp.concatenate([jnp.ones_like(survive[:1]), survive[:-1]], axis=0)
    p = jnp.where(jnp.arange(r)[:, None, None] < r - 1, lambdas_RxBxT * before, before)
    return jnp.moveaxis(p, 0, -1)


def _gate(params, hn_BxTxD, policy):
    acc = dot(hn_BxTxD, params["exit_gate"]["kernel"], policy)[..., 0]
    # The gate is read in f32: its bias and sigmoid decide exits, not activations.
    return jax.nn.sigmoid(acc + params["exit_gate"]["bias"].astype(jnp.float32)[0])


def looped_forward(
    params: dict,
    cfg: ModelConfig,
    policy: Policy,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array | None = None,
    cache: dict | None = None,
    cache_index: jax.Array | int = 0,
    *,
    exit_rule: ExitRule | str = "full",
    compute_mode: Literal["dense", "deferred"] = "dense",
    exit_steps_BxT: jax.Array | None = None,
    readout_steps_BxT: jax.Array | None = None,
    readout: Literal["exit", "expected"] = "exit",
    early_stop: bool = False,
    active_BxT: jax.Array | None = None,
    remat: bool = False,
) -> LoopedOutput:
    """Logits of a looped decoder, reading and writing an optional [R, L, ...] KV cache.

    Args:
      params, cfg, policy, tokens_BxT, positions_BxT, cache, cache_index: as in
        `dense_forward`.
      exit_rule: decides each token's exit step online (ignored when
        `exit_steps_BxT` is given).
      compute_mode: `dense` or `deferred` (module docstring).
      exit_steps_BxT: a recorded schedule (0-based exit steps) to replay
        instead of applying the rule.
      readout_steps_BxT: the step each token is read out at, when it differs
        from its exit step (a prompt's last token runs at full depth in deferred
        mode but is read out where the rule said). Default: the exit step.
      readout: `exit` or `expected`.
      early_stop: in deferred mode, stop looping once every token has exited
        (a `lax.while_loop`: for sampling and replay, not differentiable).
      active_BxT: bool, False for tokens of sequences that have finished. In
        deferred mode such a token counts as exited before step 0: it is never
        computed (its logits and cache slots are meaningless), so a finished
        sequence does not hold the batch's loop. Ignored in dense mode.
      remat: recompute each layer's activations in the backward pass.

    Returns:
      A `LoopedOutput`.
    """
    exit_rule = ExitRule.parse(exit_rule)
    exit_rule.check(cfg.loop_steps)
    if compute_mode not in ("dense", "deferred"):
        raise ValueError(f"compute_mode must be 'dense' or 'deferred'; got {compute_mode!r}")
    if readout not in ("exit", "expected"):
        raise ValueError(f"readout must be 'exit' or 'expected'; got {readout!r}")
    if early_stop and (compute_mode != "deferred" or readout != "exit"):
        raise ValueError("early_stop needs compute_mode='deferred' and readout='exit'")
    deferred = compute_mode == "deferred"
    R, L = cfg.loop_steps, cfg.num_layers
    b, t = tokens_BxT.shape
    cache_index = jnp.asarray(cache_index, jnp.int32)
    if positions_BxT is None:
        positions_BxT = default_positions(tokens_BxT, cache_index)
    if cache is not None:
        cache = write_positions(cache, positions_BxT, cache_index)
    h0 = embed(params, tokens_BxT, policy)
    kv_shape = (L, b, t, cfg.num_kv_heads, cfg.head_dim)
    # Dense mode runs the deferred graph with freezing switched off by a value XLA cannot
    # fold: the two modes then compile to the same arithmetic (same fusions, same FMA
    # contractions), so deferred mode without early exits is bit-identical to dense mode.
    freeze = jax.lax.optimization_barrier(jnp.asarray(deferred))

    def decide(r, lam, remaining, cum):
        """Exit decision at step r from the running exit distribution."""
        p = jnp.where(r < R - 1, lam * remaining, remaining)
        cum = cum + p
        if exit_steps_BxT is not None:
            now = r == exit_steps_BxT
        elif exit_rule.kind == "full":
            now = jnp.full((b, t), r == R - 1)
        elif exit_rule.kind == "fixed":
            now = jnp.full((b, t), r == exit_rule.steps - 1)
        else:
            now = ((cum >= exit_rule.threshold) & (r + 1 >= exit_rule.min_loops)) | (r == R - 1)
        return p, remaining * (1.0 - lam), cum, now

    def loop_step(r, carry):
        h, kl, vl, exited, exit_step, h_exit, remaining, cum, cache = carry
        frozen = exited & freeze

        def layer(layer_carry, xs):
            h_l, ck, cv = layer_carry
            lp, l, kl_l, vl_l = xs
            x = rms_norm(h_l, lp["attn_norm_in"], cfg.rms_eps, policy)
            q, k, v = project_qkv(lp, x, positions_BxT, cfg, policy)
            # Deferred: an exited token presents its exit-step K/V at deeper steps.
            k = jnp.where(frozen[..., None, None], kl_l.astype(k.dtype), k)
            v = jnp.where(frozen[..., None, None], vl_l.astype(v.dtype), v)
            a, kv = attend(lp, q, k, v, positions_BxT, policy,
                           None if ck is None else (ck, cv), l, (r,), cache_index,
                           None if cache is None else cache["pos"])
            ck, cv = (None, None) if kv is None else kv
            h_l = residual_add(h_l, rms_norm(a, lp["attn_norm_out"], cfg.rms_eps, policy), policy)
            m = mlp(lp, rms_norm(h_l, lp["mlp_norm_in"], cfg.rms_eps, policy), policy)
            h_l = residual_add(h_l, rms_norm(m, lp["mlp_norm_out"], cfg.rms_eps, policy), policy)
            return (h_l, ck, cv), (k, v)

        if remat:
            layer = jax.checkpoint(layer)
        ck = None if cache is None else cache["k"]
        cv = None if cache is None else cache["v"]
        (h_out, ck, cv), (k_all, v_all) = over_layers(layer, (h, ck, cv), params["layers"],
                                                      (kl, vl))
        hn = rms_norm(h_out, params["final_norm"], cfg.rms_eps, policy)
        lam = _gate(params, hn, policy)
        p, remaining, cum, now = decide(r, lam, remaining, cum)
        newly = now & ~exited
        read_now = newly if readout_steps_BxT is None else r == readout_steps_BxT
        h_exit = jnp.where(read_now[..., None], hn, h_exit)
        exit_step = jnp.where(newly, r, exit_step)
        # The next step's input: the normed state (f32 carrier when the residual is f32);
        # a frozen (deferred, exited) token keeps its state.
        h_next = jnp.where(frozen[..., None], h, hn.astype(h.dtype))
        if cache is not None:
            cache = {**cache, "k": ck, "v": cv}
        carry = (h_next, k_all, v_all, exited | newly, exit_step, h_exit, remaining, cum, cache)
        return carry, (hn, p)

    exited0 = jnp.zeros((b, t), bool) if active_BxT is None else ~active_BxT & freeze
    carry0 = (
        h0,
        jnp.zeros(kv_shape, policy.carrier_dtype),
        jnp.zeros(kv_shape, policy.carrier_dtype),
        exited0,
        jnp.full((b, t), R - 1, jnp.int32),
        jnp.zeros((b, t, cfg.hidden_size), policy.carrier_dtype),
        jnp.ones((b, t), jnp.float32),
        jnp.zeros((b, t), jnp.float32),
        cache,
    )

    if early_stop:
        def cond(state):
            r, carry, _ = state
            return (r < R) & ~jnp.all(carry[3])

        def body(state):
            r, carry, pdf = state
            carry, (_, p) = loop_step(r, carry)
            return r + 1, carry, pdf.at[r].set(p)

        n, carry, pdf_R = jax.lax.while_loop(
            cond, body, (jnp.zeros((), jnp.int32), carry0, jnp.zeros((R, b, t), jnp.float32))
        )
        cache = carry[-1]
        if cache is not None:
            cache = _fill_deferred(cache, carry[1], carry[2], n, cache_index)
        hn_steps = None
    else:
        carry, (hn_steps, pdf_R) = jax.lax.scan(
            lambda c, r: loop_step(r, c), carry0, jnp.arange(R, dtype=jnp.int32)
        )
        n = jnp.asarray(R, jnp.int32)
        cache = carry[-1]

    exit_steps, h_exit = carry[4], carry[5]
    pdf = jnp.moveaxis(pdf_R, 0, -1)
    if readout == "expected":
        logits_R = jax.vmap(lambda hn: lm_logits(params, hn, cfg, policy))(hn_steps)
        logits = jnp.einsum("rbtv,btr->btv", logits_R, pdf, precision=jax.lax.Precision.HIGHEST)
    else:
        logits = lm_logits(params, h_exit, cfg, policy)
    return LoopedOutput(logits, cache, exit_steps, pdf, n)


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
