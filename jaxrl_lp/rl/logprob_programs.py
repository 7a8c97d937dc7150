"""The learner's log-probs as jitted programs: `jit_learner_logprobs` and `LogprobProgram`.

A run takes the learner's values of a whole batch (the behaviour log-probs
before the updates, a verification's check, the KL reference's) with no
gradient: `jit_learner_logprobs(cfg, policy, method)` returns the program for
`method` (`rl.logprobs` says what each computes): the sampler's own program
with the tokens forced for `replay` and `hybrid` (`rollout.replay.ReplayProgram`),
a jitted forward for `dense` and `invariant` (`LogprobProgram`), micro-batched
and packed as the learner step runs its rows.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.invariant import COMPILER_OPTIONS as INVARIANT_OPTIONS
from jaxrl_lp.numerics.invariant import InvariantForm
from jaxrl_lp.numerics.invariant import unsupported as invariant_unsupported
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.parallel.context import use_mesh
from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules
from jaxrl_lp.rl.logprobs import LOGPROB_METHODS, LogprobMethod, learner_logprobs
from jaxrl_lp.rl.packed_rows import PACK_BUCKETS, pack_groups, packed_rows_of
from jaxrl_lp.rollout.generate import Rollout, split_rows
from jaxrl_lp.rollout.replay import ReplayProgram
from jaxrl_lp.rollout.step import LoopSpec

__all__ = ["LogprobProgram", "jit_learner_logprobs"]


class LogprobProgram:
    """`fn(params, rollout) -> log-probs [B, N]`, jitted (`jit_learner_logprobs` returns one).

    A packed program (`packs`) reads its static `packed_rows` from the
    rollout's masks on the host (`rows_of`, waiting for the sampler), one
    compilation per bucket, as a packed `LearnerStep` does; otherwise it is
    `jax.jit(fn)`. Nothing is donated.

    Args:
      fn: the untraced `fn(params, rollout, packed_rows=None)`.
      rows_of: `rows_of(rollout) -> packed_rows` (host-side), or None.
      compiler_options: XLA options of the jit (the `invariant` method's,
        `numerics.invariant.COMPILER_OPTIONS`), or None.
    """

    def __init__(self, fn, rows_of=None, compiler_options: dict | None = None):
        self.fn, self.rows_of, self.compiler_options = fn, rows_of, compiler_options
        self._jitted = jax.jit(fn, static_argnames=("packed_rows",),
                               compiler_options=compiler_options)

    @property
    def packs(self) -> bool:
        """Whether the program reads `packed_rows` from its rollout."""
        return self.rows_of is not None

    def with_packed_rows(self, packed_rows) -> LogprobProgram:
        """This packed program at fixed `packed_rows`, for abstract rollouts (whose masks
        cannot be read): e.g. the planner builds the largest bucket."""
        if not self.packs:
            raise ValueError("with_packed_rows: this program packs no rows")
        return LogprobProgram(self.fn, lambda _: packed_rows, self.compiler_options)

    def _static(self, ro) -> dict:
        return {"packed_rows": self.rows_of(ro)} if self.packs else {}

    def __call__(self, params, ro: Rollout) -> jax.Array:
        return self._jitted(params, ro, **self._static(ro))

    def trace(self, params, ro):
        """`jax.jit(...).trace` on `(params, ro)` (arrays or `jax.ShapeDtypeStruct`)."""
        return self._jitted.trace(params, ro, **self._static(ro))

    def lower(self, params, ro):
        """`jax.jit(...).lower` on `(params, ro)`."""
        return self._jitted.lower(params, ro, **self._static(ro))

    def _cache_size(self) -> int:
        return self._jitted._cache_size()


def jit_learner_logprobs(cfg: ModelConfig, policy: Policy, method: LogprobMethod = "hybrid", *,
                         loop: LoopSpec | None = None, mesh: Mesh | None = None,
                         rules: ShardingRules = DEFAULT_RULES, micro_batches: int = 1,
                         pack_buckets: int = PACK_BUCKETS,
                         form: InvariantForm | None = None) -> LogprobProgram | ReplayProgram:
    """`fn(params, rollout) -> log-probs [B, N]`, the learner's values (no gradient).

    `replay` and `hybrid` (whose value is the replay's: the dense part adds
    exactly 0.0 and only carries the gradient) return a `ReplayProgram`: the
    sampler's own compiled program rerun with the rollout's tokens forced, at
    the shape of the sampler's calls (`rollout.replay.replay_logprobs`), so
    each row's values are the sampler's computation whatever rows the rollout
    holds. `micro_batches` does not apply to it: it runs at the sampler's
    shape and memory.

    `invariant` returns a `LogprobProgram` as `dense` does, jitted with
    `numerics.invariant.COMPILER_OPTIONS`: its values are the sampler's
    computation bit for bit (the rollout's recorded log-probs under its weights),
    whatever slice or micro-batch it is given. Where the invariant forms are not
    proven (`numerics.invariant.unsupported`: another platform, a mesh) it is
    the `hybrid`'s `ReplayProgram`, which is exact there; `form`, the form the
    rollouts were sampled in, names fixed tiles (`InvariantForm.tiles`) where
    they are asked for by name, on a GPU or TPU.

    `dense` returns a `LogprobProgram` (jitted). With `micro_batches` > 1 the
    rows are taken in that many slices one after the other (`lax.map`), so the
    logits exist for one slice at a time. It skips the padding as the learner
    step's dense forward does (`dense_logprobs`' `packed_rows`, one of
    `pack_buckets` sizes per slice, read from the rollout's masks on the
    host: a `LogprobProgram` that `packs`; 0 computes every slot). Its values
    are then the learner step's forward's, up to the rounding of the step's
    own program. The rollout's static fields (loop spec, policy, temperature)
    are static for the jit, and so are a packed program's row counts.

    With `mesh` the programs run under `use_mesh`: the replay then runs the
    sampler's program with the sampler's shardings (bit-equal to a sampler on
    the same mesh), and a packed forward packs each data shard's rows apart
    (`pack_groups`). Nothing is donated. Called by the training program for
    the behaviour log-probs and its verifications, and by the tests.
    """
    policy = require(policy, "jit_learner_logprobs")
    if method == "invariant" and invariant_unsupported(mesh=mesh, form=form) is not None:
        method = "hybrid"  # the forms are not proven here: the replay, exact
    if method in ("replay", "hybrid"):
        return ReplayProgram(cfg, policy, loop=loop, mesh=mesh, rules=rules)
    if method not in ("dense", "invariant"):
        raise ValueError(f"log-prob method must be one of {LOGPROB_METHODS}; got {method!r}")

    def one(params, ro, rows):
        return learner_logprobs(params, cfg, policy, ro, method, loop=loop, packed_rows=rows)[0]

    def fn(params, ro, packed_rows=None):
        with use_mesh(mesh, rules):
            if micro_batches == 1:
                return one(params, ro, packed_rows)
            lp = jax.lax.map(lambda mb: one(params, mb, packed_rows),
                             split_rows(ro, micro_batches))
            return lp.reshape(ro.logprobs.shape)

    def rows_of(ro):
        groups = pack_groups(ro.prompt_tokens.shape[0] // micro_batches, mesh, rules)
        return packed_rows_of(ro, micro_batches=micro_batches, buckets=pack_buckets,
                              groups=groups)

    return LogprobProgram(fn, rows_of if pack_buckets > 0 else None,
                          INVARIANT_OPTIONS if method == "invariant" else None)
