"""`LearnerStep`: the jitted learner update that `make_grpo_step` and `make_sft_step` return.

One kind of object whatever the builder's options; it holds the untraced
step function `fn(params, opt_state, *batch, packed_rows=None)` and jits it
one of three ways:

- on one device: `jax.jit(fn)`;
- on a mesh: a jit with explicit in- and out-shardings by argument kind
  (`kinds`, below), traced under `parallel.use_mesh` so activations follow
  the rules too;
- either of them packed (`rows_of` given, `pack_buckets > 0`): with the
  static `packed_rows` that `rows_of(*batch)` reads from the batch's masks
  on the host (for a rollout, waiting for the sampler), so one compilation
  per bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.parallel.context import use_mesh
from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules, param_shardings
from jaxrl_lp.parallel.shard import batch_shardings, replicated, state_shardings

__all__ = ["LearnerStep"]

KINDS = ("params", "state", "batch")


class LearnerStep:
    """A learner update, jitted: `step(params, opt_state, *batch) -> (params, opt_state, metrics)`.

    Donated: `params` and `opt_state` (arguments 0 and 1); pass copies to keep
    them. Static (each value compiles a program of its own): the static fields
    of pytree arguments (a rollout's policy, loop spec and temperature), which
    of the optional arguments are None, and a packed step's `packed_rows`
    (`rows_of`, one per bucket). Everything else is traced; a second call with
    arguments of the same shapes reuses the compiled program.

    Each positional argument has a kind (`kinds`, one per argument the step
    takes, which also bounds how many it takes): `params` (on a mesh: the
    rules' parameter shardings), `state` (leaves that mirror a parameter take
    its sharding, others are replicated: optimizer moments,
    `parallel.state_shardings`) or `batch` (rows over the data shards). On a
    mesh the outputs keep the parameter and state shardings and the metrics
    are replicated. Arguments left off take the step's defaults (None).

    Traced by: `__call__` (the training program, the studies, `bench smoke`,
    the tests), `lower` (`bench learner`, the packing and replay tests) and
    `trace` (`plan.programs` via `kernels.lowering.trace_for`, and the
    planner, which compiles the mesh program on abstract arguments).

    Args:
      fn: the untraced step, `fn(params, opt_state, *batch, packed_rows=None)`.
      kinds: the kind of each positional argument of `fn` (`params`, `state`,
        `batch`).
      rows_of: `rows_of(*batch) -> packed_rows` (host-side; a packed step, on
        one device or a mesh), or None.
      mesh: run on `mesh`: parameter shardings of `cfg` by `rules`.
      cfg: the model whose parameter shardings `mesh` takes.
      rules: the sharding rules giving those shardings.
      prepare: `prepare(args) -> args`, run on the host before each call
        (not by `trace` or `lower`): what the update needs computed by other
        compiled programs first (the hybrid GRPO step's replay value,
        `make_grpo_step`), or None.
      compiler_options: XLA options of the jit (the `invariant` GRPO step's,
        `numerics.invariant.COMPILER_OPTIONS`), or None.

    Examples:
      >>> step = make_grpo_step(cfg, policy, LossConfig(), optax.adam(1e-6))
      >>> params, opt_state, metrics = step(params, opt_state, ro, adv_B, ro.logprobs)
      >>> compiled = step.lower(params, opt_state, ro, adv_B, ro.logprobs).compile()
    """

    def __init__(self, fn: Callable, kinds: tuple[str, ...], *,
                 rows_of: Callable[..., Any] | None = None, mesh: Mesh | None = None,
                 cfg: ModelConfig | None = None, rules: ShardingRules = DEFAULT_RULES,
                 prepare: Callable[[tuple], tuple] | None = None,
                 compiler_options: dict | None = None):
        if bad := [k for k in kinds if k not in KINDS]:
            raise ValueError(f"LearnerStep kinds must be among {KINDS}; got {bad}")
        if mesh is not None and cfg is None:
            raise ValueError("LearnerStep: a mesh step needs the model's cfg (its parameter "
                             "shardings)")
        self.fn, self.kinds, self.rows_of = fn, tuple(kinds), rows_of
        self.mesh, self.cfg, self.rules = mesh, cfg, rules
        self.prepare, self.compiler_options = prepare, compiler_options
        # By which arguments are None: each pattern is a program of its own (on a mesh its
        # in-shardings differ; there also by row count). Values: (in-shardings or None, the
        # jitted function).
        self._programs: dict[tuple[bool, ...], tuple[Any, Any]] = {}

    @property
    def packs(self) -> bool:
        """Whether the step reads `packed_rows` from its batch (a packed step)."""
        return self.rows_of is not None

    def with_packed_rows(self, packed_rows) -> LearnerStep:
        """This packed step at fixed `packed_rows`, for abstract arguments (whose masks
        cannot be read): e.g. `plan.programs` builds the largest bucket."""
        if not self.packs:
            raise ValueError("with_packed_rows: this step packs no rows")
        return LearnerStep(self.fn, self.kinds, rows_of=lambda *_: packed_rows, mesh=self.mesh,
                           cfg=self.cfg, rules=self.rules, prepare=self.prepare,
                           compiler_options=self.compiler_options)

    def shardings(self, *args):
        """The in-shardings of `args` (by kind) and the out-shardings of the step (mesh only)."""
        self._check(args)
        if self.mesh is None:
            raise ValueError("LearnerStep.shardings: this step runs on one device (no mesh)")
        params = args[0]
        param_sh = param_shardings(params, self.cfg, self.mesh, self.rules)
        by_kind = {
            "params": lambda x: param_sh if x is not None else None,
            "state": lambda x: state_shardings(x, params, param_sh, self.mesh),
            "batch": lambda x: None if x is None else batch_shardings(x, self.mesh, self.rules),
        }
        # Arguments left off are the step's defaults (None): placed as None.
        ins = tuple(by_kind[k](a) for k, a in zip(self.kinds[:len(args)], args, strict=True))
        return ins, (ins[0], ins[1], replicated(self.mesh))

    def _check(self, args) -> None:
        """Raises TypeError for more arguments than the step has kinds for (none is dropped)."""
        if len(args) > len(self.kinds):
            raise TypeError(f"this step takes at most {len(self.kinds)} arguments "
                            f"({', '.join(self.kinds)}); got {len(args)}")

    def _program(self, args) -> tuple[Any, Any, dict]:
        """(in-shardings or None, the jitted step, the static keyword arguments to call it with)."""
        self._check(args)
        static = self._static(args)
        pattern = tuple(a is None for a in args)
        if self.mesh is None:
            if pattern not in self._programs:
                self._programs[pattern] = None, jax.jit(
                    self.fn, donate_argnums=(0, 1), static_argnames=("packed_rows",),
                    compiler_options=self.compiler_options)
            return (*self._programs[pattern], static)
        # A jit with in-shardings takes no keyword arguments: on a mesh each row count is a
        # program of its own, with the count bound.
        key = (pattern, static.get("packed_rows"))
        if key not in self._programs:
            self._programs[key] = self._mesh_jit(args, static)
        return (*self._programs[key], {})

    def _mesh_jit(self, args, static: dict) -> tuple[Any, Any]:
        ins, outs = self.shardings(*args)

        def traced(*a):
            with use_mesh(self.mesh, self.rules):
                return self.fn(*a, **static)

        return ins, jax.jit(traced, in_shardings=ins, out_shardings=outs, donate_argnums=(0, 1),
                            compiler_options=self.compiler_options)

    def _static(self, args) -> dict:
        return {"packed_rows": self.rows_of(*args[2:])} if self.packs else {}

    def __call__(self, *args):
        """One update: `(params, opt_state, metrics)`, metrics a dict of f32 scalars."""
        if self.prepare is not None:
            args = self.prepare(args)
        ins, jitted, static = self._program(args)
        if ins is not None:
            # Inputs placed as the program expects (a no-op for those already there; rows
            # sliced out of a sharded rollout, host arrays).
            args = tuple(a if sh is None else jax.device_put(a, sh)
                         for a, sh in zip(args, ins, strict=True))
        return jitted(*args, **static)

    def trace(self, *args):
        """`jax.jit(...).trace` of the update on `args` (arrays or `jax.ShapeDtypeStruct`)."""
        _, jitted, static = self._program(args)
        return jitted.trace(*args, **static)

    def lower(self, *args):
        """`jax.jit(...).lower` of the update on `args`; `.compile()` it for XLA's figures."""
        _, jitted, static = self._program(args)
        return jitted.lower(*args, **static)

    def _cache_size(self) -> int:
        """Compiled programs so far, over every pattern (as `jax.jit`'s `_cache_size`)."""
        return sum(jitted._cache_size() for _, jitted in self._programs.values())
