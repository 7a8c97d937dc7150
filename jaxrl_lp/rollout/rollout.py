"""`Rollout`: a batch of sampled completions and everything the learner needs to read it.

What every stage passes on (the sampler writes it, the learner, the metrics and
the sync diagnostics read it), with the row operations a run applies to it:
`split_rows` (micro-batches), `take_rows` (minibatches, a refill's picks) and
`concat_rollouts` (a refilled batch, a sampler's replicas). A rollout records
the sampler calls its rows came from (`SamplerCall`, `Rollout.call_rows`), which
those operations keep, so that the replay (`rollout.replay`) runs each row where
the sampler computed it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.recorded import Products, split_products, take_product_rows
from jaxrl_lp.numerics.invariant import InvariantForm
from jaxrl_lp.numerics.policy import FP32, Policy, require
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.rollout.spec_config import SpecConfig
from jaxrl_lp.rollout.step import LoopSpec

__all__ = ["Rollout", "SamplerCall", "SpecCall", "concat_rollouts", "split_rows", "take_rows"]


@dataclasses.dataclass(frozen=True)
class SpecCall:
    """What a speculative sampler call adds to its `SamplerCall` (`rollout.speculative`).

    The replay runs the call's program with the recorded tokens in place of
    the drafts, so it needs the drafter's static configuration and the shapes
    of its weights, not the weights: zeros of those shapes stand in
    (`rollout.speculative.drafter_stand_in`).

    Attributes:
      spec: the resolved `SpecConfig` (drafter kind, k, ...).
      drafter_cfg: a dense drafter's config, or None (self-speculation).
      drafter_tree: the tree structure of the dense drafter's weights, or None.
      drafter_leaves: ((shape, dtype name), ...) of those weights' leaves.
    """

    spec: SpecConfig
    drafter_cfg: ModelConfig | None = None
    drafter_tree: jax.tree_util.PyTreeDef | None = None
    drafter_leaves: tuple[tuple[tuple[int, ...], str], ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplerCall:
    """The static arguments of one call of the sampler's compiled program (`sampler_program`).

    With the rollout's own static fields (policy, loop spec, decode layout)
    and its width N (`max_new_tokens`), these name the executable that
    sampled a rollout's rows, so that the replay (`rollout.replay`) runs that
    executable again.

    Attributes:
      rows: the program's batch, B (a mesh's padding rows included).
      prompt_width: its prompt slots, P.
      sampling: how it chose tokens.
      eos_id: its end-of-sequence id, or None.
      pad_id: its filler id.
      record: whether it recorded the weight products (`record_products`).
      mesh: the device mesh it ran on, or None (one device): the replay runs
        there, with the weights placed as the sampler held them.
      device: without a mesh, the one device it ran on (None: the default).
      speculative: a speculative sampler's call (`SpecCall`: it ran
        `rollout.speculative`'s program), or None (`sampler_program`).
    """

    rows: int
    prompt_width: int
    sampling: SamplingConfig
    eos_id: int | None
    pad_id: int
    record: bool = False
    mesh: Mesh | None = None
    device: jax.Device | None = None
    speculative: SpecCall | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """A batch of sampled completions, everything the learner needs to replay them.

    Attributes:
      prompt_tokens: [B, P] int32, left-padded with `pad_id`.
      prompt_lengths: [B] int32, real prompt lengths.
      completion_tokens: [B, N] int32; `pad_id` after a sequence has ended.
      completion_mask: [B, N] f32, 1 for generated tokens (up to and including EOS).
      logprobs: [B, N] f32 sampler log-probs of the sampled tokens, after temperature.
      exit_steps: [B, N] int32 0-based loop step at which the forward that
        produced completion token j read out (and, in deferred mode, where its
        input token stopped computing); 0 for dense models.
      loop_evals: [] int32 loop-step evaluations of the decode steps (counted).
      weights_version: [] int32 learner step whose weights sampled this.
      policy: the sampler's precision `Policy` (static); a string is refused where the
        rollout is built, naming `Policy.parse`.
      loop: the `LoopSpec` the rollout was sampled with, resolved (static):
        the learner replays `exit_steps` with it and refuses another.
      temperature: the temperature the log-probs were taken at (static).
      verify_counts: [B, N] int32, speculative rollouts only (else None):
        tokens row b committed at verification i (`rollout.speculative`).
      verify_tokens: tokens per verification chunk, k + 1 (static); 0 for a
        plain rollout (one-token decode steps). The learner's replay re-runs
        these chunks.
      weights_digest: [2] uint32 `numerics.fingerprint.tree_fingerprint` of the
        weights the sampler ran on (`generate` and `speculative_generate` record
        it), or None (unknown). The training program compares it with the
        weights an update computes with: equal, with matched policies, the
        recorded log-probs are the replay's values (`rl.reuse`).
      products: the sampler's weight products and logits
        (`generate(..., record_products=True)`, `models.recorded`), or None.
        The training program hands them to the update that computes with the
        weights that made them, and to no other.
      decode_layout: how the sampler's decode copy of the weights was laid
        out (static; `rollout.step.decode_layout`): the replay unstacks the
        learner's weights the same way, so its sums are the sampler's.
      invariant_form: the `numerics.invariant.InvariantForm` an `invariant` decode
        ran its products in (static; this CPU's, `form_for`, unless `generate` was
        given one), or None: the learner's `invariant` forward runs its products in
        the same form, and refuses one this CPU's products do not hold.
      calls: the sampler calls the rows came from (static; `SamplerCall`),
        one for a rollout of `generate` or `speculative_generate`, several
        for a concatenation; () for a rollout built otherwise.
      call_rows: [B, 2] int32 (call, row within that call) of each row, or
        None (no calls): slices and concatenations keep it, so that any
        row is replayed where the sampler computed it.
      call_keys: [C, ...] the sampling key of each call, or None.
      env_mask: [B, N] f32 1 on tokens an environment wrote (a multi-turn rollout's
        observations, `rollout.multiturn`; their `completion_mask` is 0), or None. Such
        a rollout is replayed by `rollout.multiturn.replay_multiturn`.
    """

    prompt_tokens: jax.Array
    prompt_lengths: jax.Array
    completion_tokens: jax.Array
    completion_mask: jax.Array
    logprobs: jax.Array
    exit_steps: jax.Array
    loop_evals: jax.Array
    weights_version: jax.Array
    policy: Policy = dataclasses.field(default=FP32, metadata={"static": True})
    loop: LoopSpec = dataclasses.field(default=LoopSpec("full", "dense"),
                                       metadata={"static": True})
    temperature: float = dataclasses.field(default=1.0, metadata={"static": True})
    verify_counts: jax.Array | None = None
    verify_tokens: int = dataclasses.field(default=0, metadata={"static": True})
    weights_digest: jax.Array | None = None
    products: Products | None = None
    decode_layout: str = dataclasses.field(default="as_stored", metadata={"static": True})
    invariant_form: InvariantForm | None = dataclasses.field(default=None,
                                                             metadata={"static": True})
    calls: tuple[SamplerCall, ...] = dataclasses.field(default=(), metadata={"static": True})
    call_rows: jax.Array | None = None
    call_keys: jax.Array | None = None
    env_mask: jax.Array | None = None

    # Not per row: replicated where the rows are laid over a mesh (`parallel.batch_shardings`).
    replicated_fields: ClassVar[tuple[str, ...]] = ("weights_digest", "call_keys")

    def __post_init__(self):
        # Here, not in the learner: a string policy would otherwise travel to the GRPO step,
        # which can only say that two policies' texts differ.
        require(self.policy, "Rollout")


_ROW_FIELDS = ("prompt_tokens", "prompt_lengths", "completion_tokens", "completion_mask",
               "logprobs", "exit_steps")


def _row_fields(ro: Rollout) -> tuple[str, ...]:
    """The per-row fields of `ro` (a speculative rollout also has its verification counts, a
    sampled one the rows' places in their sampler calls)."""
    return (_ROW_FIELDS + (() if ro.verify_counts is None else ("verify_counts",))
            + (() if ro.call_rows is None else ("call_rows",))
            + (() if ro.env_mask is None else ("env_mask",)))


def split_rows(ro: Rollout, m: int) -> Rollout:
    """A rollout with a leading micro-batch axis [M, B/M, ...] (scalars broadcast to [M])."""
    b = ro.prompt_tokens.shape[0]
    if b % m:
        raise ValueError(f"batch of {b} sequences does not split into {m} micro-batches")
    rows = {f: getattr(ro, f).reshape(m, b // m, *getattr(ro, f).shape[1:]) for f in _row_fields(ro)}
    each = lambda x: None if x is None else jnp.broadcast_to(x, (m, *x.shape))
    products = None if ro.products is None else split_products(ro.products, m)
    return dataclasses.replace(ro, **rows, loop_evals=each(ro.loop_evals),
                               weights_version=each(ro.weights_version),
                               weights_digest=each(ro.weights_digest),
                               call_keys=each(ro.call_keys), products=products)


def take_rows(ro: Rollout, idx) -> Rollout:
    """The rollout restricted to rows `idx` (a minibatch)."""
    products = None if ro.products is None else take_product_rows(ro.products, idx)
    return dataclasses.replace(ro, **{f: getattr(ro, f)[idx] for f in _row_fields(ro)},
                               products=products)


def concat_rollouts(rollouts: Sequence[Rollout], pad_id: int) -> Rollout:
    """The rows of several rollouts of the same weights as one rollout (dynamic sampling's refill).

    The rollouts must agree on everything that is not per row: the policy,
    loop spec, temperature, verification chunk, decode layout, weights version and weights
    digest (one sampler, one set of weights), and the completion width N (multi-turn
    rollouts, `env_mask` set, are right-padded to the widest: their calls' slots end
    where their episodes did; they are replayed by their own calls,
    `train.episodes.replay_episodes`). Prompts of different bucketed widths are
    left-padded to the widest with `pad_id` (pad slots are never attended to, and
    positions come from
    `prompt_lengths`). `loop_evals` are summed. The recorded log-probs are the
    sampler's, each row as its own call computed it, and the rows keep their
    calls (`Rollout.calls`; dropped where one part has none). Recorded weight
    products are dropped (their grids differ; the learner then computes its
    forward).

    Raises:
      ValueError: no rollouts, or rollouts that disagree on a shared field.
    """
    if not rollouts:
        raise ValueError("concat_rollouts: no rollouts given")
    head = rollouts[0]
    if len(rollouts) == 1:
        return head
    multiturn = {ro.env_mask is not None for ro in rollouts}
    if len(multiturn) > 1:
        raise ValueError("concat_rollouts: a multi-turn rollout (env_mask) and a single-turn one")
    multiturn = multiturn.pop()
    for ro in rollouts[1:]:
        for f in ("policy", "loop", "temperature", "verify_tokens", "decode_layout",
                  "invariant_form"):
            if getattr(ro, f) != getattr(head, f):
                raise ValueError(f"concat_rollouts: rollouts with different {f} "
                                 f"({getattr(head, f)!r} and {getattr(ro, f)!r})")
        if not multiturn and ro.completion_tokens.shape[1] != head.completion_tokens.shape[1]:
            raise ValueError("concat_rollouts: rollouts of different completion widths "
                             f"({head.completion_tokens.shape[1]} and "
                             f"{ro.completion_tokens.shape[1]})")
        if (ro.verify_counts is None) != (head.verify_counts is None):
            raise ValueError("concat_rollouts: a speculative and a plain rollout")
        if int(ro.weights_version) != int(head.weights_version):
            raise ValueError("concat_rollouts: rollouts of different weights versions "
                             f"({int(head.weights_version)} and {int(ro.weights_version)})")
        same = (ro.weights_digest is None and head.weights_digest is None) or (
            ro.weights_digest is not None and head.weights_digest is not None
            and np.array_equal(np.asarray(ro.weights_digest), np.asarray(head.weights_digest)))
        if not same:
            raise ValueError("concat_rollouts: rollouts sampled on different weights "
                             "(their weights_digest differ)")
    width = max(ro.prompt_tokens.shape[1] for ro in rollouts)

    def prompts(ro):
        extra = width - ro.prompt_tokens.shape[1]
        return ro.prompt_tokens if not extra else jnp.pad(
            ro.prompt_tokens, ((0, 0), (extra, 0)), constant_values=pad_id)

    n = max(ro.completion_tokens.shape[1] for ro in rollouts)  # one width unless multi-turn

    def completions(ro, f):  # a multi-turn call's slots end where its episodes did
        x, extra = getattr(ro, f), n - ro.completion_tokens.shape[1]
        return x if not extra else jnp.pad(x, ((0, 0), (0, extra)), constant_values=(
            pad_id if f == "completion_tokens" else 0))

    fields = (_ROW_FIELDS + (() if head.verify_counts is None else ("verify_counts",))
              + (("env_mask",) if multiturn else ()))
    rows = {f: jnp.concatenate([prompts(ro) if f == "prompt_tokens" else
                                getattr(ro, f) if f == "prompt_lengths" else completions(ro, f)
                                for ro in rollouts]) for f in fields}
    calls = dict(calls=(), call_rows=None, call_keys=None)
    if all(ro.call_rows is not None for ro in rollouts):
        offsets = np.cumsum([0] + [len(ro.calls) for ro in rollouts])
        calls = dict(calls=sum((ro.calls for ro in rollouts), ()),
                     call_rows=jnp.concatenate([ro.call_rows + jnp.asarray([o, 0], jnp.int32)
                                                for ro, o in zip(rollouts, offsets[:-1],
                                                                 strict=True)]),
                     call_keys=jnp.concatenate([ro.call_keys for ro in rollouts]))
    return dataclasses.replace(head, **rows, **calls, products=None,
                               loop_evals=sum(ro.loop_evals for ro in rollouts))
