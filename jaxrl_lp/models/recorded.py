"""Weight products the sampler computed, given back to the learner (`grpo.reuse_products`).

Where an update computes with exactly the weights and numerics the sampler ran
(`train.behaviour.ReplayRule`), every matmul of the learner's forward over the
rollout's tokens is a product the sampler already computed: the prefill's for
the prompt, one decode step's for each completion token. `generate(...,
record_products=True)` keeps them (`Products`); `with_products` puts each
beside its weight in the params tree as a `RecordedWeight`, and
`models.layers.dot` then returns the recorded product instead of computing it,
with the gradient of the product it stands for (`jax.custom_vjp`: the
backward is autodiff's backward of `dot`, which never reads the product). The
forward that is left is the elementwise work and attention; the backward is
today's.

The values are the sampler's, so the log-probs of this forward are the
sampler's recorded ones (tests/test_recorded.py), and the gradient is the
gradient of the computation that sampled the tokens; it differs from the
parallel forward's by matmul rounding only (the decode step's products and
the whole-sequence ones round differently). Dense models on one device, plain
weights (not LoRA adapters, not a low-bit train tree), tested at f32; the
training program refuses the rest when the key is set.

Memory: the products of every layer for every token, `B x (P + N - 1) x
(q + k + v + o + gate + up + down widths)` f32 per layer, and the `[B, N, V]`
logits: 0.27 GB for the small preset's iteration (8 x 128 tokens). A model of
billions of parameters would need tens of GB for a batch; this is a lever
for small models and memory-rich hosts, off by default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LAYER_PRODUCTS", "Products", "RecordedWeight", "empty_products", "split_products",
           "take_product_rows", "with_products"]

# The matmul weights of a dense layer whose products the sampler records.
LAYER_PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecordedWeight:
    """A matmul weight `[.., in, out]` with its recorded product `[.., rows, out]` (f32).

    `models.layers.dot(x, RecordedWeight(w, y), policy)` returns `y` and
    differentiates as `dot(x, w, policy)`. Stacked over layers both carry the
    leading layer axis, so the layer scan slices them together.
    """

    weight: Any
    product: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Products:
    """What the sampler computed for a batch: its weight products and its logits.

    Attributes:
      layers: `{name: [L, B, P + N - 1, out]}` f32 for each of
        `LAYER_PRODUCTS`: grid slot s is the prompt's slot s (s < P) or
        completion token s - P fed back (the last completion token is never
        fed back). `dot`'s f32 accumulators, before bias and rounding.
      logits: `[B, N, V]` f32, the logits completion token j was sampled from.
    """

    layers: dict
    logits: jax.Array


def with_products(params: dict, products: Products) -> dict:
    """`params` with every recorded weight paired with its product (a `RecordedWeight`).

    The lm head is paired only when it is its own matrix (`lm_head`); a tied
    head is the embedding's transpose and computes its product.
    """
    layers = dict(params["layers"])
    for name in LAYER_PRODUCTS:
        layers[name] = RecordedWeight(layers[name], products.layers[name])
    out = {**params, "layers": layers}
    if "lm_head" in params:
        out["lm_head"] = RecordedWeight(params["lm_head"], products.logits)
    return out


def empty_products(layers: int, rows: int, slots: int, widths: dict[str, int], tokens: int,
                   vocab: int) -> Products:
    """Zero buffers for a batch's products (the sampler fills them in place)."""
    return Products(
        layers={k: jnp.zeros((layers, rows, slots, w), jnp.float32) for k, w in widths.items()},
        logits=jnp.zeros((rows, tokens, vocab), jnp.float32))


def split_products(products: Products, m: int) -> Products:
    """`products` with a leading micro-batch axis: rows `[i * B/m, (i + 1) * B/m)` at `i`."""
    def layer(x):
        lyr, b = x.shape[:2]
        return jnp.moveaxis(x.reshape(lyr, m, b // m, *x.shape[2:]), 1, 0)
    b = products.logits.shape[0]
    return Products(layers={k: layer(v) for k, v in products.layers.items()},
                    logits=products.logits.reshape(m, b // m, *products.logits.shape[1:]))


def take_product_rows(products: Products, idx) -> Products:
    """The products of rows `idx` (a minibatch; `rollout.take_rows` for the rollout).

    Every row in order (one minibatch) is `products` itself: no copy of them.
    """
    rows = products.logits.shape[0]
    if isinstance(idx, np.ndarray) and np.array_equal(idx, np.arange(rows)):
        return products
    return Products(layers={k: v[:, idx] for k, v in products.layers.items()},
                    logits=products.logits[idx])
