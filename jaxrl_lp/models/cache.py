"""The preallocated KV cache: one slot per (layer) for dense models, per (loop step, layer) for looped.

A cache is a plain dict pytree:
  `k`, `v`: `[R, L, B, K, S, Dh]` for looped models (R loop steps), `[L, B, K, S, Dh]`
    for dense ones (K key/value heads, S slots: heads first, so each head's slots
    are contiguous and attention reads them without a transpose), stored in the
    policy's carrier dtype (exact: the values are already rounded to compute
    precision).
  `pos`: `[B, S]` int32, the position held in each slot, -1 where the slot is
    empty or holds padding (never attended to).
Writing a chunk of T tokens at slot `index` fills `[index, index + T)`.

For decoding with unstacked layers (`unstack_layers`), `unstack_cache` splits
`k` and `v` into tuples of per-layer buffers (`[R, B, K, S, Dh]` or
`[B, K, S, Dh]`), each written and read in place: a slice of one layer out of
a stacked cache is a copy on every decode step on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.numerics.policy import Policy, require
from jaxrl_lp.parallel.context import constrain

__all__ = ["init_cache", "unstack_cache", "write_positions"]


def init_cache(cfg: ModelConfig, policy: Policy, batch: int, max_len: int) -> dict:
    """An empty cache for `batch` sequences of up to `max_len` tokens."""
    policy = require(policy, "init_cache")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"cache length {max_len} exceeds the model's context "
            f"(max_position_embeddings={cfg.max_position_embeddings}); shorten the prompt or "
            "the number of new tokens"
        )
    lead = (cfg.loop_steps, cfg.num_layers) if cfg.is_looped else (cfg.num_layers,)
    shape = (*lead, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    kv = ("batch", "kv_heads", "cache_slots", "head_dim")  # leading layer/step axes whole
    return {
        "k": constrain(jnp.zeros(shape, policy.carrier_dtype), kv),
        "v": constrain(jnp.zeros(shape, policy.carrier_dtype), kv),
        "pos": constrain(jnp.full((batch, max_len), -1, jnp.int32), ("batch", "cache_slots")),
    }


def write_positions(cache: dict, positions_BxT: jax.Array, index: jax.Array) -> dict:
    """Records the positions of a chunk written at slot `index` (padding keeps -1)."""
    pos = jax.lax.dynamic_update_slice(
        cache["pos"], positions_BxT.astype(jnp.int32), (jnp.zeros((), jnp.int32), index)
    )
    return {**cache, "pos": pos}


def unstack_cache(cache: dict, cfg: ModelConfig) -> dict:
    """`cache` with `k` and `v` as tuples of per-layer buffers (use with `unstack_layers`)."""
    if isinstance(cache["k"], tuple):
        return cache
    axis = 1 if cfg.is_looped else 0
    split = lambda x: tuple(jnp.moveaxis(x, axis, 0))
    return {**cache, "k": split(cache["k"]), "v": split(cache["v"])}
