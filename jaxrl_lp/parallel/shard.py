"""Shardings of whole trees: run state (params, optimizer, exporter), batches, host data.

- `state_shardings(tree, param_sh)`: a leaf that mirrors a parameter (its key
  path ends with the parameter's path and it has the parameter's shape:
  optimizer moments, error-feedback residuals, diagnostics) takes that
  parameter's sharding; every other leaf (step counters, scalars, quantized
  codes) is replicated.
- `batch_shardings(tree, mesh)`: leading axis split over the data shards
  (`data` x `fsdp`), scalars replicated; for rollouts, SFT batches, advantages.
- `put_global(host_array, sharding)`: a global `jax.Array` from a host (numpy)
  array that every process holds in full; each process places only the
  shards its devices own, so it works unchanged across processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules, spec_for

__all__ = ["batch_shardings", "put_global", "put_tree", "replicated", "state_shardings",
           "to_host"]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _path(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def state_shardings(tree: Any, params: Any, param_sh: Any, mesh: Mesh) -> Any:
    """Shardings for `tree` whose parameter-shaped leaves follow `param_sh` (module docstring).

    Args:
      tree: arrays or `ShapeDtypeStruct`s (e.g. an optimizer state).
      params: the params tree `param_sh` belongs to (for shapes and paths).
      param_sh: `NamedSharding`s of `params` (`rules.param_shardings`).
      mesh: the mesh (for the replicated leaves).
    """
    by_path = {}
    for (path, p), sh in zip(jax.tree_util.tree_leaves_with_path(params),
                             jax.tree.leaves(param_sh), strict=True):
        by_path[_path(path)] = (tuple(np.shape(p)), sh)
    rep = replicated(mesh)

    def pick(path, leaf):
        keys = _path(path)
        for n in range(len(keys), 0, -1):
            hit = by_path.get(keys[-n:])
            if hit is not None and hit[0] == tuple(np.shape(leaf)):
                return hit[1]
        return rep

    return jax.tree_util.tree_map_with_path(pick, tree)


def batch_shardings(tree: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """Leading axis over the data shards for every array leaf of rank >= 1; scalars replicated.

    A dataclass tree may name fields that are not per row in a `replicated_fields`
    class attribute (a rollout's weights fingerprint): those are replicated.
    """

    def pick(leaf):
        nd = np.ndim(leaf)
        if nd == 0:
            return replicated(mesh)
        return NamedSharding(mesh, spec_for(("batch",) + (None,) * (nd - 1), rules, mesh))

    out = jax.tree.map(pick, tree)
    whole = [f for f in getattr(tree, "replicated_fields", ()) if getattr(tree, f) is not None]
    return dataclasses.replace(out, **{f: replicated(mesh) for f in whole}) if whole else out


def put_global(host: Any, sharding: NamedSharding) -> jax.Array:
    """A global array of `sharding` from `host`, the full value every process holds."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def put_tree(tree: Any, shardings: Any) -> Any:
    """`put_global` over a tree (leaves already on device are resharded with `device_put`,
    except a process's local array bound for a sharding over several processes: that one
    goes through the host, as every process holds the full value)."""

    def put(x, sh):
        local_to_global = (isinstance(x, jax.Array) and x.is_fully_addressable
                           and not sh.is_fully_addressable)
        if isinstance(x, jax.Array) and not local_to_global:  # on devices already: reshard
            return jax.device_put(x, sh)
        return put_global(x, sh)

    return jax.tree.map(put, tree, shardings)


def to_host(x: Any) -> np.ndarray:
    """The whole value of `x` on this host: `np.asarray` when this process holds it all,
    else an all-gather of every process's shards (small arrays only: tokens, rewards)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
