"""A LoRA-adapted matmul weight, as a leaf of the params tree the forward functions read.

`LoraWeight(base, a, b, scale)` stands where a matmul weight `[.., in, out]`
stands in the params tree (docs/design/parameters.md). `models.layers.dot` computes with
it

    y = x W + ((x A) B) * scale,        scale = alpha / r,

so every forward that reaches `dot` (the dense and looped forwards, packed or
not, the sampler's prefill and decode step, the learner's replay) runs the
adapter the same way: the unmerged sampler and the learner's replay run one
computation, bit for bit. The adapters are trained and stored beside the
frozen base (`jaxrl_lp.lora`); a `LoraWeight` is built from the two just
before a forward (`lora.with_adapters`), holding references, not copies.

`base` is the frozen weight as it is held: an f32 or bf16 array, or a
`QArray` (QLoRA-style: FP8, MXFP8, MXFP4 or NVFP4 codes and scales along the
reduction axis). A quantized base is dequantized inside `dot`, one layer at a
time (inside the layer scan, or per unstacked layer in the sampler), so a
whole f32 copy of it never exists. `base_value` rebuilds it; its reduction
axis is always the second to last (`[L, in, out]` stacked, `[in, out]` per
layer), whatever axis the `QArray` recorded before its layers were sliced.

A matmul weight that is not adapted may still be a `QArray` (a quantized base
quantizes every layer matmul); `dot` rebuilds it the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_lp.numerics.products import product
from jaxrl_lp.numerics.qarray import QArray, dequantize

__all__ = ["LoraWeight", "adapter_product", "base_value", "is_lora", "merge_adapters", "merged_value"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b"],
                   meta_fields=["scale"])
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A frozen matmul weight with a low-rank adapter: value `W + A B scale` (module docstring).

    Attributes:
      base: the frozen weight `[.., in, out]`: an f32 / bf16 array or a `QArray`.
      a: the down projection `[.., in, r]` (f32, trained).
      b: the up projection `[.., r, out]` (f32, trained; zeros at the start, so
        the adapted model starts as the base exactly).
      scale: `alpha / r` (static: a Python float, folded into the program).
    """

    base: Any
    a: jax.Array
    b: jax.Array
    scale: float = 1.0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)


def is_lora(x: Any) -> bool:
    """Whether `x` is a `LoraWeight` (for `is_leaf=` in tree maps)."""
    return isinstance(x, LoraWeight)


def base_value(w: Any) -> jax.Array:
    """The value of a frozen weight as held: a `QArray` dequantized to f32, an array as it is.

    A `QArray` of a layer matmul is rebuilt along its second to last axis
    (the reduction axis of `[L, in, out]` and of one layer's `[in, out]`),
    so it is right before and after its layer axis is sliced off.
    """
    if isinstance(w, QArray):
        return dequantize(dataclasses.replace(w, axis=w.codes.ndim - 2))
    return w


def adapter_product(x_xK: jax.Array, a_KxR: jax.Array, b_RxN: jax.Array, scale: float,
                    policy) -> jax.Array:
    """`((x A) B) * scale` as an f32 accumulator: the adapter's part of a LoRA matmul.

    `x A` is accumulated in f32 and rounded to the compute dtype like any
    activation between matmuls (`policy.round`); `A` and `B` are rounded to
    the policy's param then compute dtype, as every weight is. The policy's
    `matmul_format` is not applied: adapters run at the compute precision, as
    QLoRA runs them beside a 4-bit base.
    """
    xa = product("...k,kr->...r", x_xK, policy.round_params(a_KxR), policy)
    xab = product("...r,rn->...n", policy.round(xa), policy.round_params(b_RxN), policy)
    return xab * jnp.float32(scale)


def _held(x: Any) -> bool:
    return is_lora(x) or isinstance(x, QArray)


def merged_value(x: Any) -> Any:
    """The dense f32 value of one leaf: `W + (A B) * scale` for a `LoraWeight` (the f32
    product of the adapters, then one f32 sum), a `QArray` dequantized, a floating array
    in f32 (exact for bf16), anything else as it is."""
    if is_lora(x):
        ab = jnp.einsum("...ir,...ro->...io", x.a, x.b, preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST)
        return base_value(x.base).astype(jnp.float32) + ab * jnp.float32(x.scale)
    if isinstance(x, QArray):
        return base_value(x)
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
        # Upcast: bf16 base tensors are exact in f32, the dtype of every merged tensor.
        return x.astype(jnp.float32)
    return x


def merge_adapters(tree: Any) -> Any:
    """The dense f32 tree of a LoRA forward tree (`merged_value` of every leaf).

    A tree without `LoraWeight`s or `QArray`s (a full run's params) is returned as it is,
    the same object, so what a full run exports, measures and checks is untouched.
    """
    if not any(_held(x) for x in jax.tree.leaves(tree, is_leaf=_held)):
        return tree
    return jax.tree.map(merged_value, tree, is_leaf=_held)
