"""Hugging Face safetensors checkpoints <-> our parameter pytree.

The pytree layout and the name mapping are those of `docs/design/parameters.md`: HF linear
weights are `[out, in]` and ours are `[in, out]` (`x @ W`), and the per-layer
tensors `model.layers.{i}.*` are stacked along a leading layer axis `L`.

Loading reads `model.safetensors` or a sharded checkpoint
(`model.safetensors.index.json` and its `weight_map`) and returns f32 arrays:
the learner's master weights. bf16 and f16 checkpoints are exactly
representable in f32, so a load is lossless and a save in the checkpoint's own
dtype writes the same bits back.

Tensors the checkpoint has and our model does not use are an error by default
(`strict=True`): they mean the architecture differs (an extra bias, say) and the
logits would not match. `strict=False` warns and ignores them. RoPE
`inv_freq` buffers, which some older checkpoints carry, are always ignored, and
so is an `lm_head.weight` that equals the embedding of a tied model.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.hf_config import config_to_hf, read_hf_config
from jaxrl_lp.models.hf_names import hf_tensor_map

__all__ = ["from_pretrained", "load_hf_params", "save_hf_checkpoint"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SAVE_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}


def _tensor_files(path: str) -> dict[str, str]:
    """Maps every tensor name of the checkpoint in `path` to the file holding it."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object mapping tensor names to files")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index} names shard {file!r}, which does not exist")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="np") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r} (it holds {sorted(os.listdir(path))}); "
        "only safetensors checkpoints are read: convert a pytorch_model.bin checkpoint with "
        "transformers' save_pretrained first"
    )


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_hf_params(
    path: str | os.PathLike, config: ModelConfig, *, strict: bool = True,
    shardings: Any = None,
) -> dict[str, Any]:
    """Reads a Hugging Face safetensors checkpoint into our params pytree, in f32.

    With `shardings` (a tree of `jax.sharding.Sharding`s shaped like the params,
    e.g. `parallel.param_shardings`) every array is built shard by shard: each
    device's block is read from the file as a slice (`safe_open(...).get_slice`),
    so no process ever holds a whole tensor it does not own, and in a
    multi-process run each process reads only its devices' blocks.

    Args:
      path: checkpoint directory with `model.safetensors`, or with
        `model.safetensors.index.json` and its shards.
      config: the architecture (usually `read_hf_config(path)`); every tensor's
        shape is checked against it.
      strict: unexpected tensors raise (True) or warn (False).
      shardings: the params' shardings, or None for single-device arrays.

    Returns:
      A nested dict of f32 `jax.Array`s in the layout of docs/design/parameters.md: linear
      weights `[in, out]`, per-layer tensors stacked as `[L, ...]`.

    Raises:
      FileNotFoundError: missing directory or weight files.
      ValueError: a missing, mis-shaped or (with `strict`) unexpected tensor;
        the message names the tensor, the shapes and the file.

    Examples:
      >>> params = load_hf_params("Qwen3-0.6B", read_hf_config("Qwen3-0.6B"))
      >>> params["layers"]["q_proj"].shape
      (28, 1024, 2048)
    """
    path = os.fspath(path)
    files = _tensor_files(path)
    handles: dict[str, Any] = {}

    def read(name: str, hf_shape: tuple[int, ...], what: str, transpose: bool = False,
             index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor (or its block `index`, in our orientation) as f32, in our orientation."""
        if name not in files:
            raise ValueError(
                f"tensor {name!r} ({what}, shape {hf_shape}) is missing from the checkpoint in "
                f"{path!r}; does config.json describe these weights?"
            )
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="np")
        try:
            sl = handles[file].get_slice(name)
            shape = tuple(sl.get_shape())
        except SafetensorError as e:
            raise ValueError(f"tensor {name!r} is listed for {file!r} but not in it") from e
        if shape != hf_shape:
            raise ValueError(
                f"tensor {name!r} in {file!r} has shape {shape}, expected {hf_shape} ({what}); "
                "does config.json describe these weights?"
            )
        if index is None:
            x = handles[file].get_tensor(name)
        else:  # the file holds the transpose of a linear weight: slice it reversed
            x = sl[tuple(reversed(index)) if transpose else tuple(index)]
        # bf16/f16 -> f32 is exact: the learner's master weights.
        x = np.asarray(x).astype(np.float32)
        return x.T if transpose else x

    def block(e, index: tuple[slice, ...]) -> np.ndarray:
        """Entry `e`'s block `index` (of our stacked shape)."""
        what = f"{'/'.join(e.path)} {e.shape}"
        if not e.per_layer:
            return read(e.hf_name, e.hf_shape, what, e.transpose, index)
        layers = range(config.num_layers)[index[0]]
        return np.stack([read(e.hf_name.format(i=i), e.hf_shape, f"{what}[{i}]", e.transpose,
                              index[1:]) for i in layers])

    params: dict[str, Any] = {}
    used: set[str] = set()
    for e in hf_tensor_map(config):
        shape = (config.num_layers, *e.shape) if e.per_layer else e.shape
        full = tuple(slice(0, n) for n in shape)
        if shardings is None:
            value = jnp.asarray(block(e, full))
        else:
            value = jax.make_array_from_callback(
                shape, _get(shardings, e.path),
                lambda idx, e=e, shape=shape: block(e, _bounds(idx, shape)))
        if e.per_layer:
            used.update(e.hf_name.format(i=i) for i in range(config.num_layers))
        else:
            used.add(e.hf_name)
        _set(params, e.path, value)

    extra = sorted(n for n in set(files) - used if not n.endswith("rotary_emb.inv_freq"))
    if config.tie_embeddings and "lm_head.weight" in extra:
        # Some tied checkpoints store the head anyway; it must be the embedding.
        head = read("lm_head.weight", (config.vocab_size, config.hidden_size), "tied lm_head")
        embed = read("model.embed_tokens.weight", (config.vocab_size, config.hidden_size), "embed")
        if not np.array_equal(head, embed):
            raise ValueError(
                f"config.json says tie_word_embeddings=true but lm_head.weight in "
                f"{files['lm_head.weight']!r} differs from model.embed_tokens.weight; set "
                "tie_word_embeddings=false to load the separate head"
            )
        extra.remove("lm_head.weight")
    if extra:
        shown = ", ".join(f"{n!r} ({os.path.basename(files[n])})" for n in extra[:10])
        msg = (f"checkpoint {path!r} has {len(extra)} tensor(s) the {config.family} model does "
               f"not use: {shown}{' ...' if len(extra) > 10 else ''}; the architecture differs "
               "from config.json")
        if strict:
            raise ValueError(msg + " (pass strict=False to ignore them)")
        warnings.warn(msg + "; ignoring them", stacklevel=2)
    return params


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A shard's index with every slice made explicit (`slice(None)` -> `slice(0, n)`)."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            raise ValueError(f"params: missing {'/'.join(path)!r}")
        tree = tree[key]
    return tree


def _leaf_paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaf_paths(value, (*prefix, key))
        else:
            out.append((*prefix, key))
    return out


def _hf_tensors(config: ModelConfig, params: dict, dtype: Any) -> dict[str, np.ndarray]:
    """Our params as HF-named, HF-shaped arrays of `dtype`, in checkpoint order."""
    entries = hf_tensor_map(config)
    unexpected = set(_leaf_paths(params)) - {e.path for e in entries}
    if unexpected:
        raise ValueError(
            f"params has entries the {config.family} config does not describe: "
            f"{sorted('/'.join(p) for p in unexpected)} (tie_embeddings={config.tie_embeddings})"
        )
    out = {}
    for e in entries:
        x = np.asarray(_get(params, e.path))
        want = (config.num_layers, *e.shape) if e.per_layer else e.shape
        if x.shape != want:
            raise ValueError(f"params {'/'.join(e.path)!r} has shape {x.shape}, expected {want}")
        x = x.astype(dtype)  # round to nearest even for bf16/f16
        for i in range(config.num_layers) if e.per_layer else [None]:
            xi = x if i is None else x[i]
            out[e.hf_name.format(i=i)] = np.ascontiguousarray(xi.T if e.transpose else xi)
    return out


def save_hf_checkpoint(
    path: str | os.PathLike,
    config: ModelConfig,
    params: dict[str, Any],
    *,
    dtype: str = "f32",
    dialect: str = "4",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes `config.json` and safetensors weights in the Hugging Face layout.

    One `model.safetensors`, or, when the weights exceed `max_shard_bytes`, shards
    `model-0000k-of-0000n.safetensors` and a `model.safetensors.index.json`
    (`metadata.total_size`, `weight_map`). Weight files left in `path` by an
    earlier save are removed first, so the directory always holds one checkpoint.

    Args:
      path: output directory (created if needed).
      config: the architecture; written as `config_to_hf(config, dialect, dtype)`.
      params: our params pytree (any float dtype).
      dtype: dtype of the saved weights: `f32`, `bf16` or `f16` (round to nearest even).
      dialect: `"4"` or `"5"`, the `config.json` dialect (see `config_to_hf`).
      max_shard_bytes: largest shard size; None writes a single file.

    Examples:
      >>> save_hf_checkpoint("out/ckpt", config, params, dtype="bf16")
      >>> AutoModelForCausalLM.from_pretrained("out/ckpt")  # a dense model
    """
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"save_hf_checkpoint: dtype must be one of {sorted(_SAVE_DTYPES)}; "
                         f"got {dtype!r}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be positive; "
                         f"got {max_shard_bytes}")
    hf_config = config_to_hf(config, dialect, dtype)  # validates before anything is written
    tensors = _hf_tensors(config, params, _SAVE_DTYPES[dtype])
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    for stale in [SINGLE_FILE, INDEX_FILE, *glob.glob("model-*-of-*.safetensors", root_dir=path)]:
        if os.path.isfile(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
        f.write("\n")

    total = sum(x.nbytes for x in tensors.values())
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():  # greedy, in checkpoint order; a big tensor gets its own
        if shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")


def from_pretrained(path: str | os.PathLike, policy: Any = "fp32", *, strict: bool = True):
    """Loads a Hugging Face checkpoint directory as a `CausalLM`.

    Args:
      path: directory with `config.json` and safetensors weights.
      policy: precision policy, a `Policy` or its string form (e.g. `"bf16"`),
        parsed here: loading a checkpoint is where a policy string enters.
      strict: unexpected tensors raise (True) or warn (False).

    Returns:
      `CausalLM(config, params, policy=policy)` with f32 master weights.

    Examples:
      >>> model = from_pretrained("Ouro-1.4B", policy="bf16")
      >>> logits_BxTxV = model(tokens_BxT)
    """
    from jaxrl_lp.models.model import CausalLM  # lazy: checkpoint I/O needs no model code
    from jaxrl_lp.numerics.policy import Policy

    config = read_hf_config(path)
    return CausalLM(config, load_hf_params(path, config, strict=strict),
                    policy=Policy.parse(policy))
