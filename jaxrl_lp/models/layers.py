"""Decoder building blocks as pure functions of arrays and a `Policy`.

Attention is in `models.attention`, a floor below the kernels (the decode
kernel's reference); these use the kernels (`dot`'s quantized matmul).

Every function rounds exactly where the policy says: activations that leave a
region are rounded to `compute_dtype` by `policy.round`; inside an f32 region
(`policy.has(...)`) the arithmetic is f32 from inputs to output.

Shape letters: B batch, T query tokens, S key slots, D hidden, F MLP width,
H query heads, K key/value heads, G = H // K query heads per kv head,
Dh head width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_lp.kernels.fake_quant import (
    INVARIANT_FORMATS,
    QUANTIZED_WEIGHT_FORMATS,
    activation_values,
    quantized_matmul,
)
from jaxrl_lp.models.lora import LoraWeight, adapter_product, base_value
from jaxrl_lp.models.recorded import RecordedWeight
from jaxrl_lp.numerics import invariant
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.products import precision_for, product
from jaxrl_lp.numerics.qarray import QArray
from jaxrl_lp.parallel.context import current_mesh

__all__ = ["TransposedWeight", "dot", "rms_norm", "rope", "scale_features", "swiglu"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedWeight:
    """A plain matmul weight stored `[out, in]` (`w_NxK`), the decode's copy (`unstack_layers`).

    `dot(x, TransposedWeight(w.T), policy)` is `x @ w`, computed on CPU with the
    weight as the product's row operand: `w_NxK @ x.T`, `[N, rows]`, then
    transposed back. At a decode step's few rows XLA:CPU streams a weight
    read that way about twice as fast as `x @ w` as stored (docs/design/hot_path.md,
    "The decode's weights"). Other platforms multiply `x @ w_NxK.T` as one
    product. The sums round as their own
    product does, not as `x @ w`'s: the sampler and the replay both read
    this copy, so they agree bit for bit (docs/design/hot_path.md, "The decode's
    weights").

    With a `format` (a policy's `matmul_format`), `w_NxK` holds the values of the weight
    quantized in it along `in`, `Q(w)`, read `[out, in]`: the decode's copy in the invariant
    forms' weights-major read under a quantized policy (`unstack_layers`), which only those
    forms multiply (`invariant.weights_major_product` of `Q(x)` and the copy).
    """

    w_NxK: Any
    format: str | None = dataclasses.field(default=None, metadata=dict(static=True))


def dot(x_xK: jax.Array, w_KxN: jax.Array, policy: Policy) -> jax.Array:
    """Matmul of a compute-precision activation with a weight; returns the f32 accumulator.

    The weight is rounded to `param_dtype` then `compute_dtype`; with a
    `matmul_format` both operands go through the format (straight-through),
    quantized by the Pallas kernel where `policy.kernels` picks it (bit-equal).

    A LoRA weight (`models.lora.LoraWeight`) adds its adapter to the accumulator,
    `x W + ((x A) B) * scale`; a quantized frozen weight (`QArray`, a LoRA base)
    is dequantized here first, except one in the policy's `matmul_format` where that is one
    of `kernels.fake_quant.QUANTIZED_WEIGHT_FORMATS` (the decode's copy,
    `blocks.decode_weights`), which is `Q(w)` itself (`Q` of its value is its value) and
    enters the product as it is (an FP8 format's as codes).
    Plain arrays take the path they always took.

    A `RecordedWeight` (`models.recorded`) returns its recorded product, with
    the gradient of this function at its weight.

    Inside `numerics.invariant.invariant_forms` a plain weight's product takes the
    invariant form (`invariant.invariant_dot`: each row's bits independent of the
    rows beside it, its gradient the plain product's; the decode's `[out, in]` copy
    by `invariant.weights_major_product` where the form reads the weights so). Under a
    `matmul_format` of `kernels.fake_quant.INVARIANT_FORMATS` the product of `Q(x)` and
    `Q(w)`'s values takes the same form (its gradient `quantized_matmul`'s); the decode
    reads `Q(w)` as the copy it holds (`blocks.unstack_layers`). A LoRA weight's three
    products each take it. Other weights and formats are refused there, never computed
    otherwise.
    """
    if invariant.active():
        return _invariant(x_xK, w_KxN, policy)
    if isinstance(w_KxN, RecordedWeight):
        return _recorded(x_xK, w_KxN.weight, w_KxN.product, policy)
    if isinstance(w_KxN, TransposedWeight):
        if policy.matmul_format is not None or w_KxN.format is not None:
            raise ValueError("dot: a TransposedWeight is a plain weight's decode copy, or a "
                             "quantized one's in the invariant forms; a matmul_format "
                             "quantizes along the stored contraction axis")
        w = policy.round_params(w_KxN.w_NxK)
        n, k = w.shape
        return _weights_major_product(x_xK.reshape(-1, k), w).reshape(*x_xK.shape[:-1], n)
    if isinstance(w_KxN, LoraWeight):
        return (dot(x_xK, w_KxN.base, policy)
                + adapter_product(x_xK, w_KxN.a, w_KxN.b, w_KxN.scale, policy))
    if (isinstance(w_KxN, QArray)
            and w_KxN.format == policy.matmul_format in QUANTIZED_WEIGHT_FORMATS):
        # Quantized already in the policy's format (the decode's copy,
        # `blocks.decode_weights`, or a served weight): Q(w) as it is.
        return quantized_matmul(x_xK, w_KxN, policy.matmul_format, backward=policy.backward,
                                batch_axes=tuple(range(x_xK.ndim - 1)), kernels=policy.kernels)
    if isinstance(w_KxN, QArray):
        w_KxN = base_value(w_KxN)
    w = policy.round_params(w_KxN)
    if policy.matmul_format is not None:
        # One activation scale per token (batch_axes = every leading axis), so a
        # token's output never depends on the other tokens in the batch: decoding
        # one token at a time matches the learner's whole-sequence forward.
        return quantized_matmul(x_xK, w, policy.matmul_format, backward=policy.backward,
                                batch_axes=tuple(range(x_xK.ndim - 1)), kernels=policy.kernels)
    if current_mesh() is None and x_xK.ndim > 2:
        # One token axis: the weight's gradient is then one [K, T] x [T, N] product. Over
        # the leading axes as they come, autodiff's product made XLA:CPU transpose the
        # [T, N] cotangent inside the fusion that computes it, a strided pass that slowed the
        # small preset's update (docs/design/exact_logprobs.md, "One token axis in the
        # matmuls"). The values are the same bits, and so is a dense model's gradient; a
        # looped model sums its steps' weight products in another order
        # (`tests/test_models.py`). Under a mesh the axes stay apart for the partitioner.
        k, n = w.shape
        return _f32_product(x_xK.reshape(-1, k), w, policy).reshape(*x_xK.shape[:-1], n)
    return _f32_product(x_xK, w, policy)


def _invariant(x_xK: jax.Array, w_KxN, policy: Policy) -> jax.Array:
    """`dot` inside `invariant_forms`: plain weights, stored or the decode's `[out, in]`
    copy, under a format of `INVARIANT_FORMATS` the decode's `Q(w)`, and LoRA weights
    (docstring above)."""
    if isinstance(w_KxN, LoraWeight):  # each of the three products in the form, as `dot`'s
        adapter = _invariant_adapter(x_xK, w_KxN.a, w_KxN.b, w_KxN.scale, policy)
        # `apart`: the scaled adapter is added as rounded, never fused into the sum (a guard:
        # docs/design/invariant.md, "LoRA", says no test shows it needed).
        return _invariant(x_xK, w_KxN.base, policy) + invariant.apart(adapter)
    fmt = policy.matmul_format
    transposed = (isinstance(w_KxN, TransposedWeight) and isinstance(w_KxN.w_NxK, jax.Array)
                  and w_KxN.format == fmt)
    copy = isinstance(w_KxN, QArray) and w_KxN.format == fmt in QUANTIZED_WEIGHT_FORMATS
    if isinstance(w_KxN, QArray) and not copy:  # a quantized LoRA base: its value, as `dot`
        w_KxN = base_value(w_KxN)
    if (fmt is not None and fmt not in INVARIANT_FORMATS) or current_mesh() is not None or not (
            isinstance(w_KxN, jax.Array) or transposed or copy):
        raise ValueError("invariant forms: a plain weight on one device, its matmul_format "
                         f"none or one of {INVARIANT_FORMATS}; got {type(w_KxN).__name__}"
                         + (f" with matmul_format {fmt}" if fmt else "")
                         + (" under a mesh" if current_mesh() is not None else ""))
    lead = tuple(range(x_xK.ndim - 1))  # one activation scale a token, as `dot`'s
    if transposed:  # the sampler's copy: a forward only
        w = w_KxN.w_NxK if fmt else policy.round_params(w_KxN.w_NxK)  # Q(w)'s values as held
        x = x_xK if fmt is None else activation_values(x_xK, fmt, lead, policy.kernels)
        n, k = w.shape
        return invariant.weights_major_product(x.reshape(-1, k), w).reshape(
            *x_xK.shape[:-1], n)
    if fmt is None:
        return invariant.invariant_dot(x_xK, policy.round_params(w_KxN), policy)

    def product(x_xK, w_KxN):  # of the values, in the active form
        k, n = w_KxN.shape
        return invariant.weights_product(x_xK.reshape(-1, k), w_KxN).reshape(
            *x_xK.shape[:-1], n)

    w = w_KxN if copy else policy.round_params(w_KxN)
    return quantized_matmul(x_xK, w, fmt, backward=policy.backward, batch_axes=lead,
                            kernels=policy.kernels, product=product)


def _invariant_adapter(x_xK: jax.Array, a_KxR: jax.Array, b_RxN: jax.Array, scale: float,
                       policy: Policy) -> jax.Array:
    """`models.lora.adapter_product` with both products in the invariant form (at the compute
    precision, no `matmul_format`, as there)."""
    xa = invariant.invariant_dot(x_xK, policy.round_params(a_KxR), policy)
    xab = invariant.invariant_dot(policy.round(xa), policy.round_params(b_RxN), policy)
    return xab * jnp.float32(scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _recorded(x_xK, w_KxN, y_xN, policy: Policy):
    """`y_xN`, the recorded `dot(x_xK, w_KxN, policy)`, differentiated as that product."""
    return y_xN


def _recorded_fwd(x_xK, w_KxN, y_xN, policy):
    return y_xN, (x_xK, w_KxN)


def _recorded_bwd(policy, res, g):
    # Autodiff's backward of the product: a matmul's transpose never reads its output, so
    # the forward product traced here is dead code for XLA.
    x, w = res
    _, vjp = jax.vjp(lambda x, w: dot(x, w, policy), x, w)
    dx, dw = vjp(g)
    return dx, dw, None


_recorded.defvjp(_recorded_fwd, _recorded_bwd)


def _weights_major_product(x_RxK: jax.Array, w_NxK: jax.Array) -> jax.Array:
    """`x_RxK @ w_NxK.T` in f32, `[R, N]`; on CPU as `w_NxK @ x_RxK.T` (`TransposedWeight`)."""
    dims = (((1,), (1,)), ((), ()))
    kw = dict(preferred_element_type=jnp.float32, precision=precision_for(x_RxK, w_NxK))

    def product(a, b):
        # Named, so profiles find the decode's weight products (`benchmarks/profile_sampler.py`).
        with jax.named_scope("weights_major"):
            return jax.lax.dot_general(a, b, dims, **kw)

    def rows_of_weight(x, w):
        # The barrier keeps the product [N, R] in memory: without it XLA lays the dot's
        # output out as the transpose wants it, [R, N], and takes the slow form again.
        y = jax.lax.optimization_barrier(product(w, x))
        return jax.lax.optimization_barrier(y.T)

    return jax.lax.platform_dependent(x_RxK, w_NxK, cpu=rows_of_weight,
                                      default=lambda x, w: product(x, w))


def _f32_product(x_xK: jax.Array, w_KxN: jax.Array, policy: Policy) -> jax.Array:
    # Low-precision products and backward by `numerics.products`.
    return product("...k,kn->...n", x_xK, w_KxN, policy)


def rms_norm(x_xD: jax.Array, w_D: jax.Array, eps: float, policy: Policy) -> jax.Array:
    """RMSNorm: x / sqrt(mean(x^2) + eps) * w, rounded to compute dtype at the output.

    With the `norm` region the variance, normalization and scale are f32 from
    the input; without it the normalized value is rounded before the scale is
    applied in compute precision, as Hugging Face's `weight * x.to(dtype)`.
    """
    x = x_xD.astype(jnp.float32)  # the variance is f32 in every kernel we model
    # `apart`: inside `invariant_forms` each product is summed as rounded, whatever fuses.
    mean_sq = invariant.total(invariant.apart(x * x)) / x.shape[-1]
    inv = invariant.rsqrt(invariant.apart(mean_sq) + eps)
    if policy.has("norm"):
        return invariant.apart(policy.round(
            scale_features(x * inv, policy.round_params(w_D).astype(jnp.float32))))
    y = policy.round(x * inv)
    return invariant.apart(policy.round(policy.round_params(w_D) * y))


@jax.custom_vjp
def scale_features(y_xD: jax.Array, w_D: jax.Array) -> jax.Array:
    """`y_xD * w_D`, the weight broadcast over the leading axes; its gradient written out.

    The input's gradient is autodiff's (`g * w`, the same bits). The
    weight's, the sum of `g * y` over every leading axis, is on XLA:CPU a
    product with a vector of ones (`lax.platform_dependent`, by the platform
    lowered for; off a mesh): XLA:CPU's YNNPACK sums an activation over its
    token axis one element at a time, and the product is many times faster
    (docs/design/learner_step.md, "The norm weights' gradient as a product on
    CPU"); the small preset's update has 17 such norms. The sum's order differs,
    so on CPU the norm weights' gradients round otherwise than autodiff's
    reduce (f32 summation error, tests/test_norm_grad.py). GPU and TPU
    lower the reduce.
    """
    return y_xD * w_D


def _scale_features_fwd(y_xD, w_D):
    return y_xD * w_D, (y_xD, w_D)


def _scale_features_bwd(res, g):
    y, w = res
    gy = g * y
    lead = tuple(range(gy.ndim - 1))
    reduce = lambda gy: jnp.sum(gy, axis=lead)
    if current_mesh() is not None or not lead:  # the partitioner splits the reduce as it is
        return g * w, reduce(gy).astype(w.dtype)

    def product(gy):
        ones = jnp.ones(gy.shape[:-1], gy.dtype)
        return jax.lax.dot_general(ones, gy, ((lead, lead), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=gy.dtype)

    return g * w, jax.lax.platform_dependent(gy, cpu=product, default=reduce).astype(w.dtype)


scale_features.defvjp(_scale_features_fwd, _scale_features_bwd)


def rope(x_BxTxHxDh: jax.Array, positions_BxT: jax.Array, theta: float, policy: Policy):
    """Rotary embedding (rotate-half form) at integer positions; negative positions act as 0.

    cos/sin come from an f32 inverse frequency. With the `rope` region the
    rotation is f32 and rounded once; without it cos/sin and every product are
    rounded to compute precision, as a bf16 RoPE kernel does.
    """
    dh = x_BxTxHxDh.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    pos = jnp.maximum(positions_BxT, 0).astype(jnp.float32)
    freqs = invariant.apart(pos[..., None] * inv_freq)  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x1, x2 = jnp.split(x_BxTxHxDh, 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    if policy.has("rope"):
        x = x_BxTxHxDh.astype(jnp.float32)  # f32 region: rotation from the rounded input
        # `apart`: inside `invariant_forms` the sum adds the rounded products, whatever fuses.
        return policy.round(invariant.apart(x * cos)
                            + invariant.apart(rot.astype(jnp.float32) * sin))
    cos, sin = policy.round(cos), policy.round(sin)
    return policy.round(invariant.apart(policy.round(x_BxTxHxDh * cos))
                        + invariant.apart(policy.round(rot * sin)))


def swiglu(gate_acc: jax.Array, up_acc: jax.Array, policy: Policy) -> jax.Array:
    """silu(gate) * up from the two f32 matmul accumulators, rounded to compute precision.

    With the `swiglu` region the product is f32 from the accumulators; without
    it gate and up are rounded first and silu and the product are rounded, as
    in a bf16 kernel.
    """
    if policy.has("swiglu"):
        return policy.round(jax.nn.silu(gate_acc) * up_acc)
    g, u = policy.round(gate_acc), policy.round(up_acc)
    return policy.round(policy.round(jax.nn.silu(g.astype(jnp.float32))) * u)
