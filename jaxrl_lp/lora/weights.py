"""`LoraWeights`: LoRA as a weight representation of the learner steps (`optim.weights`).

The train steps take a representation (`make_grpo_step(weights=...)`,
`make_sft_step(weights=...)`) with this protocol:

- `differentiable(train)`: the tree the loss is differentiated with respect to;
- `frozen(train)`: what the forward reads besides it, never differentiated;
- `model_params(d, frozen)`: the params tree the forward reads;
- `optimized(train)` / `updated(train, new)`: the tree the optimizer updates,
  and the train tree after an update.

For LoRA the train tree is `LoraParams(base, adapters)`: the loss is
differentiated with respect to `{"adapters": ...}` only, the optimizer's state
and updates are the adapters' only, and the base passes through every step
untouched (no gradient buffer, no update, not a bit changed). The forward
reads `with_adapters(base, adapters, alpha / r)`, whose `LoraWeight`s
`models.layers.dot` computes with, in the learner and in the sampler alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxrl_lp.lora.adapters import LoraParams, hold_base, init_adapters, with_adapters
from jaxrl_lp.lora.config import LoraConfig
from jaxrl_lp.models.config import ModelConfig

__all__ = ["LoraWeights"]


@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """Low-rank adapters beside a frozen base, for the learner steps (module docstring).

    Attributes:
      spec: the `lora` section (rank, alpha, targets, base format).
      model: the model adapted.
      seed: seeds the adapters' init.
    """

    spec: LoraConfig
    model: ModelConfig
    seed: int = 0

    def __post_init__(self):
        if not self.spec.enabled:
            raise ValueError("LoraWeights needs lora.rank > 0")

    @property
    def scale(self) -> float:
        return self.spec.scale

    @property
    def shardable(self) -> bool:
        """Whether the train tree has sharding rules: an f32 / bf16 base and its adapters do
        (`parallel.rules`); a quantized base's codes and scales do not yet."""
        return self.spec.base_format in ("f32", "bf16")

    @property
    def invariant_forms(self) -> bool:
        """Whether the learner's invariant forward can give the sampler's bits: an `unmerged`
        sampler computes the base and the adapters as the forward does (each product in the
        invariant form, `models.layers.dot`); a `merged` one decodes another copy."""
        return self.spec.serve == "unmerged"

    def from_params(self, params: dict) -> LoraParams:
        """The train tree of a model's f32 params: the base held in `spec.base_format` and
        fresh adapters (B = 0: the adapted model is the base)."""
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), 0x10A)
        return LoraParams(hold_base(params, self.spec.base_format),
                          init_adapters(self.model, self.spec, key))

    def differentiable(self, train: LoraParams) -> dict:
        """`{"adapters": ...}`: the loss is differentiated with respect to the adapters only."""
        return {"adapters": train.adapters}

    def frozen(self, train: LoraParams) -> Any:
        """The base, read by the forward and never differentiated."""
        return train.base

    def model_params(self, tree: dict, frozen: Any = None) -> dict:
        """The forward's params: `with_adapters(base, adapters, alpha / r)`."""
        return with_adapters(frozen, tree["adapters"], self.scale)

    def materialize(self, train: Any) -> Any:
        """What the sampler, evaluation and export read: the composed tree of a `LoraParams`;
        a model's params (a run before its LoRA phase starts) as they are."""
        if not isinstance(train, LoraParams):
            return train
        return with_adapters(train.base, train.adapters, self.scale)

    def optimized(self, train: LoraParams) -> dict:
        """The optimizer's params: `{"adapters": ...}` (the same tree as the gradient)."""
        return {"adapters": train.adapters}

    def updated(self, train: LoraParams, new: dict) -> LoraParams:
        """The train tree after an update of the adapters; the base is the same object."""
        return LoraParams(train.base, new["adapters"])
