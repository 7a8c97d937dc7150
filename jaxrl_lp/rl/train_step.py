"""The jitted learner steps: GRPO (policy-gradient with micro-batch accumulation) and SFT.

Both steps skip a non-finite update: when the loss or any gradient is not
finite the parameters and optimizer state are returned unchanged and the
metric `skipped` is 1, so a NaN never reaches a checkpoint.

Both take an optional `weights` representation (`jaxrl_lp.optim.weights`,
`jaxrl_lp.lora.LoraWeights`): then `params` is its train tree (e.g. int8 codes
and f32 scales, or a frozen base and its adapters), the loss is differentiated
with respect to `weights.differentiable(params)` (codes as f32; the adapters
alone) through `weights.model_params(d, weights.frozen(params))`, the
optimizer updates `weights.optimized(params)`, and a representation with codes
adds the metric `flip_rate` (the fraction of matmul-weight codes the update
changed). Without it (the default) the steps are exactly as before.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxrl_lp.kernels.logprob import fused_readout, readout_logprobs
from jaxrl_lp.models.blocks import lm_head, lm_logits
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import forward
from jaxrl_lp.models.recorded import Products, split_products
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.numerics.invariant import InvariantForm
from jaxrl_lp.numerics.invariant import unsupported as invariant_unsupported
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.parallel.context import constrain_params
from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules
from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rl.corrections import correction_weights
from jaxrl_lp.rl.learner_step import LearnerStep
from jaxrl_lp.rl.logprobs import (
    learner_logprobs,
    pack_groups,
    packed_logprobs,
    packed_rows_for,
    packed_rows_of,
    replay_logprobs,
    rollout_loop,
)
from jaxrl_lp.rl.loss import LossConfig, loss_denominator, policy_loss, select_anchor
from jaxrl_lp.rl.packed_rows import PACK_BUCKETS
from jaxrl_lp.rollout.generate import Rollout, split_rows, take_rows
from jaxrl_lp.rollout.step import LoopSpec
from jaxrl_lp.sync.export import straight_through_served

__all__ = ["LearnerStep", "MicroBatch", "invariant_fallback", "make_grpo_step", "make_sft_step",
           "split_rows", "take_rows"]


class MicroBatch(NamedTuple):
    """One micro-batch of a GRPO update: what `make_grpo_step`'s loss reads per row slice.

    b = B / micro_batches rows of the minibatch (N completion slots). The step
    builds them all at once, each field with a leading [micro_batches] axis,
    and `lax.scan`s over that stack, so the loss sees one slice at a time.
    The whole-minibatch quantities (the denominators, correction weights and
    token count) are computed before the split, so the update does not depend
    on it. An optional field is None in every slice when the step is called
    without it.
    """

    rollout: Rollout  # b rows of the rollout (`split_rows`)
    advantages_b: jax.Array  # [b] f32 per-sequence advantages, or [b, N] per token
    anchor_bxN: jax.Array  # [b, N] f32 the ratio's denominator log-probs (`select_anchor`)
    keep_bxN: jax.Array  # [b, N] f32 tokens in the loss (`correction_weights`' keep mask)
    weights_bxN: jax.Array  # [b, N] f32 training-inference correction weights
    denominator_b: jax.Array  # [b] f32 loss denominators of the minibatch (`loss_denominator`)
    ref_logp_bxN: jax.Array | None  # [b, N] f32 KL reference log-probs, or None
    replay_bxN: jax.Array | None  # [b, N] f32 the hybrid's recorded value (`rl.reuse`), or None
    products: Products | None  # the sampler's weight products of the b rows, or None


def _finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _select_if_finite(optimizer, grads, opt_state, params, loss):
    """`_apply_if_finite`'s rule by selection: the update, then `jnp.where` old or new.

    The SFT step's skip. It takes a second pass over the parameters and
    optimizer state, but its update's bits are what they were: under
    `lax.cond` XLA computes a learning-rate schedule in another fusion, which
    moves the last bits of an AdamW-cosine update (27k of the default model's
    132k parameters differ after 5 steps), and the default warm-start's escape
    from its loss plateau hangs on such bits (49.6% held-out accuracy before,
    7.4% with the `lax.cond` form in the warm-start).
    """
    safe = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads)
    updates, new_opt = optimizer.update(safe, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    ok = jnp.isfinite(loss) & _finite(grads) & _finite(new_params)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    return keep(new_params, params), keep(new_opt, opt_state), ok


def _apply_if_finite(optimizer, grads, opt_state, params, loss):
    """The optimizer's update when the loss, the gradients and the new parameters are finite.

    A step counts only if its loss, its gradients and the parameters it makes
    are all finite; otherwise `params` and `opt_state` come back unchanged.
    The update is computed twice: once only to reduce the new parameters to
    "all finite" (XLA fuses that into one read pass, nothing is written), then
    under `lax.cond` for real, so the kept update writes its results once (in
    place when donated). The GRPO step's skip: selecting between the old and
    new parameters and Adam moments (`_select_if_finite`) costs a second pass
    (docs/design/learner_step.md, "Learner step time on
    CPU"). Returns (params, opt_state, ok).
    """
    updates, _ = optimizer.update(grads, opt_state, params)
    ok = (jnp.isfinite(loss) & _finite(grads)
          & _finite(optax.apply_updates(params, updates)))

    def apply(_):
        updates, new_opt = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    new_params, new_opt = jax.lax.cond(ok, apply, lambda _: (params, opt_state), None)
    return new_params, new_opt, ok


def make_grpo_step(cfg: ModelConfig, policy: Policy, loss_cfg: LossConfig,
                   optimizer: optax.GradientTransformation, *, loop: LoopSpec | None = None,
                   sampler_policy: Policy | None = None, method: str = "hybrid",
                   micro_batches: int = 1, remat: Remat | bool = False, mesh: Mesh | None = None,
                   rules: ShardingRules = DEFAULT_RULES, weights=None,
                   pack_buckets: int = PACK_BUCKETS, invariant_form: InvariantForm | None = None):
    """Builds `step(params, opt_state, rollout, advantages_B, old_logp_BxN, ref_logp_BxN, served,
    replay_BxN, products)`.

    The step is a `LearnerStep` whatever the options (on one device, packed,
    or on a mesh), jitted. Donated: `params` and `opt_state`. Static: the
    rollout's static fields (policy, loop spec, temperature: a rollout sampled
    otherwise compiles anew, after the checks below), which of the optional
    arguments are None, and a packed step's row counts (`pack_buckets`: the
    rollout's masks are read on the host first; one compilation per bucket).
    Called by the training program, the studies and `bench smoke`; lowered by
    `bench learner` and traced by `plan.programs` and the planner.

    One call is one optimizer update on one minibatch. Loss denominators,
    correction weights and the token count are computed on the whole
    minibatch, then gradients are accumulated over `micro_batches` row slices
    (`MicroBatch`, scanned), so the update does not depend on the split.

    Rollouts are checked when the step is traced: their loop spec must be
    `loop` (when given; the learner replays the rollout's own schedule in any
    case) and their policy `sampler_policy` (default: the learner's `policy`,
    i.e. matched sampler and learner); a mismatch is a ValueError naming both.

    Args:
      cfg: the learner's model.
      policy: the learner's numerics.
      loss_cfg: the GRPO loss.
      optimizer: an optax transformation.
      loop: the loop spec the rollouts must have been sampled with (or None).
      sampler_policy: the policy the rollouts must have been sampled under.
      method: learner log-probs, `dense`, `hybrid` or `invariant` (`replay` has
        no gradient in deferred mode). `invariant`: the `hybrid` step whose value,
        where none is given, is the dense forward's in the batch-invariant forms
        (`rl.logprobs`' `invariant` program, forward only, jitted with
        `numerics.invariant.COMPILER_OPTIONS`), the sampler's bits for a rollout
        sampled in the `invariant` decode layout, where the hybrid replays the
        decode. Where the forms are not proven (`invariant_fallback`: another
        platform, a mesh, `weights`) it warns and is the `hybrid` step.
      micro_batches: gradient-accumulation slices.
      remat: what each layer's backward recomputes (`models.remat.Remat`: `none`,
        `layers`, `dots`; `True` is `layers`).
      mesh: run sharded (`LearnerStep` on a mesh): params and optimizer
        state by the rules, rollout rows over the data shards, activations
        constrained.
      rules: the sharding rules of `mesh`.
      weights (CodedWeights | LatentSTEWeights | None): a weight representation
        (`optim.weights`; module docstring), or None: `params` are the model's
        params. Not with `mesh`.
      pack_buckets: the dense forward skips the padding
        (`rl.logprobs.dense_logprobs`' `packed_rows`, rounded up to one of
        this many sizes by `packed_rows_of`; a looped model with its recorded
        schedule; on a mesh each data shard's rows apart); 0 computes every
        slot. The value and gradient are the unpacked ones up to matmul
        rounding.

    With `served` (the f32 values the sampler ran on) the loss is computed on
    the served copy with a straight-through gradient to the master (Fair Cast):
    `w_used = sg(served) + (master - sg(master))`.

    The hybrid's value is the replay's (`rollout.replay.replay_logprobs`, the
    sampler's own program with the rollout's tokens forced): a `hybrid` step
    called without `replay_BxN` computes it first, on the host, under the
    weights the loss computes with (the served copy with `served`, else the
    model's params of `params`: `weights.materialize`), on this step's mesh,
    and passes it in; its jitted update never traces a replay. With
    `replay_BxN` given it is taken as it is: the training program passes the
    rollout's own log-probs where the update computes with the weights the
    sampler ran (`rl.reuse`). (`trace` and `lower` without it trace the
    replay into the update, `traced_replay_logprobs`: for cost estimates.)
    With `products` too (the sampler's weight products of the rollout,
    `generate(..., record_products=True)`), the dense gradient's forward reads
    them instead of computing its matmuls (`rl.logprobs.recorded_logprobs`;
    dense models on one device, plain weights).

    Returns:
      (LearnerStep): `step(...) -> (params, opt_state, metrics)`, metrics a
        dict of f32 scalars; `step.lower(...)` and `step.trace(...)` take the
        same arguments.
    """
    remat = Remat.of(remat)
    if weights is not None and mesh is not None and not weights.shardable:
        raise ValueError("make_grpo_step: this weight representation (weights=) runs on one "
                         "device; drop mesh")
    if method == "invariant" and (why := invariant_fallback(mesh, weights,
                                                             invariant_form)) is not None:
        # The forms are not proven here: the step replays the decode, which is exact.
        warnings.warn(f"grpo.logprobs=invariant: {why}; the updates take the replay of the "
                      "sampler's decode as their value (hybrid)", stacklevel=2)
        method = "hybrid"
    # `invariant`: the hybrid's update, its value the invariant forward's (`prepare` below),
    # a forward-only program of its own, where the hybrid's is the replay.
    value_program = None
    if method == "invariant":
        from jaxrl_lp.rl.logprob_programs import jit_learner_logprobs

        value_program = jit_learner_logprobs(cfg, policy, "invariant", loop=loop,
                                             form=invariant_form)
        method = "hybrid"

    def mb_loss(params, mb: MicroBatch, num_tokens, served, rows, frozen):
        if weights is not None:  # the float view of the train tree -> the model's params
            params = weights.model_params(params, frozen)
        if served is not None:
            params = straight_through_served(params, served)
        logp, ent = learner_logprobs(params, cfg, policy, mb.rollout, method, remat=remat,
                                     packed_rows=rows, replay_BxN=mb.replay_bxN,
                                     products=mb.products)
        loss, m = policy_loss(logp, mb.anchor_bxN, mb.advantages_b, mb.keep_bxN, mb.weights_bxN,
                              mb.denominator_b, loss_cfg, mb.ref_logp_bxN, num_tokens=num_tokens)
        m = dict(m, entropy=jnp.sum(ent * mb.keep_bxN) / num_tokens)
        return loss, m

    grad_fn = jax.value_and_grad(mb_loss, has_aux=True)
    policy = require(policy, "make_grpo_step")
    want_policy = policy if sampler_policy is None else require(sampler_policy, "make_grpo_step")
    packs = pack_buckets > 0 and method in ("dense", "hybrid", "invariant")

    def step(params, opt_state, ro: Rollout, adv_B, old_logp_BxN, ref_logp_BxN=None,
             served=None, replay_BxN=None, products=None, packed_rows=None):
        if products is not None and (mesh is not None or weights is not None
                                     or method != "hybrid"):
            raise ValueError("make_grpo_step: recorded weight products (products=) serve the "
                             "hybrid step of plain weights on one device; drop mesh and weights")
        train, frozen = params, None
        if weights is not None:  # gradients w.r.t. f32 codes (int8 has none), or the adapters
            params, frozen = weights.differentiable(train), weights.frozen(train)
        rollout_loop(ro, cfg, loop)
        if ro.policy != want_policy:
            raise ValueError(
                f"rollout was sampled under policy '{ro.policy}' but this learner step was "
                f"built for rollouts of '{want_policy}'; build it with sampler_policy="
                "ro.policy "
                "(an unmatched learner) or sample under the expected policy")
        cweights, keep, cmetrics = correction_weights(old_logp_BxN, ro.logprobs,
                                                      ro.completion_mask, loss_cfg)
        anchor = select_anchor(old_logp_BxN, ro.logprobs, loss_cfg)
        denom = loss_denominator(keep, loss_cfg)
        num_tokens = jnp.maximum(jnp.sum(keep), 1.0)
        m = micro_batches
        b = adv_B.shape[0]
        rows = lambda x: None if x is None else x.reshape(m, b // m, *x.shape[1:])
        # Every field with a leading [micro_batches] axis: what the scan slices.
        mbs = MicroBatch(rollout=split_rows(ro, m), advantages_b=rows(adv_B),
                         anchor_bxN=rows(anchor), keep_bxN=rows(keep), weights_bxN=rows(cweights),
                         denominator_b=rows(denom), ref_logp_bxN=rows(ref_logp_BxN),
                         replay_bxN=rows(replay_BxN),
                         products=None if products is None else split_products(products, m))

        def accumulate(acc, mb: MicroBatch):
            (loss, metrics), g = grad_fn(params, mb, num_tokens, served, packed_rows, frozen)
            return jax.tree.map(jnp.add, acc, (loss, metrics, g)), None

        if m == 1:
            # One slice: its gradient as it comes, without a zero accumulator to fill and
            # add it into (two passes over a parameter-sized tree).
            (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda a: a[0], mbs),
                                             num_tokens, served, packed_rows, frozen)
        else:
            (loss0, m0), g0 = jax.eval_shape(
                lambda p, mb, n, s, f: grad_fn(p, mb, n, s, packed_rows, f), params,
                jax.tree.map(lambda a: a[0], mbs), num_tokens, served, frozen)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss0, m0, g0))
            # On a mesh the accumulated gradient is sharded like the parameters.
            zeros = (*zeros[:2], constrain_params(zeros[2]))
            (loss, metrics, grads), _ = jax.lax.scan(accumulate, zeros, mbs)
        grads = constrain_params(grads)
        grad_norm = optax.tree.norm(grads)
        opt_params = train if weights is None else weights.optimized(train)
        new, opt_state, ok = _apply_if_finite(optimizer, grads, opt_state, opt_params, loss)
        metrics = dict(metrics, **cmetrics, loss=loss, grad_norm=grad_norm,
                       skipped=1.0 - ok.astype(jnp.float32))
        if weights is not None:
            new = weights.updated(train, new)
            if hasattr(weights, "flip_rate"):
                metrics["flip_rate"] = weights.flip_rate(train, new)
        return new, opt_state, metrics

    kinds = ("params", "state", "batch", "batch", "batch", "batch", "params", "batch", "batch")

    def rows_of(ro, adv_B=None, old_logp_BxN=None, ref_logp_BxN=None, served=None,
                replay_BxN=None, products=None):
        if products is not None:  # the forward reads the sampler's grid: nothing to pack
            return None
        groups = pack_groups(ro.prompt_tokens.shape[0] // micro_batches, mesh, rules)
        return packed_rows_of(ro, micro_batches=micro_batches, buckets=pack_buckets,
                              groups=groups)

    prepare = None
    if method == "hybrid":
        model_params = None if weights is None else jax.jit(weights.materialize)
        replay_policy = policy

        def value_of(served, ro):
            if value_program is not None:  # the invariant forward of the minibatch
                return value_program(served, ro)
            return replay_logprobs(served, cfg, replay_policy, ro, loop=loop, mesh=mesh,
                                   rules=rules)

        def prepare(args):
            if (len(args) > 7 and args[7] is not None) or (len(args) > 8 and args[8] is not None):
                return args  # a value given; products without one are refused by the step
            args = tuple(args) + (None,) * (8 - len(args))
            params, ro, served = args[0], args[2], args[6]
            if served is None:
                served = params if model_params is None else model_params(params)
            return (*args[:7], value_of(served, ro), *args[8:])

    return LearnerStep(step, kinds, rows_of=rows_of if packs else None, mesh=mesh, cfg=cfg,
                       rules=rules, prepare=prepare)


def invariant_fallback(mesh: Mesh | None = None, weights=None,
                       form: InvariantForm | None = None) -> str | None:
    """Why a learner with `invariant` log-probs replays instead, or None where it need not:
    the forms are proven on XLA:CPU on one device (`numerics.invariant.unsupported`), or
    `form`'s fixed tiles asked for by name, for plain weights or a representation whose
    forward takes the forms (`invariant_forms`: unmerged LoRA; low-bit codes and a merged
    LoRA sampler do not)."""
    if weights is not None and not getattr(weights, "invariant_forms", False):
        return "a weight representation (low-bit codes, merged LoRA) has no invariant form"
    return invariant_unsupported(mesh=mesh, form=form)


def make_sft_step(cfg: ModelConfig, policy: Policy, optimizer: optax.GradientTransformation,
                  *, remat: Remat | bool = False, mesh: Mesh | None = None,
                  rules: ShardingRules = DEFAULT_RULES, weights=None,
                  pack_buckets: int = PACK_BUCKETS):
    """Builds the jitted supervised step `step(params, opt_state, tokens_BxL, mask_BxL)`.

    The step is a `LearnerStep` whatever the options, as the GRPO step's.
    Donated: `params` and `opt_state`. Static: a packed step's row counts
    (below). With `mesh` it runs sharded like the GRPO step. Called by the
    training program's warm-start, the studies (`backward_state`) and `bench
    speculative`; traced by `plan.programs`. With `weights` (a representation
    from `optim.weights`, not with `mesh`) `params` is its train tree and the
    metrics add `flip_rate` (module docstring).

    Loss: mean over masked targets of -log p(token_{t+1} | tokens_<=t); looped
    models use the expected (exit-weighted) read-out, their training objective.
    Where the policy lets the fused log-prob run (`fused_readout`), a dense
    model's loss reads the hidden states through `kernels.readout_logprobs`
    (the platform's kernel, no [B, L, V] logits; the plain loss where none
    runs); the looped expected read-out, a mixture of every loop
    step's logits, has no single hidden state and keeps the plain path.

    A dense model skips the padding, as the GRPO step does (`pack_buckets`;
    `rl.logprobs.packed_logprobs` with the first token as the lead and
    `mask_BxL[:, 1:]` as the targets; on a mesh each data shard's rows
    apart): tokens after a row's last target are not computed. The mask is
    read on the host (`packed_rows_for`) and the row counts are static: one
    compilation per bucket. A looped model's loss reads out every loop step
    (the expected read-out) and computes every slot.
    """
    policy = require(policy, "make_sft_step")
    remat = Remat.of(remat)
    fused = fused_readout(policy) and not cfg.is_looped
    packs = pack_buckets > 0 and not cfg.is_looped

    def packed_nll(params, tokens, mask, rows):
        b, l = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None], (b, l))
        lp, _ = packed_logprobs(params, cfg, policy, tokens, positions, jnp.ones((b, 1), bool),
                                mask[:, 1:], rows, remat=remat)
        return -lp

    def plain_nll(logits, tokens):
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]

    def fused_nll(params, tokens, mask):
        h, _, _ = forward(params, cfg, policy, tokens, remat=remat, hidden=True)
        b, l = tokens.shape
        flat = lambda x: x.reshape(b * (l - 1), *x.shape[2:])
        # The plain path (no kernel on this platform) is the unfused loss, on the same logits.
        plain = lambda: -plain_nll(lm_logits(params, h, cfg, policy), tokens).reshape(-1)
        lp = readout_logprobs(flat(h[:, :-1]), lm_head(params, cfg), flat(tokens[:, 1:]), 1.0,
                              policy, mask_T=flat(mask[:, 1:]), plain=plain, entropy=False)
        return -lp.reshape(b, l - 1)

    def loss_fn(params, tokens, mask, rows=None):
        if rows is not None:
            nll = packed_nll(params, tokens, mask, rows)
        elif fused:
            nll = fused_nll(params, tokens, mask)
        else:
            kwargs = {"readout": "expected"} if cfg.is_looped else {}
            logits, _, _ = forward(params, cfg, policy, tokens, remat=remat, **kwargs)
            nll = plain_nll(logits, tokens)
        w = mask[:, 1:].astype(jnp.float32)
        return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)

    def step(params, opt_state, tokens, mask, packed_rows=None):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, packed_rows)
        grads = constrain_params(grads)
        grad_norm = optax.tree.norm(grads)
        params, opt_state, ok = _select_if_finite(optimizer, grads, opt_state, params, loss)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm,
                                   "skipped": 1.0 - ok.astype(jnp.float32)}

    def coded_step(train, opt_state, tokens, mask, packed_rows=None):
        # Gradients w.r.t. the float view (codes as f32: int8 codes have none), or the
        # adapters alone (LoRA: the frozen base is read, never differentiated).
        frozen = weights.frozen(train)
        loss, grads = jax.value_and_grad(
            lambda d: loss_fn(weights.model_params(d, frozen), tokens, mask, packed_rows))(
                weights.differentiable(train))
        grads = constrain_params(grads)
        grad_norm = optax.tree.norm(grads)
        new, opt_state, ok = _select_if_finite(optimizer, grads, opt_state,
                                               weights.optimized(train), loss)
        new = weights.updated(train, new)
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": 1.0 - ok.astype(jnp.float32)}
        if hasattr(weights, "flip_rate"):
            metrics["flip_rate"] = weights.flip_rate(train, new)
        return new, opt_state, metrics

    def rows_of(tokens, mask):
        return packed_rows_for(np.ones(len(mask)), to_host(mask)[:, 1:], 1, buckets=pack_buckets,
                               groups=pack_groups(len(mask), mesh, rules))

    if weights is not None:
        if mesh is not None and not weights.shardable:
            raise ValueError("make_sft_step: this weight representation (weights=) runs on one "
                             "device; drop mesh")
        step = coded_step
    kinds = ("params", "state", "batch", "batch")
    return LearnerStep(step, kinds, rows_of=rows_of if packs else None, mesh=mesh, cfg=cfg,
                       rules=rules)
