"""Logical axis names for every parameter and activation, and the rules that map them to a mesh.

Each dimension of a parameter or activation has a logical name (`vocab`,
`embed`, `heads`, ...). `ShardingRules` maps each name to mesh axes (or to
None: replicated), and `spec_for` turns a tuple of logical names into a
`PartitionSpec`. The default rules (`DEFAULT_RULES`) are FSDP along `fsdp`
(the embedding width of every weight), tensor parallelism along `tensor`
(heads, KV heads, MLP columns, vocabulary), and the batch over `data` x
`fsdp`:

| logical | mesh axes | what |
|---|---|---|
| `batch` | `data`, `fsdp` | sequences of a batch (activations, KV cache, rollouts) |
| `vocab` | `tensor` | vocabulary (embedding rows, head columns, logits) |
| `embed` | `fsdp` | the model width of a weight (FSDP) |
| `heads`, `kv_heads` | `tensor` | query / key-value heads (whole heads per shard) |
| `mlp` | `tensor` | SwiGLU hidden width |
| `norm`, `head_norm` | `fsdp` | RMSNorm scales (model width, head width) |
| `lora_rank` | `fsdp` | a LoRA adapter's rank, where its other axis is not on `fsdp` |
| `layers`, `head_dim`, `sequence`, `hidden`, `cache_slots`, `gate` | - | replicated |

A LoRA adapter is split like the matmul it adapts: `A` [L, in, r] along the
weight's input axis, `B` [L, r, out] along its output axis; where that axis
is not the FSDP one (heads, KV heads, MLP columns go to `tensor`), the rank
takes `fsdp` (a mesh axis is used once per array), so every adapter and its
Adam moments are split over `fsdp` as the weights are (the rank must divide
by the fsdp size: `lora.rank` is checked against `run.mesh`). A LoRA run's
base and adapters (`lora.LoraParams`) are laid out as the params tree is.

Activations use `hidden` (not `embed`) for their model width, so FSDP shards
weights but not the residual stream. Every parameter is split over `fsdp` x
`tensor` except the exit gate's one-element bias.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_lp.models.config import ModelConfig  # a floor below (`models/__init__` loads lazily)

__all__ = ["DEFAULT_RULES", "ShardingRules", "check_divisible", "logical_size",
           "param_logical_axes", "param_shardings", "spec_for"]

# Per entry of the params tree (docs/design/parameters.md): the logical name of each dimension.
_LAYER_AXES: dict[str, tuple[str, ...]] = {
    "q_proj": ("layers", "embed", "heads"),
    "k_proj": ("layers", "embed", "kv_heads"),
    "v_proj": ("layers", "embed", "kv_heads"),
    "o_proj": ("layers", "heads", "embed"),
    "q_bias": ("layers", "heads"),
    "k_bias": ("layers", "kv_heads"),
    "v_bias": ("layers", "kv_heads"),
    "q_norm": ("layers", "head_norm"),
    "k_norm": ("layers", "head_norm"),
    "gate_proj": ("layers", "embed", "mlp"),
    "up_proj": ("layers", "embed", "mlp"),
    "down_proj": ("layers", "mlp", "embed"),
}
# The two halves of a LoRA run's weights (`lora.LoraParams`): each is laid out as the params
# tree is (the adapters under the names of the weights they adapt).
_LORA_PARTS = ("base", "adapters")
_TOP_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axes (a tuple, empty for replicated); hashable (a static value)."""

    rules: tuple[tuple[str, tuple[str, ...]], ...]

    def __post_init__(self):
        names = [n for n, _ in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"sharding rules name an axis twice: {names}")

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        for name, axes in self.rules:
            if name == logical:
                return axes
        raise ValueError(f"no sharding rule for the logical axis {logical!r}; rules cover "
                         f"{[n for n, _ in self.rules]}")


# The default logical-axis -> mesh-axis rules (FSDP over parameters, rows over data shards).
DEFAULT_RULES = ShardingRules((
    ("batch", ("data", "fsdp")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("norm", ("fsdp",)),
    ("head_norm", ("fsdp",)),
    ("layers", ()),
    ("head_dim", ()),
    ("sequence", ()),
    ("hidden", ()),
    ("cache_slots", ()),
    ("gate", ()),
    ("lora_rank", ("fsdp",)),
))


def spec_for(logical_axes: tuple[str | None, ...], rules: ShardingRules = DEFAULT_RULES,
             mesh: Mesh | None = None) -> PartitionSpec:
    """The `PartitionSpec` of a value whose dimensions have `logical_axes`.

    Mesh axes of size 1 are left out (so specs stay valid on any mesh), and a
    mesh axis is used at most once.
    """
    used: set[str] = set()
    parts = []
    for name in logical_axes:
        axes = tuple(a for a in rules.mesh_axes(name)
                     if a not in used and (mesh is None or mesh.shape[a] > 1))
        used.update(axes)
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*parts)


def param_logical_axes(params: Any) -> Any:
    """The logical axes of every leaf of a params tree (stacked layers), as a same-shaped tree."""

    def axes(path, leaf):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        if len(keys) > 1 and keys[0] in _LORA_PARTS:  # a LoRA train tree (`lora.LoraParams`)
            keys = keys[1:]
        name = keys[-1]
        if keys[0] == "layers":
            if len(keys) == 3 and keys[1] in _LAYER_AXES and name == "base":
                return _LAYER_AXES[keys[1]]  # a LoRA forward tree's frozen weight (`LoraWeight`)
            if len(keys) == 3 and keys[1] in _LAYER_AXES and name in ("a", "b"):
                # A LoRA adapter of a layer matmul: A [L, in, r] is split like the weight's
                # input, B [L, r, out] like its output; the rank takes what is left (fsdp).
                layers, n_in, n_out = _LAYER_AXES[keys[1]]
                return (layers, n_in, "lora_rank") if name == "a" else (layers, "lora_rank", n_out)
            if name in _LAYER_AXES:
                return _LAYER_AXES[name]
            if "norm" in name:
                return ("layers", "norm")
        elif keys[0] == "exit_gate":
            return ("norm", "gate") if name == "kernel" else ("gate",)
        elif name in _TOP_AXES:
            return _TOP_AXES[name]
        raise ValueError(f"no logical axes for parameter {'/'.join(keys)}")

    return jax.tree_util.tree_map_with_path(axes, params)


def logical_size(cfg: ModelConfig, logical: str) -> tuple[int, str] | None:
    """The number of units a logical axis splits into, and the config field naming it.

    Heads are split whole: a `heads` dimension of `num_heads * head_dim` divides
    by the tensor axis only when `num_heads` does.
    """
    return {
        "vocab": (cfg.vocab_size, "model.vocab_size"),
        "embed": (cfg.hidden_size, "model.hidden_size"),
        "heads": (cfg.num_heads, "model.num_heads"),
        "kv_heads": (cfg.num_kv_heads, "model.num_kv_heads"),
        "mlp": (cfg.intermediate_size, "model.intermediate_size"),
        "head_norm": (cfg.head_dim, "model.head_dim"),
    }.get(logical)


def check_divisible(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> None:
    """Raises a ValueError naming the config field and mesh axis when a split is uneven."""
    for logical in ("vocab", "embed", "heads", "kv_heads", "mlp", "head_norm"):
        axes = [a for a in rules.mesh_axes(logical) if mesh.shape[a] > 1]
        n = math.prod(mesh.shape[a] for a in axes)
        size, field = logical_size(cfg, logical)
        if size % n:
            raise ValueError(
                f"{field}={size} does not divide by the mesh's {'x'.join(axes)}={n} "
                f"(the {logical} axis is sharded over {axes}); choose a mesh whose "
                f"{'x'.join(axes)} size divides {size}")


def param_shardings(params: Any, cfg: ModelConfig, mesh: Mesh,
                    rules: ShardingRules = DEFAULT_RULES) -> Any:
    """`NamedSharding`s for a params tree (arrays or `ShapeDtypeStruct`s) on `mesh`.

    Raises:
      ValueError: a sharded dimension does not divide evenly (`check_divisible`).
    """
    check_divisible(cfg, mesh, rules)
    return jax.tree.map(lambda axes: NamedSharding(mesh, spec_for(axes, rules, mesh)),
                        param_logical_axes(params), is_leaf=lambda x: isinstance(x, tuple))
