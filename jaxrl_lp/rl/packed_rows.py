"""How many rows a packed learner forward computes, decided on the host (`models.packing`).

The packed forward (`rl.logprobs.packed_logprobs`) takes static row counts:
these functions read them from a batch's masks, rounded up to a few bucket
sizes so a run compiles for a few shapes only, and say how many packing
groups a mesh's data shards split the rows into. Re-exported by
`rl.logprobs`.
"""

from __future__ import annotations

import math

import numpy as np
from jax.sharding import Mesh

from jaxrl_lp.models.packing import bucket_rows
from jaxrl_lp.parallel.context import current_mesh
from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules
from jaxrl_lp.parallel.shard import to_host
from jaxrl_lp.rollout.generate import Rollout

__all__ = ["PACK_BUCKETS", "pack_groups", "packed_rows_for", "packed_rows_of"]

PACK_BUCKETS = 16  # sizes a packed learner step compiles for, per grid (`packed_rows_of`)


def pack_groups(rows: int, mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES) -> int:
    """How many groups a packed forward of `rows` rows packs apart (`models.packing`).

    The data shards of the batch (the `batch` axis's mesh axes) of `mesh`, by
    default the active `use_mesh`'s, so each device packs and computes its own
    rows; 1 without a mesh, or where the shards do not divide `rows` (the
    packing then spans the shards: the same values, with collectives). The
    host (`packed_rows_of`) and the traced forward ask with the same rows and
    mesh, so they agree.
    """
    if mesh is None:
        active = current_mesh()
        if active is None:
            return 1
        mesh, rules = active
    shards = math.prod(mesh.shape[a] for a in rules.mesh_axes("batch"))
    return shards if rows % shards == 0 else 1


def packed_rows_for(lead_lengths_B, mask_BxN, lead_width: int, *, micro_batches: int = 1,
                    buckets: int = PACK_BUCKETS, groups: int = 1) -> tuple[int, int]:
    """The static `packed_rows` of `packed_logprobs` for host arrays (numpy).

    (body, head): the most real slots (lead tokens, and targets up to the last
    masked one) and masked targets of any of the `micro_batches` row slices
    (each split further into its `groups` packing groups, `pack_groups`),
    each rounded up by `models.packing.bucket_rows` to one of `buckets`
    sizes, so a run compiles for a few shapes only.
    """
    mask = np.asarray(mask_BxN) > 0
    b, n = mask.shape
    slices = micro_batches * groups
    if b % slices:
        raise ValueError(f"packed rows: {b} rows do not split into {micro_batches} slices"
                         + ("" if groups == 1 else f" of {groups} packing groups"))
    per = b // slices
    done = mask.sum(axis=1).reshape(slices, per).sum(axis=1)
    context = np.where(mask.any(axis=1), n - np.argmax(mask[:, ::-1], axis=1), 0)  # to the last
    real = (context + np.asarray(lead_lengths_B)).reshape(slices, per).sum(axis=1)
    return (bucket_rows(int(real.max()), per * (lead_width + n), buckets),
            bucket_rows(int(done.max()), per * n, buckets))


def packed_rows_of(ro: Rollout, *, micro_batches: int = 1, buckets: int = PACK_BUCKETS,
                   groups: int = 1) -> tuple[int, int]:
    """The static `packed_rows` of `dense_logprobs` for `ro` (`packed_rows_for`; reads its
    masks on the host, gathered from every process)."""
    return packed_rows_for(to_host(ro.prompt_lengths), to_host(ro.completion_mask),
                           ro.prompt_tokens.shape[1], micro_batches=micro_batches,
                           buckets=buckets, groups=groups)
