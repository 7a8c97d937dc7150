"""How a run holds its weights for training, and the model params they stand for.

The default run trains the model's f32 params directly (no representation
object: `None` everywhere, and the train steps are unchanged). The two
low-bit representations here map a *train tree* (what the run checkpoints
as `state["params"]`) to the model's params tree (docs/design/parameters.md):

- `CodedWeights` (error diffusion): each stacked matmul weight
  `layers/{q,k,v,o,gate,up,down}_proj` `[L, in, out]` becomes
  `{"codes": int8 [L, in, out], "scale": f32 [L, 1, out]}`; the effective
  weight is `codes * scale` (one scale per output channel, trained by Adam).
  There is no f32 copy of the weight: the forward materializes `codes * scale`
  inside the jitted step, transiently, like an activation. Codes start from
  the f32 init as binary `sign(W)` (`sign(0) = +1`) or ternary
  `clip(floor(W / s + 0.5), -1, 1)`, with `s = max(mean|W|, TERNARY_EPS)`
  over the reduction axis (per output channel); `scale` starts at that `s`.
- `LatentSTEWeights` (the latent-weight baseline): the train tree is the f32
  model params (the latents); the forward uses the quantized weight
  `q(W) = codes * mean|W|` per layer (`numerics.formats.quantize`, binary or
  BitNet b1.58 ternary, `batch_axes=(0,)`) with a straight-through gradient
  `W + sg(q(W) - W)`, and Adam updates the latents.

Everything else (embeddings, norms, the head, the looped exit gate) is f32 in
both. Gradients cannot be taken with respect to int8 codes, so the train
steps differentiate `model_params(differentiable(train))` with respect to the
float view `differentiable(train)` (codes cast to f32 inside the step) and
hand those f32 gradients to the optimizer, whose code updates are int8.
The sampler, evaluation and export read `materialize(train)`: the model
params the forward uses (f32 `codes * scale`, or the quantized latents).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.numerics.formats import TERNARY_EPS, quantize
from jaxrl_lp.sync.layout import MATMUL_WEIGHTS, matmul_axes, path_str

__all__ = ["CodedWeights", "LatentSTEWeights", "code_bits", "is_coded_path"]

Levels = Literal["binary", "ternary"]


def code_bits(levels: Levels) -> float:
    """Information bits of one code: binary 1, ternary log2 3 (stored in int8 either way)."""
    return 1.0 if levels == "binary" else math.log2(3)


def is_coded_path(path: str) -> bool:
    """Whether a model params path is a matmul weight held as codes (`layers/*_proj`)."""
    return matmul_axes(path) is not None


def _map_layers(fn, tree: dict) -> dict:
    """`tree` with `tree["layers"][name] = fn(tree["layers"][name])` for each matmul weight."""
    layers = dict(tree["layers"])
    for name in MATMUL_WEIGHTS:
        layers[name] = fn(layers[name])
    return {**tree, "layers": layers}


def _codes_of(w_LxIxO: jax.Array, levels: Levels, scale: jax.Array) -> jax.Array:
    if levels == "binary":
        return jnp.where(w_LxIxO >= 0, 1, -1).astype(jnp.int8)
    return jnp.clip(jnp.floor(w_LxIxO / scale + 0.5), -1, 1).astype(jnp.int8)


def _count(tree: dict, coded: bool) -> int:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return sum(int(np.size(x)) for p, x in flat if (path_str(p).endswith("/codes")) == coded)


@dataclasses.dataclass(frozen=True)
class CodedWeights:
    """Matmul weights as int8 codes times an f32 per-output-channel scale (module docstring).

    Attributes:
      levels: `binary` (codes +-1) or `ternary` (codes -1, 0, 1).
    """

    levels: Levels = "binary"
    # Codes and scales have no sharding rules yet: one device.
    shardable: ClassVar[bool] = False

    def __post_init__(self):
        if self.levels not in ("binary", "ternary"):
            raise ValueError(f"CodedWeights.levels={self.levels!r}: choose 'binary' or 'ternary'")

    def from_params(self, params: dict) -> dict:
        """The train tree of f32 model params (codes from the init, scale = mean|W|)."""
        def one(w):
            # The mean accumulates in f32 (the params are f32).
            s = jnp.maximum(jnp.mean(jnp.abs(w.astype(jnp.float32)), axis=1, keepdims=True),
                            TERNARY_EPS)
            return {"codes": _codes_of(w, self.levels, s), "scale": s}
        return _map_layers(one, params)

    def differentiable(self, train: dict) -> dict:
        """The train tree with codes as f32 (exact: every code is an f32), to differentiate."""
        return _map_layers(lambda c: {"codes": c["codes"].astype(jnp.float32),
                                      "scale": c["scale"]}, train)

    def model_params(self, tree: dict, frozen=None) -> dict:
        """The model params `codes * scale` of a (differentiable or train) tree, in f32."""
        return _map_layers(lambda c: c["codes"].astype(jnp.float32) * c["scale"], tree)

    def frozen(self, train: dict) -> None:
        """Nothing besides the train tree: every leaf is trained."""
        return None

    def optimized(self, train: dict) -> dict:
        """The optimizer updates the train tree itself (int8 code deltas, f32 the rest)."""
        return train

    def updated(self, train: dict, new: dict) -> dict:
        """The train tree after an update: the optimizer's output."""
        return new

    def materialize(self, train: dict) -> dict:
        """The model params the sampler, evaluation and export use (f32 `codes * scale`)."""
        return self.model_params(train)

    def label(self, path: str) -> str:
        """The optimizer of a train-tree leaf: `codes` (error diffusion) or `adam`."""
        return "codes" if path.endswith("/codes") else "adam"

    def codes(self, train: dict) -> dict:
        """`{path: int8 codes}` of the coded weights."""
        return {f"layers/{n}": train["layers"][n]["codes"] for n in MATMUL_WEIGHTS}

    def flip_rate(self, old: dict, new: dict) -> jax.Array:
        """The fraction of coded weights whose code changed from `old` to `new` (f32 scalar)."""
        a, b = self.codes(old), self.codes(new)
        changed = sum(jnp.sum(a[p] != b[p]) for p in a)
        return changed.astype(jnp.float32) / sum(int(np.size(a[p])) for p in a)

    def state_bits(self, train: dict, k: int) -> dict:
        """Bits of training state: per coded weight, and amortized over all training state.

        `per_weight` = code bits + k (the residual); `per_weight_amortized` adds
        the per-channel scales with their Adam moments (96 bits per scale) and
        the step counters, spread over the coded weights; `stored_per_weight`
        is what int8 storage of code and residual takes (16 bits);
        `high_precision_params` (embeddings, norms, head, scales) are f32 with
        Adam (96 bits each).
        """
        n_coded = _count(train, True)
        n_scale = sum(int(np.size(train["layers"][n]["scale"])) for n in MATMUL_WEIGHTS)
        n_hp = _count(train, False)
        per = code_bits(self.levels) + k
        return {"per_weight": per, "per_weight_amortized": per + (96 * n_scale + 2 * 32) / n_coded,
                "stored_per_weight": 16.0, "coded_weights": n_coded,
                "high_precision_params": n_hp,
                "total_bits": per * n_coded + 96 * n_hp + 2 * 32}


@dataclasses.dataclass(frozen=True)
class LatentSTEWeights:
    """f32 latent matmul weights quantized in the forward, straight-through (module docstring).

    Attributes:
      levels: `binary` (`sign(W) * mean|W|`) or `ternary` (BitNet b1.58 codes * mean|W|).
    """

    levels: Levels = "binary"
    shardable: ClassVar[bool] = False  # the low-bit runs are single-device

    def __post_init__(self):
        if self.levels not in ("binary", "ternary"):
            raise ValueError(f"LatentSTEWeights.levels={self.levels!r}: choose 'binary' or "
                             "'ternary'")

    def from_params(self, params: dict) -> dict:
        """The train tree: the f32 params themselves (the latents)."""
        return params

    def differentiable(self, train: dict) -> dict:
        """The latents (already f32)."""
        return train

    def _q(self, w):
        return quantize(w, self.levels, axis=1, batch_axes=(0,))

    def frozen(self, train: dict) -> None:
        """Nothing besides the latents: every leaf is trained."""
        return None

    def optimized(self, train: dict) -> dict:
        """The optimizer updates the latents themselves."""
        return train

    def updated(self, train: dict, new: dict) -> dict:
        """The latents after an update: the optimizer's output."""
        return new

    def model_params(self, tree: dict, frozen=None) -> dict:
        """`W + sg(q(W) - W)` for each matmul weight: q(W) forward, identity gradient."""
        def one(w):
            q = self._q(w)
            return w + jax.lax.stop_gradient(q.codes.astype(jnp.float32) * q.scales - w)
        return _map_layers(one, tree)

    def materialize(self, train: dict) -> dict:
        """The model params the sampler, evaluation and export use: `q(W)` in f32."""
        return _map_layers(lambda w: (lambda q: q.codes.astype(jnp.float32) * q.scales)(
            self._q(w)), train)

    def label(self, path: str) -> str:
        """Every latent is trained by Adam."""
        return "adam"

    def codes(self, train: dict) -> dict:
        """`{path: int8 codes}` the forward uses for the matmul weights."""
        return {f"layers/{n}": self._q(train["layers"][n]).codes for n in MATMUL_WEIGHTS}

    def flip_rate(self, old: dict, new: dict) -> jax.Array:
        """The fraction of matmul-weight codes that changed from `old` to `new` (f32 scalar)."""
        a, b = self.codes(old), self.codes(new)
        changed = sum(jnp.sum(a[p] != b[p]) for p in a)
        return changed.astype(jnp.float32) / sum(int(np.size(a[p])) for p in a)

    def state_bits(self, train: dict, k: int | None = None) -> dict:
        """Bits of training state: an f32 latent (32) and Adam's m and v (64) per weight."""
        n = sum(int(np.size(train["layers"][m])) for m in MATMUL_WEIGHTS)
        n_all = sum(int(np.size(x)) for x in jax.tree.leaves(train))
        return {"per_weight": 96.0, "per_weight_amortized": 96.0 + 32 / n,
                "stored_per_weight": 96.0, "coded_weights": n,
                "high_precision_params": n_all - n, "total_bits": 96 * n_all + 32}
