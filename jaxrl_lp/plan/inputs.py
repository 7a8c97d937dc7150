"""Abstract inputs of the GRPO step and the decode step: shapes, dtypes and shardings, no data.

Every value here is a `jax.ShapeDtypeStruct` carrying the `NamedSharding` the
training program gives the real array, so `jit(...).lower(*inputs)` compiles
exactly the sharded program a run compiles, at full size, without allocating
it. `per_device_bytes(tree)` is what one device holds of such a tree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_lp.models.cache import init_cache, unstack_cache
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.model import init_params
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.parallel.rules import DEFAULT_RULES, ShardingRules, param_shardings, spec_for
from jaxrl_lp.parallel.shard import batch_shardings, replicated, state_shardings
from jaxrl_lp.rollout.generate import Rollout
from jaxrl_lp.rollout.step import LoopSpec

__all__ = ["abstract", "abstract_cache", "abstract_params", "abstract_rollout", "abstract_rows",
           "abstract_state", "per_device_bytes", "unstacked_shardings"]


def abstract(tree: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s of `tree`'s leaves (arrays or structs) with `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s (the largest shard)."""
    return int(sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def abstract_params(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """The f32 master parameters (stacked layers) sharded by the rules, and their shardings.

    Raises:
      ValueError: a sharded dimension does not divide by its mesh axes.
    """
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    sh = param_shardings(shapes, cfg, mesh, rules)
    return abstract(shapes, sh), sh


def abstract_state(init_fn, params, param_sh, mesh: Mesh):
    """The state `init_fn(params)` makes (an optimizer's), its moments sharded like the params."""
    shapes = jax.eval_shape(init_fn, params)
    return abstract(shapes, state_shardings(shapes, params, param_sh, mesh))


def abstract_rollout(rows: int, prompt_len: int, max_new: int, policy: Policy, loop: LoopSpec,
                     temperature: float, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """A `Rollout` of `rows` sequences (P prompt + N completion slots), rows over the data shards."""
    i32, f32 = jnp.int32, jnp.float32
    s = jax.ShapeDtypeStruct
    ro = Rollout(
        prompt_tokens=s((rows, prompt_len), i32), prompt_lengths=s((rows,), i32),
        completion_tokens=s((rows, max_new), i32), completion_mask=s((rows, max_new), f32),
        logprobs=s((rows, max_new), f32), exit_steps=s((rows, max_new), i32),
        loop_evals=s((), i32), weights_version=s((), i32),
        policy=policy, loop=loop, temperature=temperature)
    return abstract(ro, batch_shardings(ro, mesh, rules))


def unstacked_shardings(param_sh: dict, num_layers: int) -> dict:
    """Shardings of `unstack_layers(params)`: each layer's, without the leading layer axis."""
    drop = lambda s: NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]))
    layer = jax.tree.map(drop, param_sh["layers"])
    return {**param_sh, "layers": tuple(layer for _ in range(num_layers))}


def abstract_cache(cfg: ModelConfig, policy: Policy, batch: int, slots: int, mesh: Mesh,
                   rules: ShardingRules = DEFAULT_RULES, *, unstacked: bool = True) -> dict:
    """The sampler's KV cache for `batch` sequences of `slots` slots, sharded by batch and KV heads.

    With `unstacked`, one buffer per layer (`unstack_cache`), as the sampler
    decodes; leading layer and loop-step axes are whole on every device.
    """
    def build():
        cache = init_cache(cfg, policy, batch, slots)
        return unstack_cache(cache, cfg) if unstacked else cache

    shapes = jax.eval_shape(build)
    kv = lambda x: NamedSharding(mesh, spec_for(
        (None,) * (x.ndim - 4) + ("batch", "kv_heads", "cache_slots", "head_dim"), rules, mesh))
    sh = {"k": jax.tree.map(kv, shapes["k"]), "v": jax.tree.map(kv, shapes["v"]),
          "pos": NamedSharding(mesh, spec_for(("batch", "cache_slots"), rules, mesh))}
    return abstract(shapes, sh)


def abstract_rows(shape: tuple[int, ...], dtype, mesh: Mesh,
                  rules: ShardingRules = DEFAULT_RULES) -> jax.ShapeDtypeStruct:
    """One batch-major array (rows over the data shards; a scalar is replicated)."""
    x = jax.ShapeDtypeStruct(shape, dtype)
    sh = replicated(mesh) if not shape else batch_shardings(x, mesh, rules)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
