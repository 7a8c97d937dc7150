"""Activation sharding: `constrain(x, logical_axes)` inside programs traced under `use_mesh`.

The model code marks its activations with logical axis names (the residual
stream `("batch", "sequence", "hidden")`, queries `(..., "heads", "head_dim")`,
the KV cache, logits). Outside a `use_mesh` block `constrain` returns its input
unchanged, so a single-device program is exactly what it was; inside one, it
pins the value to the sharding the rules give it, which makes XLA's SPMD
partitioner shard activations along the batch and heads and gather FSDP
weights per layer, rather than guess.

`use_mesh` must be active while a function is *traced*: the jitted step
builders (`rl.train_step`, `rollout.generate`) enter it inside the function
they jit.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from jax.sharding import Mesh, NamedSharding

from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules, param_logical_axes, spec_for

__all__ = ["constrain", "constrain_params", "current_mesh", "use_mesh"]

_ACTIVE: contextvars.ContextVar[tuple[Mesh, ShardingRules] | None] = contextvars.ContextVar(
    "jaxrl_lp_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: ShardingRules = DEFAULT_RULES) -> Iterator[None]:
    """Within the block, `constrain` shards activations on `mesh` (no-op for None)."""
    token = _ACTIVE.set(None if mesh is None else (mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_mesh() -> tuple[Mesh, ShardingRules] | None:
    """The `(mesh, rules)` of the enclosing `use_mesh`, or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """`x` with the sharding of `logical_axes` under the active mesh (unchanged without one).

    Leading dimensions beyond `logical_axes` (a stacked layer or loop-step
    axis) are replicated.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    lead = (None,) * (x.ndim - len(logical_axes))
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, spec_for((*lead, *logical_axes), rules, mesh)))


def constrain_params(tree):
    """A params-shaped tree (gradients, accumulators) sharded like the parameters.

    Under a mesh no gradient is then whole on one device; without one it is
    returned unchanged.
    """
    if _ACTIVE.get() is None:
        return tree
    return jax.tree.map(lambda axes, x: constrain(x, axes), param_logical_axes(tree), tree,
                        is_leaf=lambda x: isinstance(x, tuple))
