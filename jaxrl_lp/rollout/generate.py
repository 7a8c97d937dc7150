"""The sampler: prefill, then a jitted `lax.while_loop` decode over a preallocated KV cache.

One compiled program samples and replays (`sampler_program`): it takes the
tokens (and a looped model's exit steps) to force, and a flag. Sampling
passes False and draws; the learner's replay (`rollout.replay`) passes True and
the recorded tokens, so the replay's log-probs are computed by the very
executable that computed the sampler's, and the rollout records what that
replay needs (`rollout.rollout`: `SamplerCall`, `Rollout.call_rows`,
`Rollout.call_keys`).

Prompts are left-padded to a bucketed length P (so new prompt lengths reuse
compiled programs); pad slots hold position -1 and are never attended to. A
sequence's tokens sit at positions 0..n-1 whatever its padding, so a prompt
gives the same result alone or in a ragged batch. Generated token j of a
sequence sits at cache slot P + j - 1 when it is fed back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_lp.models.blocks import unstack_layers
from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.recorded import (
    Products,
    empty_products,
)
from jaxrl_lp.numerics.fingerprint import tree_fingerprint
from jaxrl_lp.numerics.invariant import (
    COMPILER_OPTIONS,
    InvariantForm,
    form_for,
    form_holds,
    invariant_forms,
    opaque_zero,
)
from jaxrl_lp.numerics.policy import FP32, Policy, require
from jaxrl_lp.parallel.context import use_mesh
from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules
from jaxrl_lp.parallel.shard import batch_shardings, put_tree, replicated
from jaxrl_lp.rollout.request import bucket_length, check_request, pad_prompts
from jaxrl_lp.rollout.rollout import (  # re-exported: `Rollout` was long defined here
    Rollout,
    SamplerCall,
    concat_rollouts,
    split_rows,
    take_rows,
)
from jaxrl_lp.rollout.sampling import SamplingConfig, choose_tokens, token_logprobs
from jaxrl_lp.rollout.step import (
    LoopSpec,
    decode_step,
    fused_readout,
    prefill,
    step_logits,
    transposes,
)
from jaxrl_lp.rollout.step import decode_layout as decode_layout_for  # `generate` has the name

__all__ = ["Forced", "Rollout", "SamplerCall", "bucket_length", "call_inputs", "concat_rollouts",
           "generate", "invariant_sampler_program", "one_device", "pad_prompts", "program_for",
           "sampler_program", "split_rows", "take_rows", "tree_devices"]


class Forced(NamedTuple):
    """What the sampler's program takes instead of drawing, where `on` (the replay).

    tokens_BxN: [B, N] int32 the tokens to take.
    exit_steps_BxN: [B, N] int32 a looped model's exit steps to take (unused for a dense one).
    on: [] bool, True to take them (the replay), False to draw (sampling).
    counts_BxN: [B, N] int32 a speculative sampler's verification counts to take
      (`Rollout.verify_counts`, `rollout.speculative`); None for the plain sampler.
    """

    tokens_BxN: jax.Array
    exit_steps_BxN: jax.Array
    on: jax.Array
    counts_BxN: jax.Array | None = None


class _DecodeState(NamedTuple):
    """The decode `while_loop` state (B sequences, N new tokens at most)."""

    i: jax.Array  # [] int32 index of the token being generated
    token: jax.Array  # [B] int32 the last token (fed back next)
    done: jax.Array  # [B] bool the sequence has produced EOS
    cache: dict  # the KV cache
    key: jax.Array  # the sampling PRNG key
    loop_evals: jax.Array  # [] int32 loop-step evaluations so far
    tokens: jax.Array  # [B, N] int32 generated tokens (pad after EOS)
    logprobs: jax.Array  # [B, N] f32 sampler log-probs
    exit_steps: jax.Array  # [B, N] int32 exit step of the forward that produced each token
    mask: jax.Array  # [B, N] f32 1 on generated tokens
    products: Products | None  # the weight products and logits so far (`record_products`)


_STATICS = ("cfg", "policy", "loop", "sampling", "max_new_tokens", "eos_id", "pad_id", "mesh",
            "rules", "record", "layout", "form")


def _program(params, prompt_BxP, positions_BxP, lengths_B, key, version,
             forced: Forced | None,
             *, cfg, policy, loop, sampling, max_new_tokens, eos_id, pad_id, mesh=None,
             rules=DEFAULT_RULES, record=False, layout="as_stored",
             form: InvariantForm | None = None) -> Rollout:
    """The sampler's compiled program: samples (`forced.on` False) or replays (True).

    Jitted. Static (a new value compiles anew): `cfg`, `policy`, `loop`,
    `sampling`, `max_new_tokens`, `eos_id`, `pad_id`, `mesh`, `rules`,
    `record`, `layout` (the decode layout, `rollout.step.decode_layout`), `form`
    (an `invariant` layout's `numerics.invariant.InvariantForm`), and the
    shapes of the prompt arrays (bucketed by `pad_prompts`). `version` is an
    int32 scalar array. Nothing is donated; inputs keep the shardings they
    come with (params by the rules, rows over the data shards), and
    activations and the KV cache are constrained to the rules under `mesh`.

    `forced.on` is traced, not static: sampling and replaying are one
    executable, so the replay's log-probs are the sampler's bits wherever the
    weights, policy and rows are the sampler's. `forced=None` compiles the
    sampler without that input (it draws, and a looped model's rule exits):
    the program before the replay shared it, which `bench replay` times
    against. Called by `generate`, `rollout.replay` and `bench replay`.

    The `invariant` layout's program is `invariant_sampler_program`, the same
    function jitted with `numerics.invariant.COMPILER_OPTIONS` (`program_for`),
    traced in the invariant forms of `form` (static: `numerics.invariant.form_for`'s by
    default, chosen by `generate`), which the rollout records.
    """
    if (layout == "invariant") != (form is not None):
        raise ValueError("the sampler's program: the 'invariant' decode layout takes its "
                         f"InvariantForm (form), another layout none; got {layout!r} and {form!r}")
    with use_mesh(mesh, rules), invariant_forms(opaque_zero(version), form):
        return _sample(params, prompt_BxP, positions_BxP, lengths_B, key, version, forced,
                       cfg=cfg, policy=policy, loop=loop, sampling=sampling,
                       max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                       record=record, layout=layout, form=form)


sampler_program = jax.jit(_program, static_argnames=_STATICS)
sampler_program.__doc__ = _program.__doc__
# The sampler's program in the `invariant` decode layout: its reductions and elementwise work
# are XLA's own (`numerics.invariant.COMPILER_OPTIONS`), as in the learner's parallel forward.
invariant_sampler_program = jax.jit(_program, static_argnames=_STATICS,
                                    compiler_options=COMPILER_OPTIONS)


def program_for(layout: str):
    """The sampler's jitted program for a decode layout (`invariant_sampler_program` for
    `invariant`, else `sampler_program`)."""
    return invariant_sampler_program if layout == "invariant" else sampler_program


def _form(layout: str, given: InvariantForm | None, rows: int) -> InvariantForm | None:
    """The invariant form a decode of `rows` rows in `layout` runs in (`generate`'s
    `invariant_form`), checked; None for the other layouts."""
    if layout != "invariant":
        if given is not None:
            raise ValueError(f"generate: invariant_form is for decode_layout='invariant', not "
                             f"{layout!r}")
        return None
    form = given if given is not None else form_for(rows)
    if form is None:
        raise ValueError("decode_layout 'invariant': no row chunk holds on this CPU "
                         "(numerics.invariant.row_chunk); use decode_layout='transposed'")
    if not isinstance(form, InvariantForm):
        raise TypeError(f"generate: invariant_form is an InvariantForm, not {form!r}")
    if (why := form_holds(form)) is not None:
        raise ValueError(f"generate: invariant_form {form}: {why}; pass None (this CPU's)")
    return form


def _sample(params, prompt_BxP, positions_BxP, lengths_B, key, version, forced: Forced | None,
            *, cfg, policy, loop, sampling, max_new_tokens, eos_id, pad_id, record, layout,
            form):
    b, p = prompt_BxP.shape
    n = max_new_tokens
    # Sliced and rounded once, here: inside the loop a scan over stacked weights copies them
    # every step, a transpose there would be redone every step, and so would the rounding of
    # the f32 master to the matmul inputs (`decode_weights`).
    params = unstack_layers(params, transpose=transposes(layout, form), policy=policy)
    cache = unstack_cache(init_cache(cfg, policy, b, p + n), cfg)
    # With the fused read-out the steps return the hidden state: the token is sampled from its
    # logits, and its log-prob is theirs (`token_logprobs`, what `step_logprobs` replays).
    fused = fused_readout(policy)

    # A looped model's recorded exit steps are taken where the tokens are (`ExitSchedule`).
    takes = forced is not None and cfg.is_looped
    force_B = jnp.broadcast_to(forced.on, (b,)) if takes else None
    exits_at = lambda i: forced.exit_steps_BxN[:, i] if takes else None

    def pick(out, key, i):
        # The token drawn or forced; its log-prob computed alike either way.
        logits = step_logits(params, cfg, policy, out)
        tok = choose_tokens(logits, key, sampling)
        if forced is not None:
            tok = jnp.where(forced.on, forced.tokens_BxN[:, i], tok)
        return tok, token_logprobs(logits, tok, sampling.temperature), logits

    def taped(products, tape, logits, slot, i):
        # The step's products at grid slot `slot` on, its logits at completion token `i`.
        if products is None:
            return None
        zero = jnp.zeros((), jnp.int32)
        at = lambda *idx: tuple(jnp.asarray(j, jnp.int32) for j in idx)
        return Products(
            layers={k: jax.lax.dynamic_update_slice(v, tape[k], at(zero, zero, slot, zero))
                    for k, v in products.layers.items()},
            logits=jax.lax.dynamic_update_slice(products.logits, logits[:, None], at(zero, i, zero)))

    tape = {} if record else None
    out, cache, exit0, _ = prefill(params, cfg, policy, loop, prompt_BxP, positions_BxP, cache,
                                   exits_at(0), forced_B=force_B, hidden=fused, tape=tape)
    key, sub = jax.random.split(key)
    tok, lp, logits0 = pick(out, sub, 0)
    products = None
    if record:
        widths = {k: v.shape[-1] for k, v in tape.items()}
        products = taped(empty_products(cfg.num_layers, b, p + n - 1, widths, n, cfg.vocab_size),
                         tape, logits0, 0, 0)

    def cond(s: _DecodeState):
        return (s.i < n) & ~jnp.all(s.done)

    def body(s: _DecodeState):
        pos = lengths_B + s.i - 1
        tape = {} if record else None
        out, cache, exits, ev = decode_step(params, cfg, policy, loop, s.token, pos, s.cache,
                                            p + s.i - 1, exits_at(s.i), active_B=~s.done,
                                            forced_B=force_B, hidden=fused, tape=tape)
        key, sub = jax.random.split(s.key)
        new, lp, logits = pick(out, sub, s.i)
        new = jnp.where(s.done, pad_id, new)
        live = (~s.done).astype(jnp.float32)
        done = s.done if eos_id is None else s.done | (new == eos_id)
        return _DecodeState(
            i=s.i + 1, token=new, done=done, cache=cache, key=key, loop_evals=s.loop_evals + ev,
            tokens=s.tokens.at[:, s.i].set(new), logprobs=s.logprobs.at[:, s.i].set(lp * live),
            exit_steps=s.exit_steps.at[:, s.i].set(jnp.where(s.done, 0, exits)),
            mask=s.mask.at[:, s.i].set(live),
            products=taped(s.products, tape, logits, p + s.i - 1, s.i))

    state = _DecodeState(
        i=jnp.int32(1), token=tok,
        done=jnp.zeros((b,), bool) if eos_id is None else tok == eos_id,
        cache=cache, key=key, loop_evals=jnp.int32(0),
        tokens=jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(tok),
        logprobs=jnp.zeros((b, n), jnp.float32).at[:, 0].set(lp),
        exit_steps=jnp.zeros((b, n), jnp.int32).at[:, 0].set(exit0),
        mask=jnp.zeros((b, n), jnp.float32).at[:, 0].set(1.0), products=products)
    s = jax.lax.while_loop(cond, body, state)
    return Rollout(
        prompt_tokens=prompt_BxP, prompt_lengths=lengths_B, completion_tokens=s.tokens,
        completion_mask=s.mask, logprobs=s.logprobs, exit_steps=s.exit_steps,
        loop_evals=s.loop_evals, weights_version=jnp.asarray(version, jnp.int32),
        policy=policy, loop=loop, temperature=sampling.temperature, products=s.products,
        decode_layout=layout, invariant_form=form,
        call_rows=jnp.stack([jnp.zeros((b,), jnp.int32), jnp.arange(b, dtype=jnp.int32)], 1),
    )


def generate(
    params: dict,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    policy: Policy = FP32,
    sampling: SamplingConfig = SamplingConfig(greedy=True),
    max_new_tokens: int = 32,
    num_samples: int = 1,
    eos_id: int | None = None,
    pad_id: int = 0,
    loop: LoopSpec = LoopSpec(),
    key: jax.Array | None = None,
    weights_version: int = 0,
    mesh: Mesh | None = None,
    rules: ShardingRules = DEFAULT_RULES,
    prompt_width: int = 0,
    record_products: bool = False,
    decode_layout: str | None = None,
    invariant_form: InvariantForm | None = None,
) -> Rollout:
    """Samples `num_samples` completions for each prompt (G samples per prompt, grouped).

    Rows are ordered prompt-major: row `i * num_samples + g` is sample g of prompt i.
    The decode loop stops as soon as every sequence has produced `eos_id` (or
    after `max_new_tokens`).

    The layer weights are rounded to the policy's matmul inputs and unstacked
    once per call (`unstack_layers(..., policy=)`, a transient copy of them,
    in the decode layout), so the decode loop reads bf16 weights on a GPU,
    not the f32 master. Pass params already unstacked that way
    (`unstack_layers(params, transpose=True, policy=policy)` for the
    `transposed` layout) to skip it when sampling repeatedly from the same
    weights.

    Args:
      params: parameter pytree (the served copy), layers stacked or unstacked.
      cfg: model architecture.
      prompts: ragged lists of token ids.
      policy: the sampler's precision policy.
      sampling: greedy / temperature / top-k / top-p.
      max_new_tokens: tokens to generate at most (>= 1).
      num_samples: G completions per prompt.
      eos_id: the end-of-sequence id, or None.
      pad_id: filler for padding and finished sequences.
      loop: exit rule and compute mode (looped models); the default runs the
        model's own exit rule (`cfg.exit_rule`) in dense mode. The rollout
        records it resolved.
      key: PRNG key for sampling (required unless greedy).
      weights_version: recorded in the rollout.
      mesh: sample on this device mesh: rows are split over its data shards
        (`data` x `fsdp`; a prompt's G samples stay on one shard when the
        number of prompts divides by the shards), params keep their shardings
        (`parallel.param_shardings`). Rows that do not fill the shards are
        padded with the last prompt and dropped from the rollout.
      rules: the logical-axis sharding rules (with `mesh`).
      prompt_width: pad the prompts to at least this many slots (0: the bucket
        of the longest; parts of one batch sampled apart pass the batch's).
      record_products: keep every weight product and the logits of each
        step in the rollout (`Rollout.products`, `models.recorded`): a dense
        model on one device. The sampled tokens and log-probs are the same
        bits as without.
      decode_layout: `as_stored`, `transposed` or `invariant`, the layout of the
        decode's copy of the weights (`rollout.step.decode_layout`); None picks
        it by the platform the weights are on (`transposed` on CPU). The rollout
        records it and the replay follows it. `invariant` (CPU, one device) adds
        the batch-invariant forms, which the learner's `invariant` log-probs
        reproduce in one parallel forward (`numerics.invariant`).
      invariant_form: the `numerics.invariant.InvariantForm` of an `invariant`
        decode; None takes this CPU's (`numerics.invariant.form_for`: the
        weights-major products where its column tile is small, else the row
        chunks); a form with `tiles` runs every product in `kernels.fixed_tile`'s fixed
        tiles (compiled on a GPU or TPU, interpreted anywhere). The rollout records it.

    Returns:
      A `Rollout`.

    Raises:
      ValueError: a bad request (`rollout.request.check_request`, the checks
        `speculative_generate` makes too).

    Examples:
      >>> ro = generate(params, cfg, [[1, 2, 3]], max_new_tokens=8)
    """
    req = check_request(prompts, cfg, sampling=sampling, max_new_tokens=max_new_tokens,
                        num_samples=num_samples, eos_id=eos_id, pad_id=pad_id, key=key,
                        prompt_width=prompt_width)
    policy = require(policy, "generate")
    loop = LoopSpec.parse(loop).resolve(cfg)
    if record_products and (cfg.is_looped or mesh is not None):
        raise ValueError("generate: record_products keeps a dense model's weight products on one "
                         "device; drop it for a looped model or a mesh")
    key = req.key
    rows = req.tokens_BxP.shape[0]
    if mesh is not None:  # rows to fill the data shards (dropped from the rollout)
        shards = mesh.shape["data"] * mesh.shape["fsdp"]
        fill = -rows % shards
        req = req._replace(**{f: np.concatenate([a, np.repeat(a[-1:], fill, axis=0)])
                              for f, a in zip(req._fields[:3], req[:3], strict=True)})
    zeros = np.zeros((req.tokens_BxP.shape[0], max_new_tokens), np.int32)
    if invariant_form is not None and not isinstance(invariant_form, InvariantForm):
        raise TypeError(f"generate: invariant_form is an InvariantForm, not {invariant_form!r}")
    layout = decode_layout_for(params, policy, mesh, decode_layout, invariant_form)
    form = _form(layout, invariant_form, rows)
    device = None if mesh is not None else one_device(params)
    ro = program_for(layout)(params, *call_inputs(req.tokens_BxP, req.positions_BxP, req.lengths_B,
                                              key, weights_version, zeros, zeros, False, mesh,
                                              rules, device),
                         cfg=cfg, policy=policy, loop=loop, sampling=sampling,
                         max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, mesh=mesh,
                         rules=rules, record=record_products, layout=layout, form=form)
    if ro.prompt_tokens.shape[0] != rows:  # the padding rows
        ro = jax.tree.map(lambda x: x[:rows] if np.ndim(x) else x, ro)
    # What the learner compares its weights with (`Rollout.weights_digest`), and the key
    # the replay calls the program with.
    call = SamplerCall(*req.tokens_BxP.shape, sampling, eos_id, pad_id, record_products, mesh,
                       device)
    return dataclasses.replace(ro, weights_digest=tree_fingerprint(params), calls=(call,),
                               call_keys=jnp.expand_dims(key, 0))


def _uncommitted(key: jax.Array) -> jax.Array:
    """`key` rebuilt from its host value on the default device (raw or typed), uncommitted."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)),
                                        impl=jax.random.key_impl(key))
    return jnp.asarray(np.asarray(key))


def tree_devices(tree) -> set:
    """The devices `tree`'s arrays are on (empty for host values and abstract shapes)."""
    return {d for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()}


def one_device(tree) -> jax.Device | None:
    """The one device `tree`'s arrays are on (the default device where they are on none), or
    None where they span several (a program without a mesh then follows their shardings)."""
    devices = tree_devices(tree)
    return None if len(devices) > 1 else next(iter(devices), jax.devices()[0])


def call_inputs(prompt_BxP, positions_BxP, lengths_B, key, version, forced_BxN, exits_BxN,
                on: bool, mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES,
                device: jax.Device | None = None, counts_BxN=None):
    """The arguments of `sampler_program` after `params`, placed as the program takes them.

    One placement for `generate` and the replay (`rollout.replay`), so that both
    call one executable (the same shapes, dtypes and shardings): rows over the
    data shards under `mesh`, the key and the scalars (`version` int32, `on`
    bool) replicated; without a mesh every input on `device` (the weights'),
    uncommitted (None: where `jnp.asarray` puts them, for weights that span
    several devices). `counts_BxN` (a speculative sampler's verification
    counts, `Forced.counts_BxN`) is placed as the rows are.
    """
    rows = (prompt_BxP, positions_BxP, lengths_B, forced_BxN, exits_BxN, counts_BxN)
    rows = rows if counts_BxN is not None else rows[:-1]
    scalars = (jnp.asarray(version, jnp.int32), jnp.asarray(on))
    if mesh is None and device is None:
        rows = tuple(jnp.asarray(a) for a in rows)
    elif mesh is None:  # on `device`, uncommitted (as `jnp.asarray` makes them): a rollout's
        # arrays then go wherever its consumer computes, and both callers place alike
        with jax.default_device(device):
            rows = tuple(jnp.asarray(np.asarray(a)) for a in rows)
            scalars = tuple(jnp.asarray(np.asarray(x)) for x in scalars)
            key = _uncommitted(key)
    else:
        rows = put_tree(rows, batch_shardings(rows, mesh, rules))
        key, scalars = (put_tree(x, jax.tree.map(lambda _: replicated(mesh), x))
                        for x in (key, scalars))
    prompts, positions, lengths, forced, exits, *counts = rows
    return prompts, positions, lengths, key, scalars[0], Forced(forced, exits, scalars[1],
                                                                *counts)
