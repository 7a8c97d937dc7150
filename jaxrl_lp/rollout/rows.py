"""A forward whose rows write their chunks at different cache slots (for speculative rollouts).

`models.model.forward` writes a chunk at one cache slot shared by every row,
which suits plain decoding (row b's token j always sits at slot P + j - 1).
In speculative decoding the rows accept different numbers of drafted tokens,
so after the first verification their next chunks start at different slots.
`rowwise_forward` runs the same `forward` per row (`jax.vmap` over the batch,
a unit batch axis inside) with a per-row slot: the arithmetic of each row is
the one `forward` performs, and the cache write becomes a per-row scatter.
A single row (B = 1) skips the vmap: its slot is a scalar, so `forward`
writes it in place (`dynamic_update_slice`), as plain decoding does (a
cheaper batch-1 speculative round on CPU: docs/design/speculative.md, "Where
the time goes"). A row's bits are
not the same across batch sizes (XLA picks other kernels for other shapes:
the prefill alone already differs in the last bit between B = 1 and B = 2),
so the replay runs the sampler's program at the sampler's batch size
(`rollout.speculative.speculative_program`).

Attention over the cache is by positions (a slot is visible when its position
is >= 0 and <= the query's), never by slot order, so where a row's chunk sits
does not change what it computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.loop import ExitSchedule, LoopSpec
from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics.policy import Policy

__all__ = ["cache_bytes", "put_chunk", "rowwise_forward", "take_chunk"]


def _cache_axes(cache: dict, looped: bool) -> dict:
    """vmap axes of an unstacked cache: the batch axis of each per-layer buffer and of `pos`."""
    ax = 1 if looped else 0  # per-layer buffers: [R, B, K, S, Dh] or [B, K, S, Dh]
    return {"k": tuple(ax for _ in cache["k"]), "v": tuple(ax for _ in cache["v"]), "pos": 0}


def rowwise_forward(params, cfg: ModelConfig, policy: Policy, tokens_BxT, positions_BxT,
                    cache: dict, index_B, *, loop: LoopSpec | None = None, depth_BxT=None,
                    forced_B=None, hidden: bool = False):
    """`forward` over a per-layer (`unstack_cache`) cache, row b's chunk at slots `index_B[b] + [0, T)`.

    Not jitted itself (traced inside the speculative sampler and its replay).

    Args:
      params: unstacked parameters (`unstack_layers`).
      cfg, policy: the model and its numerics (static for the caller's jit).
      tokens_BxT, positions_BxT: the chunk and its positions.
      cache: an unstacked cache (`unstack_cache`).
      index_B: int32 first slot of each row's chunk.
      loop: a looped model's exit rule and compute mode (`dense` only here).
      depth_BxT: a recorded exit schedule to replay instead of the rule.
      forced_B: bool [B], the rows `depth_BxT` applies to (the rule decides the
        others); None: every row.
      hidden: return the final hidden state (fused log-prob read-out).

    Returns:
      (logits [B, T, V] or hidden [B, T, D], the cache, exit steps [B, T] int32).
    """
    looped = cfg.is_looped
    if not looped or depth_BxT is None:
        depth_BxT = forced_B = None
    elif forced_B is not None:
        forced_B = jnp.broadcast_to(forced_B[:, None], depth_BxT.shape)
    if tokens_BxT.shape[0] == 1:
        sched = None if depth_BxT is None else ExitSchedule(depth_BxT=depth_BxT,
                                                            forced_BxT=forced_B)
        out, cache, lo = forward(params, cfg, policy, tokens_BxT, positions_BxT, cache,
                                 index_B[0], loop=loop if looped else None, schedule=sched,
                                 hidden=hidden)
        exits = lo.exit_steps if looped else jnp.zeros(tokens_BxT.shape, jnp.int32)
        return out, cache, exits
    ax = 1 if looped else 0
    axes = _cache_axes(cache, looped)

    def one(tok_T, pos_T, c, i, depth_T, forced_T):
        c1 = {"k": tuple(jnp.expand_dims(x, ax) for x in c["k"]),
              "v": tuple(jnp.expand_dims(x, ax) for x in c["v"]), "pos": c["pos"][None]}
        sched = None
        if depth_T is not None:
            sched = ExitSchedule(depth_BxT=depth_T[None],
                                 forced_BxT=None if forced_T is None else forced_T[None])
        out, c1, lo = forward(params, cfg, policy, tok_T[None], pos_T[None], c1, i,
                              loop=loop if looped else None, schedule=sched, hidden=hidden)
        c = {"k": tuple(jnp.squeeze(x, ax) for x in c1["k"]),
             "v": tuple(jnp.squeeze(x, ax) for x in c1["v"]), "pos": c1["pos"][0]}
        exits = lo.exit_steps[0] if looped else jnp.zeros(tok_T.shape, jnp.int32)
        return out[0], c, exits

    rows = tuple(None if x is None else 0 for x in (depth_BxT, forced_B))
    return jax.vmap(one, in_axes=(0, 0, axes, 0, *rows),
                    out_axes=(0, axes, 0))(tokens_BxT, positions_BxT, cache, index_B, depth_BxT,
                                           forced_B)


def take_chunk(x_BxS: jax.Array, start_B: jax.Array, length: int) -> jax.Array:
    """`x[b, start_B[b] : start_B[b] + length]` for every row (starts must fit)."""
    if x_BxS.shape[0] == 1:  # one row: a slice, not a gather
        return jax.lax.dynamic_slice(x_BxS, (jnp.zeros((), start_B.dtype), start_B[0]),
                                     (1, length))
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (length,)))(x_BxS, start_B)


def put_chunk(x_BxS: jax.Array, chunk_BxT: jax.Array, start_B: jax.Array) -> jax.Array:
    """`x[b, start_B[b] : start_B[b] + T] = chunk[b]` for every row (starts must fit)."""
    if x_BxS.shape[0] == 1:  # one row: an in-place update, not a scatter
        return jax.lax.dynamic_update_slice(x_BxS, chunk_BxT.astype(x_BxS.dtype),
                                            (jnp.zeros((), start_B.dtype), start_B[0]))
    return jax.vmap(lambda row, c, s: jax.lax.dynamic_update_slice(row, c, (s,)))(
        x_BxS, chunk_BxT.astype(x_BxS.dtype), start_B)


def cache_bytes(cache: dict) -> int:
    """Bytes held by a KV cache pytree (keys, values and slot positions)."""
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(cache)))
