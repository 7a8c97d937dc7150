"""Data across processes: each process reads only the data shards its devices hold.

The batch of a step is split into D data shards (`data` x `fsdp` of the mesh;
D = 1 without one). Data shard d reads every D-th record of the shuffled
stream (`data.pipeline`'s `shard=(d, D)`), so the D shards' k-th batches
together hold exactly the records of the unsharded k-th batch, and the global
batch is the same whether the shards are read by one process or by many.

`ShardedLoader` keeps an iterator per data shard of this process's devices,
and `next_global()` returns the step's whole batch (shard-major) on every
process: what each process read is all-gathered. What is gathered is small
(record indices, padded token ids), and every process then holds the same host
batch: rewards and advantages need no further communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_lp.parallel.mesh import AXES

__all__ = ["ShardedLoader", "data_shard_count", "local_data_shards"]


def data_shard_count(mesh: Mesh | None) -> int:
    """D: how many ways the batch is split (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def local_data_shards(mesh: Mesh | None) -> list[int]:
    """The data shards (0..D-1) that this process's devices hold, ascending."""
    if mesh is None:
        return [0]
    fsdp = mesh.shape["fsdp"]
    coords = np.argwhere(np.vectorize(lambda d: d.process_index == jax.process_index())(
        mesh.devices))
    di, fi = AXES.index("data"), AXES.index("fsdp")
    return sorted({int(c[di]) * fsdp + int(c[fi]) for c in coords})


class ShardedLoader:
    """Iterators over this process's data shards; `next_global()` is the step's global batch.

    Args:
      make: `make(index, count) -> grain.IterDataset` of data shard `index` of
        `count` (a loader built with `shard=(index, count)` and the shard's
        share of the batch).
      mesh: the run's mesh, or None (one shard, one process).
      to_array: one shard's batch as a numpy array (or a tuple of them) of a
        shape every shard shares, for the all-gather.
    """

    def __init__(self, make: Callable[[int, int], Any], mesh: Mesh | None,
                 to_array: Callable[[Any], Any] = np.asarray):
        self.count = data_shard_count(mesh)
        self.local = local_data_shards(mesh)
        self.iters = {d: iter(make(d, self.count)) for d in self.local}
        self.to_array = to_array

    def next_global(self) -> Any:
        """The next global batch: each shard's batch concatenated in shard order."""
        local = {d: self.to_array(next(it)) for d, it in self.iters.items()}
        parts = jax.tree.map(lambda *xs: np.stack(xs), *[local[d] for d in self.local])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            ids = multihost_utils.process_allgather(np.asarray(self.local, np.int32))
            parts = multihost_utils.process_allgather(parts)
            order = {int(d): (p, i) for p, row in enumerate(np.asarray(ids))
                     for i, d in enumerate(row)}
            parts = jax.tree.map(lambda x: np.stack([x[order[d]] for d in range(self.count)]),
                                 parts)
        return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), parts)

    def get_state(self) -> dict:
        """The iterators' position (the shards advance in step, so one state serves all)."""
        return self.iters[self.local[0]].get_state()

    def set_state(self, state: dict) -> None:
        for it in self.iters.values():
            it.set_state(state)
