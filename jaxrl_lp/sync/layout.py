"""Names, layouts and byte hashes of served parameter trees.

A *served* tree has the nested-dict structure of the params pytree
(docs/design/parameters.md) with each leaf either an array (a cast or kept tensor) or a
`QArray` (a quantized matmul weight). Tensors are named by their path joined
with `/` (`layers/q_proj`, `embed`, `exit_gate/kernel`); the components of a
quantized tensor by `<path>.codes`, `<path>.scales` and `<path>.tensor_scale`.
Layouts and hashes are flat dicts keyed by those component names.

Which tensors are matmul weights, and their reduction axes:

| tensor | layout | reduction axis | independent tensors |
|---|---|---|---|
| `layers/{q,k,v,o,gate,up,down}_proj` | `[L, in, out]` | 1 | one per layer (axis 0) |
| `lm_head` (only when asked for) | `[D, V]` | 0 | one |

Everything else (embeddings, norms, biases, the looped exit gate) is kept in
high precision by the quantizing exporters.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from jaxrl_lp.numerics.qarray import QArray

__all__ = [
    "MATMUL_WEIGHTS",
    "TensorSpec",
    "flatten_served",
    "hash_served",
    "is_qarray",
    "layout_of",
    "matmul_axes",
    "matmul_weight_paths",
    "path_str",
]

# The stacked per-layer matmul weights, [L, in, out].
MATMUL_WEIGHTS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


def is_qarray(x: Any) -> bool:
    return isinstance(x, QArray)


def path_str(path: tuple) -> str:
    """`('layers', 'q_proj')` keys of a `tree_flatten_with_path` path as `layers/q_proj`."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def flatten_served(tree: Any) -> dict[str, Any]:
    """`{path: leaf}` with `QArray`s kept whole (they are leaves here)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_qarray)
    return {path_str(p): leaf for p, leaf in flat}


def matmul_axes(path: str, include_lm_head: bool = False) -> tuple[int, tuple[int, ...]] | None:
    """`(reduction axis, batch axes)` of a matmul weight path, or None for a kept tensor."""
    parts = path.split("/")
    if len(parts) == 2 and parts[0] == "layers" and parts[1] in MATMUL_WEIGHTS:
        return 1, (0,)
    if include_lm_head and path == "lm_head":
        return 0, ()
    return None


def matmul_weight_paths(tree: Any, include_lm_head: bool = False) -> dict[str, tuple[int, tuple]]:
    """`{path: (axis, batch_axes)}` of the matmul weights of `tree`, validating the layout.

    Raises:
      ValueError: naming the tensor when a stacked weight is missing or is not
        `[L, in, out]`, when `lm_head` (if asked for) is not `[D, V]`, or when
        the tree holds no matmul weight at all (not the layout of
        docs/design/parameters.md).
    """
    flat = flatten_served(tree)
    found = {p: ax for p in flat if (ax := matmul_axes(p, include_lm_head)) is not None}
    if not found:
        raise ValueError(
            "params tree does not match the served layout: it has none of the matmul weights "
            f"layers/{{{','.join(MATMUL_WEIGHTS)}}} (docs/design/parameters.md); got tensors "
            f"{sorted(flat)[:8]}"
        )
    if any(p.startswith("layers/") for p in flat):
        for name in MATMUL_WEIGHTS:
            if f"layers/{name}" not in flat:
                raise ValueError(
                    f"params tree does not match the served layout: tensor 'layers/{name}' is "
                    "missing (docs/design/parameters.md)"
                )
    for p, (axis, _) in found.items():
        ndim = len(np.shape(flat[p]))
        want = 3 if axis == 1 else 2
        if ndim != want:
            form = "[L, in, out]" if want == 3 else "[D, V]"
            raise ValueError(
                f"params tree does not match the served layout: tensor {p!r} has shape "
                f"{tuple(np.shape(flat[p]))}; expected {form}"
            )
    return found


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What the sampler expects of one served component.

    Attributes:
      shape: the component's shape.
      dtype: its dtype name (`bfloat16`, `float8_e4m3fn`, ...).
      format: the `QArray` format of a quantized tensor's components, else None.
      axis: the `QArray` reduction (block) axis, else None.
    """

    shape: tuple[int, ...]
    dtype: str
    format: str | None = None
    axis: int | None = None


def _components(path: str, leaf: Any) -> dict[str, Any]:
    if is_qarray(leaf):
        out = {f"{path}.codes": leaf.codes, f"{path}.scales": leaf.scales}
        if leaf.tensor_scale is not None:
            out[f"{path}.tensor_scale"] = leaf.tensor_scale
        return out
    return {path: leaf}


def layout_of(tree: Any) -> dict[str, TensorSpec]:
    """The flat layout (component name -> `TensorSpec`) of a served tree or its `eval_shape`."""
    out = {}
    for path, leaf in flatten_served(tree).items():
        fmt, axis = (leaf.format, leaf.axis) if is_qarray(leaf) else (None, None)
        for name, arr in _components(path, leaf).items():
            out[name] = TensorSpec(tuple(arr.shape), np.dtype(arr.dtype).name, fmt, axis)
    return out


def _shard_digest(index: tuple, data: Any) -> bytes:
    """SHA-256 of one shard: where it sits (its index) and its bytes."""
    a = np.ascontiguousarray(np.asarray(data))
    h = hashlib.sha256(repr(tuple((s.start, s.stop) for s in index)).encode())
    h.update(a.tobytes())
    return h.digest()


def _digest(arr: Any) -> str:
    """SHA-256 of an array's dtype, shape and bytes, computed shard by shard.

    A sharded `jax.Array` is hashed where its shards live: each shard's digest
    (its index and bytes), then the digests in index order (shards replicated
    on several devices counted once; across processes the digests, 32 bytes
    each, are all-gathered), so no host ever holds the whole array. Equal
    arrays under the same sharding hash equal; a host array is one shard.
    """
    shape = tuple(np.shape(arr))
    if isinstance(arr, jax.Array):
        parts = {}
        for sh in arr.addressable_shards:
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(sh.index, shape, strict=True))
            key = tuple((s.start, s.stop) for s in index)
            if key not in parts:
                parts[key] = _shard_digest(index, sh.data)
        if not arr.is_fully_addressable:
            from jax.experimental import multihost_utils

            keys = sorted(parts)
            gathered = multihost_utils.process_allgather(
                {"keys": np.asarray(keys, np.int64).reshape(len(keys), -1),
                 "digests": np.frombuffer(b"".join(parts[k] for k in keys), np.uint8
                                          ).reshape(len(keys), 32)})
            parts = {tuple(map(tuple, k.reshape(-1, 2))): d.tobytes()
                     for ks, ds in zip(gathered["keys"], gathered["digests"], strict=True)
                     for k, d in zip(ks, ds, strict=True)}
        dtype = np.dtype(arr.dtype).name
    else:
        a = np.asarray(arr)
        parts = {tuple((0, n) for n in shape): _shard_digest(tuple(slice(0, n) for n in shape), a)}
        dtype = a.dtype.name
    h = hashlib.sha256(f"{dtype}{shape}".encode())
    for key in sorted(parts):
        h.update(parts[key])
    return h.hexdigest()


def hash_served(tree: Any) -> dict[str, str]:
    """SHA-256 of every component's dtype, shape and raw bytes (payloads and scales apart).

    Sharded arrays are hashed shard by shard where they live (`_digest`).

    Examples:
      >>> hashes = hash_served(served)       # written next to the export
      >>> hashes["layers/q_proj.scales"][:8]
    """
    out = {}
    for path, leaf in flatten_served(tree).items():
        for name, arr in _components(path, leaf).items():
            out[name] = _digest(arr)
    return out
