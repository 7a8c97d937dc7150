"""The learner's log-probs of sampled tokens, three ways: dense, replay and hybrid.

- `dense`: one parallel teacher-forced forward over prompt + completion that
  applies the recorded looped schedule (deferred: token s presents its K/V at
  step min(d, e_s); every position reads out at its recorded exit step).
  Differentiable; differs from the sampler by kernel-shape rounding.
- `replay`: the sampler's computation over the recorded tokens and
  schedule. At the host level it is the sampler's own compiled program rerun
  with the tokens forced (`rollout.replay.replay_logprobs`; the
  `jit_learner_logprobs` programs and the training program use it), so with
  the same weights and policy its values are the sampler's bit for bit, for
  the whole batch and any slice of it. Traced into another program (inside
  `learner_logprobs`, a `LearnerStep` given no value) it is
  `traced_replay_logprobs`: the sampler's `prefill` and `decode_step` under
  a `lax.scan`, equal to the sampler only where the compiler compiles the
  two programs alike (XLA:CPU at the sampler's batch shape; not a GPU).
- `hybrid`: `stop_gradient(replay) + (dense - stop_gradient(dense))`. The
  bracket is exactly 0.0 in value, so the value is replay's bits; its gradient
  is exactly the dense gradient. `make_grpo_step` computes the replay value
  by `replay_logprobs` before its jitted update and passes it in.
- `invariant`: the dense forward in the batch-invariant forms
  (`numerics.invariant`), read out as the sampler reads out
  (`rollout.sampling.token_logprobs`), of a rollout sampled in the `invariant`
  decode layout: one parallel forward whose values are the replay's bits
  (the sampler's under its weights, the replay's under moved ones), and whose
  gradient is the dense one's. XLA:CPU on one device only
  (`invariant.unsupported`); elsewhere the programs replay (`hybrid`).

A rollout says how to read it: its `loop` (exit rule and compute mode) and
`temperature` are what every function here computes with. A caller that
passes `loop=` states what it expects, and a rollout sampled otherwise is
refused (a deferred rollout read in dense mode is wrong by more than 1e-2 in
log-prob, silently). None of these functions is jitted itself; the sampler's
statics (`cfg`, `policy`, the rollout's `loop`/`temperature`) are static for the
caller's jit.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.kernels.dispatch import per_shard
from jaxrl_lp.kernels.logprob import readout_logprobs
from jaxrl_lp.models.blocks import lm_head, lm_logits
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.loop import ExitSchedule
from jaxrl_lp.models.model import forward
from jaxrl_lp.models.packing import gather_rows, make_packing, unpack
from jaxrl_lp.models.recorded import Products, with_products
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.numerics.invariant import form_holds, invariant_forms, opaque_zero
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.rl.packed_rows import pack_groups, packed_rows_for, packed_rows_of
from jaxrl_lp.rollout.generate import Rollout
from jaxrl_lp.rollout.replay import (
    prompt_positions,
    replay_logprobs,
    rollout_loop,
    traced_replay_logprobs,
)
from jaxrl_lp.rollout.sampling import token_logprobs
from jaxrl_lp.rollout.step import LoopSpec, fused_readout

__all__ = ["LOGPROB_METHODS", "LogprobMethod", "check_invariant_rollout",
           "invariant_readout", "dense_logprobs", "forward_products",
           "learner_logprobs", "logprob_entropy", "pack_groups",
           "packed_logprobs", "packed_rows_for", "packed_rows_of", "prompt_positions",
           "recorded_logprobs", "replay_logprobs", "rollout_loop", "traced_replay_logprobs"]

LogprobMethod = Literal["dense", "replay", "hybrid", "invariant"]
LOGPROB_METHODS: tuple[str, ...] = ("dense", "replay", "hybrid", "invariant")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logprob_entropy(logits_xV: jax.Array, tokens_x: jax.Array, temperature: float):
    """(log-prob of `tokens_x`, entropy) of softmax(logits / temperature), f32, in one pass.

    With s = logits / tau and lse = logsumexp(s): logp = s[token] - lse and
    H = lse - sum_v p_v s_v. The gradient (`jax.custom_vjp`) is written out,

        dL/dlogits = [g_logp (1[v = token] - p) - g_H p (s - E_p s)] / tau,

    one elementwise pass over `[x, V]` where autodiff of `log_softmax` twice
    (log-prob and entropy) and of the token gather takes several and scatters
    into a zero `[x, V]` array. The dense learner's plain read-out; it equals
    `token_logprobs` and the entropy of `log_softmax` up to f32 rounding
    (tests/test_logprobs.py), and the sampler keeps `token_logprobs`.
    """
    return _logprob_entropy_fwd(logits_xV, tokens_x, temperature)[0]


def _logprob_entropy_fwd(logits_xV, tokens_x, temperature):
    s = logits_xV.astype(jnp.float32) / temperature
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    lse = m + jnp.log(total)
    mean = jnp.sum(e * s, axis=-1, keepdims=True) / total  # E_p s
    chosen = jnp.take_along_axis(s, tokens_x[..., None], axis=-1)
    out = ((chosen - lse)[..., 0], (lse - mean)[..., 0])
    return out, (s, tokens_x, lse, mean, jnp.zeros((), logits_xV.dtype))


def _logprob_entropy_bwd(temperature, res, g):
    s, tokens_x, lse, mean, like = res
    g_lp, g_ent = g
    p = jnp.exp(s - lse)
    onehot = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1) == tokens_x[..., None]
    dz = (g_lp[..., None] * (onehot - p) - g_ent[..., None] * p * (s - mean)) / temperature
    return dz.astype(like.dtype), None


logprob_entropy.defvjp(_logprob_entropy_fwd, _logprob_entropy_bwd)


def dense_logprobs(params: dict, cfg: ModelConfig, policy: Policy, ro: Rollout, *,
                   loop: LoopSpec | None = None, remat: Remat | bool = False,
                   packed_rows: tuple[int, int] | None = None, invariant: bool = False):
    """Teacher-forced log-probs and entropies [B, N] from one parallel forward (differentiable).

    The forward applies the rollout's recorded schedule in its compute mode
    (`rollout_loop`; `loop`, if given, must match it). Only the N positions
    that predict the completion are read out, by `kernels.readout_logprobs`
    from their hidden states: the platform's fused kernel where one runs (no
    [B, N, V] logits; 0 off the completion mask), elsewhere (a CPU program,
    `kernels=off`, a matmul format) `logprob_entropy` of their logits
    [B, N, V] (one softmax pass, the gradient written out).

    With `packed_rows = (body, head)` (static; `packed_rows_of` computes
    them) the forward skips the padding (`models.packing`): it runs on `body`
    packed rows holding the prompts' real tokens and each completion up to
    its last masked token, and the read-out on `head` rows holding the
    completion-mask positions; a looped model applies the same recorded
    schedule to its packed rows. Values off the completion mask are then 0.
    If a count is larger than its rows every value is NaN (the step is
    skipped as non-finite, never silently wrong). Under a mesh the rows of
    each data shard are packed apart (`pack_groups`).

    With `invariant` (traced inside a program jitted with
    `numerics.invariant.COMPILER_OPTIONS`, the rollout sampled in the
    `invariant` layout: `check_invariant_rollout`) the forward takes the
    batch-invariant forms and the read-out is `invariant_readout`: the values
    are the sampler's computation bit for bit, packed or not, and inside a
    gradient's program too (`_invariant_logprobs`: their derivative is the
    plain forward's, recomputed in the backward pass).
    """
    loop = rollout_loop(ro, cfg, loop)
    if invariant:
        check_invariant_rollout(ro)
        return _invariant_logprobs(params, ro, cfg, policy, loop, remat, packed_rows)
    return _dense_logprobs(params, cfg, policy, ro, loop, remat, packed_rows, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _invariant_logprobs(params, ro, cfg, policy, loop, remat, packed_rows):
    """`dense_logprobs`' values in the invariant forms, differentiated as the plain forward.

    Only the values have to be the decode's. Differentiated through, the forward's
    intermediates would be the backward's too, and the compiler fuses a forward whose
    intermediates it keeps otherwise than one whose it does not (values one ulp off the
    sampler's were seen): so the forward here keeps nothing but its inputs, and the
    backward pass recomputes the plain forward and takes its VJP, the dense learner's
    gradient at the same weights.
    """
    with invariant_forms(opaque_zero(ro.weights_version), ro.invariant_form):
        return _dense_logprobs(params, cfg, policy, ro, loop, remat, packed_rows, True)


def _invariant_logprobs_fwd(params, ro, cfg, policy, loop, remat, packed_rows):
    return _invariant_logprobs(params, ro, cfg, policy, loop, remat, packed_rows), (params, ro)


def _invariant_logprobs_bwd(cfg, policy, loop, remat, packed_rows, res, g):
    params, ro = res
    with invariant_forms(opaque_zero(ro.weights_version), None):  # the plain forms
        _, vjp = jax.vjp(lambda p: _dense_logprobs(p, cfg, policy, ro, loop, remat, packed_rows,
                                                   False), params)
    zero = lambda x: (np.zeros(x.shape, jax.dtypes.float0)
                      if not jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros_like(x))
    return vjp(g)[0], jax.tree.map(zero, ro)


_invariant_logprobs.defvjp(_invariant_logprobs_fwd, _invariant_logprobs_bwd)


def _dense_logprobs(params, cfg, policy, ro, loop, remat, packed_rows, invariant):
    b, p = ro.prompt_tokens.shape
    n = ro.completion_tokens.shape[1]
    tokens = jnp.concatenate([ro.prompt_tokens, ro.completion_tokens], axis=1)
    positions = jnp.concatenate(
        [prompt_positions(ro.prompt_tokens, ro.prompt_lengths),
         ro.prompt_lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]], axis=1)
    schedule = None
    if cfg.is_looped:
        full = jnp.full((b, p + n), cfg.loop_steps - 1, jnp.int32)
        # Position P-1+j reads out completion token j at its recorded exit step.
        readout = jax.lax.dynamic_update_slice(full, ro.exit_steps, (0, p - 1))
        # Compute depth: prompt tokens run at full depth; completion token j-1
        # (at position P+j-1) stopped where the step that produced token j did.
        depth = jax.lax.dynamic_update_slice(full, ro.exit_steps[:, 1:], (0, p))
        if ro.env_mask is not None:  # observations were prefilled, at full depth
            env = jnp.concatenate([jnp.zeros((b, p), bool), ro.env_mask > 0], axis=1)
            depth = jnp.where(env, cfg.loop_steps - 1, depth)
        schedule = ExitSchedule(depth_BxT=depth, readout_BxT=readout)
    if packed_rows is not None:
        return packed_logprobs(params, cfg, policy, tokens, positions, positions[:, :p] >= 0,
                               ro.completion_mask, packed_rows, ro.temperature, remat=remat,
                               loop=loop if cfg.is_looped else None, schedule=schedule,
                               invariant=invariant)
    h, _, _ = forward(params, cfg, policy, tokens, positions, loop=loop if cfg.is_looped else None,
                      schedule=schedule, remat=remat, hidden=True)
    h = h[:, p - 1:p - 1 + n]  # the lm head reads the positions that predict the completion
    t = ro.temperature
    if invariant:
        return invariant_readout(lm_logits(params, h, cfg, policy), ro.completion_tokens, t)
    plain = lambda: logprob_entropy(lm_logits(params, h, cfg, policy), ro.completion_tokens, t)
    if not fused_readout(policy):
        return plain()
    flat = lambda x: x.reshape(b * n, *x.shape[2:])
    lp, ent = readout_logprobs(flat(h), lm_head(params, cfg), flat(ro.completion_tokens), t,
                               policy, mask_T=flat(ro.completion_mask),
                               plain=lambda: tuple(map(flat, plain())))
    return lp.reshape(b, n), ent.reshape(b, n)


def invariant_readout(logits_xV: jax.Array, tokens_x: jax.Array, temperature: float):
    """(log-prob, entropy) of `tokens_x`: the value the sampler's `token_logprobs`, the
    gradient and entropy `logprob_entropy`'s (as the hybrid's value and gradient).

    The value is passed through by `_valued` (no arithmetic): `sampled + (lp - lp)` is
    0.0 only where XLA computes both copies of `lp` alike, and XLA:CPU duplicates a
    producer into two fusions and contracts its products into fused multiply-adds in
    one and not the other (a few tokens 1 ulp off the sampler's in a development run).
    """
    lp, ent = logprob_entropy(logits_xV, tokens_x, temperature)
    return _valued(token_logprobs(logits_xV, tokens_x, temperature), lp), ent


@jax.custom_vjp
def _valued(value, grad_of):
    """`value`, differentiated as `grad_of` (the identity's gradient to `grad_of`)."""
    return value


def _valued_fwd(value, grad_of):
    return value, None


def _valued_bwd(_, g):
    return jnp.zeros_like(g), g


_valued.defvjp(_valued_fwd, _valued_bwd)


def check_invariant_rollout(ro: Rollout) -> None:
    """Raises unless `ro` was sampled in the `invariant` decode layout (what the `invariant`
    log-probs reproduce: another layout's decode sums otherwise)."""
    if ro.decode_layout != "invariant":
        raise ValueError(f"invariant log-probs reproduce a rollout sampled in the 'invariant' "
                         f"decode layout; this one was sampled in {ro.decode_layout!r} "
                         "(generate(..., decode_layout='invariant'))")
    if ro.verify_tokens:
        raise ValueError("invariant log-probs: a speculative rollout verifies chunks; replay it")
    if ro.invariant_form is None:
        raise ValueError("invariant log-probs: the rollout records no invariant_form (the form "
                         "its decode's products ran in); sample it with generate(..., "
                         "decode_layout='invariant')")
    if (why := form_holds(ro.invariant_form)) is not None:
        raise ValueError(f"invariant log-probs cannot reproduce this rollout here: {why}; "
                         "replay it (grpo.logprobs=hybrid)")


def recorded_logprobs(params: dict, cfg: ModelConfig, policy: Policy, ro: Rollout,
                      products: Products):
    """`dense_logprobs` over the sampler's own weight products (`models.recorded`).

    The forward runs on the rollout's grid up to its last fed-back token
    (`[B, P + N - 1]`, the slots `products` covers) with every matmul's
    product taken from `products`: what is computed is the elementwise work,
    attention and the read-out's softmax. The values are the sampler's (its
    logits, so its log-probs up to the softmax's rounding); the gradient is
    the backward of the computation that sampled the tokens. Dense models, no
    fused read-out (the logits are recorded).
    """
    if cfg.is_looped:
        raise ValueError("recorded_logprobs: recorded weight products are for dense models")
    tokens, positions = _fed_back(ro)
    recorded = with_products(params, products)
    h, _, _ = forward(recorded, cfg, policy, tokens, positions, hidden=True)
    logits = lm_logits(recorded, h[:, ro.prompt_tokens.shape[1] - 1:], cfg, policy)
    return logprob_entropy(logits, ro.completion_tokens, ro.temperature)


def forward_products(params: dict, cfg: ModelConfig, policy: Policy, ro: Rollout) -> Products:
    """The weight products and logits of one parallel forward over the rollout's grid.

    What `generate(..., record_products=True)` records, computed by the
    learner's whole-sequence forward instead of the sampler's steps: equal up
    to matmul rounding (tests/test_recorded.py). For benchmarks and tests.
    """
    tokens, positions = _fed_back(ro)
    tape: dict = {}
    h, _, _ = forward(params, cfg, policy, tokens, positions, hidden=True, tape=tape)
    return Products(layers=tape,
                    logits=lm_logits(params, h[:, ro.prompt_tokens.shape[1] - 1:], cfg, policy))


def _fed_back(ro: Rollout) -> tuple[jax.Array, jax.Array]:
    """Tokens and positions [B, P + N - 1] the sampler fed through the model: the prompt and
    every completion token but the last (`models.recorded.Products`' grid)."""
    n = ro.completion_tokens.shape[1]
    tokens = jnp.concatenate([ro.prompt_tokens, ro.completion_tokens[:, :-1]], axis=1)
    positions = jnp.concatenate(
        [prompt_positions(ro.prompt_tokens, ro.prompt_lengths),
         ro.prompt_lengths[:, None] + jnp.arange(n - 1, dtype=jnp.int32)[None]], axis=1)
    return tokens, positions


def packed_logprobs(params: dict, cfg: ModelConfig, policy: Policy, tokens_BxT: jax.Array,
                    positions_BxT: jax.Array, lead_real_BxP: jax.Array, mask_BxN: jax.Array,
                    packed_rows: tuple[int, int], temperature: float = 1.0, *,
                    remat: Remat | bool = False, loop: LoopSpec | None = None,
                    schedule: ExitSchedule | None = None, invariant: bool = False):
    """Log-probs and entropies [B, N] of a model's targets from a packed forward.

    The grid `tokens_BxT` is P lead slots (real where `lead_real_BxP`), then N
    target slots: target j is token P + j, read out at slot P - 1 + j where
    `mask_BxN` is set. Every target slot up to a row's last masked one is
    context (a mask with holes keeps them); the rest and the unreal lead slots
    are not computed (`models.packing`). `packed_rows = (body, head)` (static)
    bounds the computed slots and read-outs of each packing group
    (`packed_rows_for`). A looped model runs `loop` with its `schedule` (on
    the grid; `dense_logprobs` builds it), read out at the exit step. Under a
    mesh each data shard's rows are packed apart (`pack_groups`). Values off
    the mask are 0; if a count is larger than its rows every value is NaN.
    Used by `dense_logprobs` (lead: the prompt) and the SFT step (lead: the
    first token). `invariant`: the read-out is `invariant_readout` (the caller
    traces inside `invariant_forms`).
    """
    b, p = lead_real_BxP.shape
    n = mask_BxN.shape[1]
    t = p + n
    groups = pack_groups(b)
    body_rows, head_rows = packed_rows
    done = mask_BxN > 0
    context = jnp.flip(jnp.cumsum(jnp.flip(done, axis=1), axis=1), axis=1) > 0
    body, fits_body = make_packing(jnp.concatenate([lead_real_BxP, context], axis=1), body_rows,
                                   groups)
    head, fits_head = make_packing(done, head_rows, groups)
    looped = {} if loop is None else {"loop": loop, "schedule": schedule}
    h, _, _ = forward(params, cfg, policy, tokens_BxT, positions_BxT, remat=remat, hidden=True,
                      packing=body, **looped)  # [S, body, D]

    def read_rows(h_MxD, body_slot, head_index):
        # Head row r reads target (i, j) = divmod(head_index[r], N) of its group, predicted
        # at grid slot (i, P - 1 + j): its packed body row. Distinct head rows read distinct
        # body rows.
        i, j = head_index // n, head_index % n
        at = body_slot[i * t + p - 1 + j]
        back = jnp.full((body_rows,), head_rows, jnp.int32).at[at].set(
            jnp.arange(head_rows, dtype=jnp.int32), mode="drop")
        return gather_rows(h_MxD, at, back)  # [head_rows, D]

    if groups == 1:
        h = read_rows(h[0], body.slot_S, head.index_M)
        targets = lambda x_BxN: x_BxN.reshape(-1)[head.index_M]  # [head_rows]
    else:  # each group's own rows, then the groups' read-outs as one array
        rows = ("batch", None)
        h = per_shard(jax.vmap(read_rows), (rows + (None,), rows, rows), rows + (None,))(
            h, body.slot_S, head.index_M).reshape(-1, h.shape[-1])
        targets = lambda x_BxN: jnp.take_along_axis(
            x_BxN.reshape(groups, -1), head.index_M, axis=1).reshape(-1)
    toks = targets(tokens_BxT[:, p:])
    if invariant:  # inside `invariant_forms` (`dense_logprobs`): the sampler's read-out
        lp, ent = invariant_readout(lm_logits(params, h, cfg, policy), toks, temperature)
    else:
        lp, ent = readout_logprobs(
            h, lm_head(params, cfg), toks, temperature, policy, mask_T=targets(done),
            plain=lambda: logprob_entropy(lm_logits(params, h, cfg, policy), toks, temperature))
    ok = fits_body & fits_head
    grid = lambda x: unpack(x.reshape(groups, head_rows), head, b, n)
    out = lambda x: jnp.where(ok, jnp.where(done, grid(x), 0.0), jnp.nan)
    return out(lp), out(ent)


def learner_logprobs(params: dict, cfg: ModelConfig, policy: Policy, ro: Rollout,
                     method: LogprobMethod = "hybrid", *, loop: LoopSpec | None = None,
                     remat: Remat | bool = False, packed_rows: tuple[int, int] | None = None,
                     replay_BxN: jax.Array | None = None, products: Products | None = None):
    """Log-probs [B, N] (and entropies [B, N], from the dense forward; zeros for replay).

    Args:
      params: the learner's weights.
      cfg: the learner's model.
      policy: the learner's numerics.
      ro: the rollout; its loop spec and temperature are used (`rollout_loop`).
      method: `dense`, `replay`, `hybrid` or `invariant` (module docstring).
      loop: the loop spec the caller expects the rollout to have (checked), or
        None to take the rollout's.
      remat: what the dense backward recomputes (`models.remat.Remat`).
      packed_rows: the dense forward without the padding (`dense_logprobs`).
      replay_BxN: `hybrid` only: the replay's values where the caller already
        has them, and the replay is not run. The training program passes the
        rollout's own log-probs when the update's weights are the ones the
        sampler ran and the policies match (`rl.reuse`): then they are the
        replay's bits on the completion mask, and the hybrid costs the dense
        forward alone.
      products: `hybrid` with `replay_BxN` only: the sampler's weight products
        for this rollout (`models.recorded`); the dense gradient's forward
        then reads them (`recorded_logprobs`) instead of computing them.
    """
    policy = require(policy, "learner_logprobs")
    rollout_loop(ro, cfg, loop)  # refuses a rollout sampled otherwise than expected
    if replay_BxN is not None and method != "hybrid":
        raise ValueError(f"replay_BxN is the hybrid's value; method={method!r} does not use it")
    if products is not None and replay_BxN is None:
        raise ValueError("products (the sampler's weight products) stand for the forward of "
                         "the weights the sampler ran: pass them with its replay_BxN")
    if method == "replay":
        return traced_replay_logprobs(params, cfg, policy, ro), jnp.zeros(ro.logprobs.shape)
    if method == "invariant":
        if replay_BxN is not None or products is not None:
            raise ValueError("invariant log-probs compute their value in their forward; they "
                             "take no replay_BxN or products")
        return dense_logprobs(params, cfg, policy, ro, remat=remat, packed_rows=packed_rows,
                              invariant=True)
    if products is not None:
        dense, entropy = recorded_logprobs(params, cfg, policy, ro, products)
    else:
        dense, entropy = dense_logprobs(params, cfg, policy, ro, remat=remat,
                                        packed_rows=packed_rows)
    if method == "dense":
        return dense, entropy
    if method != "hybrid":
        raise ValueError(f"log-prob method must be one of {LOGPROB_METHODS}; got {method!r}")
    if replay_BxN is None:
        # stop_gradient on the *input*: a JVP-traced replay compiles differently (1 ulp off
        # the sampler).
        replay_BxN = traced_replay_logprobs(jax.lax.stop_gradient(params), cfg, policy, ro)
    replay = jax.lax.stop_gradient(replay_BxN)
    return replay + (dense - jax.lax.stop_gradient(dense)), entropy
