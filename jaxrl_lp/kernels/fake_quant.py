"""Quantization-aware compute: fake quantization and the quantized matmul.

`fake_quant` rounds a tensor to a number format and back to f32 with a
straight-through (identity) gradient. `quantized_matmul` multiplies
fake-quantized operands and is a `jax.custom_vjp` whose backward follows the
policy's backward-state rule (docs/design/studies.md, "Numerics studies"):

- `reuse`: the backward reads the forward's rounded operands (their codes and
  scales are the residuals):  `dx = g @ wq.T`, `dw = xq.T @ g`.
- `fresh`: the backward re-quantizes the saved high-precision operands, and
  the cotangent `g`, for its own reduction axes:
  `dx = Q_N(g) @ Q_N(w).T` (reduction over N: `w` along axis 1, `g` along its
  last axis) and `dw = Q_T(x).T @ Q_T(g)` (reduction over the T tokens, all
  leading axes of `x` and `g` flattened: both along the token axis).
  `g` and `x` are quantized only when the format quantizes activations; for
  weights-only formats (ternary, binary) `fresh` equals `reuse`. Where the
  backward's reduction axis (N or T) is not a multiple of the block size, the
  operand is padded with zeros to the next multiple, quantized and sliced back;
  zero padding leaves every block amax (and the NVFP4 tensor amax) unchanged, so
  the real elements are quantized as they would be in a longer tensor.

Both modes give the plain f32 gradients when `fmt` is None. For block formats
they differ, because a block along K (forward) is not a block along N or T.

The products of two quantized operands: the rebuilt f32 values at `HIGHEST`, the reference,
on every platform but one. Lowered for `cuda`, a per-tensor FP8 format (`FP8_GEMM_FORMATS`)
multiplies the codes themselves, an FP8 x FP8 product accumulated in f32 (XLA:GPU's FP8
GEMM: 1 byte an operand element, the tensor cores' FP8 rate on Hopper and later), and
scales the result, `s_x[t] * s_w * (c_x @ c_w)` (`fp8_codes_product`): the same value up to
the order of f32 roundings (each code product is exact in f32). That is the forward's
product, and under `fresh` the backward's two as well (each operand quantized there); the
`reuse` backward multiplies the unquantized cotangent, so its products stay the
reference's. The policy's `kernels=off` keeps the reference on a GPU too (what the FP8
GEMMs are measured against).

Kernels: every quantize and dequantize here goes through
`jaxrl_lp.kernels.quantize`, whose `kernels` mode (`auto`, `on`, `off`,
`interpret`; a policy's `kernels` field) picks the Pallas kernel or the jnp
reference. The two are bit-equal, so values and gradients do not depend on it;
`auto` runs the reference on CPU (the recorded programs are unchanged).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.kernels.quantize import dequantize, kernels_mode, quantize
from jaxrl_lp.numerics.formats import FORMATS, QArray
from jaxrl_lp.numerics.policy import BACKWARD_MODES

__all__ = ["FP8_GEMM_FORMATS", "INVARIANT_FORMATS", "QUANTIZED_WEIGHT_FORMATS", "activation_values",
           "fake_quant", "fp8_codes_product", "quantized_matmul"]

_HIGHEST = jax.lax.Precision.HIGHEST
# The formats whose products are FP8 GEMMs of the codes where lowered for cuda (module
# docstring): one f32 scale per tensor (per token for the activations).
FP8_GEMM_FORMATS: tuple[str, ...] = ("fp8", "fp8_e5m2")
# The formats whose `QArray` a product takes as `Q(w)` as it is (`quantized_matmul`,
# `models.layers.dot`; the decode's copy, `models.blocks.decode_weights`, quantizes in them
# once): those whose quantizer gives a quantized value back unchanged (`Q(dequantize(Q(w)))`
# has `Q(w)`'s value), so a weight quantized already is the same operand whether it is the
# decode's copy, a served weight or a LoRA base. The MX formats hold it by construction (a
# rebuilt block's largest value has the block's exponent: its scale is the same); NVFP4's
# block scale, `amax / 6` rounded to E4M3, may round otherwise for a rebuilt block, and the
# mean-abs scales of `ternary` and `binary` move (tests/test_fp8_gemm.py counts both).
QUANTIZED_WEIGHT_FORMATS: tuple[str, ...] = (*FP8_GEMM_FORMATS, "mxfp8", "mxfp4")
# The formats whose quantizer sums nothing: every scale comes from maxima (exact in any order)
# and every code from one correctly rounded division (`numerics.formats`), so a token's `Q(x)`
# and a weight's `Q(w)` are the same bits in every program that computes them, whatever the
# rows beside them or the fusions around them. The batch-invariant forms then carry over to
# their products (`models.layers.dot`, docs/design/invariant.md). Not `ternary` or `binary`:
# their scale is a mean, a sum whose order a program's reduction picks.
INVARIANT_FORMATS: tuple[str, ...] = (*QUANTIZED_WEIGHT_FORMATS, "nvfp4")


def fake_quant(
    x: jax.Array, fmt: str | None, axis: int = 0, batch_axes: Sequence[int] = (),
    kernels: str = "auto",
) -> jax.Array:
    """`dequantize(quantize(x, fmt, axis, batch_axes))` with an identity gradient.

    Maths: forward `Q(x)`; straight-through estimator `dQ(x)/dx := I`.

    Args:
      x: floating array.
      fmt: a key of `FORMATS`, or None (then `x` in f32 is returned).
      axis: the reduction axis (block formats take their blocks along it).
      batch_axes: axes of independent tensors (see `quantize`).
      kernels: kernels mode of the quantize/dequantize (module docstring).

    Returns:
      f32 array of `x`'s shape holding values of the format.

    Examples:
      >>> jax.grad(lambda x: fake_quant(x, "mxfp4", 0).sum())(jnp.ones(32)).tolist()[:2]
      [1.0, 1.0]
    """
    if fmt is None:
        # Upcast: fake-quantized values are always f32.
        return jnp.asarray(x).astype(jnp.float32)
    return _fake_quant(x, fmt, axis, tuple(batch_axes), kernels_mode(kernels))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _fake_quant(x, fmt, axis, batch_axes, kernels):
    return dequantize(quantize(x, fmt, axis, batch_axes, kernels=kernels), kernels=kernels)


@_fake_quant.defjvp
def _fake_quant_jvp(fmt, axis, batch_axes, kernels, primals, tangents):
    (x,), (t,) = primals, tangents
    # Upcast: the tangent follows the f32 output (straight-through).
    return _fake_quant(x, fmt, axis, batch_axes, kernels), t.astype(jnp.float32)


def activation_values(x_xK: jax.Array, fmt: str | None, batch_axes: Sequence[int] = (),
                      kernels: str = "auto") -> jax.Array:
    """The f32 values `quantized_matmul(x, w, fmt, batch_axes=batch_axes)` multiplies for `x`:
    `Q(x)` along its last axis where the format quantizes activations, else `x` in f32."""
    if not _quantizes_x(fmt):
        # Upcast: unquantized operands enter the matmul in f32.
        return jnp.asarray(x_xK).astype(jnp.float32)
    lead = x_xK.ndim - 1
    batch = tuple(sorted({b % lead for b in batch_axes}))
    return _value(_q(x_xK, fmt, -1, batch, kernels_mode(kernels)), kernels_mode(kernels))


def quantized_matmul(
    x_xK: jax.Array,
    w_KxN: jax.Array | QArray,
    fmt: str | None,
    backward: str = "reuse",
    batch_axes: Sequence[int] = (),
    kernels: str = "auto",
    product: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """`Q(x) @ Q(w)` in f32 with a `reuse` or `fresh` backward (module docstring).

    Maths: `y = xq @ wq` where `wq = Q(w)` along axis 0 (K) and `xq = Q(x)` along
    its last axis (K) when `FORMATS[fmt].quantizes_activations`, else `xq = x`.
    Products use `precision=HIGHEST` and accumulate in f32. Gradients: see the
    module docstring; `dx` and `dw` are returned in the dtypes of `x` and `w`.

    Args:
      x_xK: activations `[..., K]` (any leading axes; `x` in the text).
      w_KxN: weight `[K, N]` (one tensor; scan or vmap over stacked layers), or that
        weight quantized already along K (a `QArray` of `fmt`, one of
        `QUANTIZED_WEIGHT_FORMATS`: the decode's copy, `models.blocks.decode_weights`), taken
        as `Q(w)`: `Q` of its value is the same value. It gets no gradient (zeros). Under
        `fresh` the input gradient quantizes its value along N, as that of a plain weight
        holding it (a block format's differs there from the master `w`'s).
      fmt: a key of `FORMATS`, or None for a plain f32 matmul.
      backward: `reuse` or `fresh`.
      batch_axes: leading axes of `x` whose indices are independent tensors for
        the per-tensor activation scales (`fp8`, `fp8_e5m2`, the NVFP4 tensor
        scale); e.g. all leading axes gives per-token scales, so that a token's
        output does not depend on the rest of the batch. The `fresh` backward
        uses them for `g` in `dx`; in `dw` the tokens are the reduction axis and
        the scales are per tensor (or per block of tokens).
      kernels: kernels mode of every quantize/dequantize (module docstring);
        a policy's `kernels` field.
      product: the forward's product of the operands' f32 values, `[..., K] x [K, N] ->
        [..., N]`, in place of the reference (`models.layers.dot` hands the batch-invariant
        forms' product here); None: the reference, or the FP8 GEMM of the codes. The
        backward is the same either way.

    Returns:
      f32 array `[..., N]`.

    Examples:
      >>> x_BxTxK, w_KxN = jnp.ones((2, 8, 64)), jnp.ones((64, 16))
      >>> quantized_matmul(x_BxTxK, w_KxN, "mxfp8", backward="fresh").shape
      (2, 8, 16)
    """
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward {backward!r} is not one of {list(BACKWARD_MODES)}")
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown number format {fmt!r}; allowed: None or {list(FORMATS)}")
    if isinstance(w_KxN, QArray):
        w_KxN = _as_q_of_weight(w_KxN, fmt)
    if len(w_KxN.shape) != 2 or x_xK.ndim < 1 or x_xK.shape[-1] != w_KxN.shape[0]:
        raise ValueError(
            f"quantized_matmul: x must be [..., K] and w [K, N]; got x {x_xK.shape}, "
            f"w {w_KxN.shape}"
        )
    lead = x_xK.ndim - 1
    batch = []
    for b in batch_axes:
        if not -lead <= b < lead:
            raise ValueError(
                f"quantized_matmul: batch axis {b} must be a leading axis of x {x_xK.shape}"
            )
        batch.append(b % lead)
    return _qmm(
        x_xK,
        w_KxN,
        fmt,
        backward,
        tuple(sorted(set(batch))),
        np.dtype(x_xK.dtype),
        None if isinstance(w_KxN, QArray) else np.dtype(w_KxN.dtype),  # None: no gradient
        kernels_mode(kernels),
        product,
    )


def _as_q_of_weight(wq: QArray, fmt: str | None) -> QArray:
    """`wq`, a weight `[K, N]` quantized already, checked to be `Q(w)` in `fmt` along K, its
    block axis 0 (a layer sliced off a stacked `[L, K, N]` keeps the stack's axis)."""
    if wq.format != fmt or fmt not in QUANTIZED_WEIGHT_FORMATS:
        raise ValueError(f"quantized_matmul: a quantized weight is taken as Q(w) in its own "
                         f"format, one of {QUANTIZED_WEIGHT_FORMATS}: got a {wq.format} weight "
                         f"for fmt {fmt!r}; pass its value (dequantize) instead")
    bs = FORMATS[fmt].block_size
    if bs is None:
        return wq
    k, n = wq.codes.shape
    if wq.scales.shape != (k // bs, n):
        raise ValueError(f"quantized_matmul: a {fmt} weight [{k}, {n}] quantized along K has "
                         f"block scales [{k // bs}, {n}], not {list(wq.scales.shape)}")
    return dataclasses.replace(wq, axis=0, batch_axes=())


def _quantizes_x(fmt: str | None) -> bool:
    return fmt is not None and FORMATS[fmt].quantizes_activations


def _dot(a: jax.Array, b: jax.Array, a_axis: int, b_axis: int) -> jax.Array:
    """Contracts `a_axis` of `a` with `b_axis` of `b` in f32 at HIGHEST precision."""
    dims = (((a_axis % a.ndim,), (b_axis % b.ndim,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _q(x: jax.Array, fmt: str | None, axis: int, batch_axes, kernels) -> QArray | jax.Array:
    """The QArray of `x`, or `x` in f32 when there is nothing to quantize."""
    if fmt is None:
        # Upcast: unquantized operands enter the matmul in f32.
        return x.astype(jnp.float32)
    return quantize(x, fmt, axis, batch_axes, kernels=kernels)


def _value(q: QArray | jax.Array, kernels) -> jax.Array:
    # Upcast: operands enter the matmul in f32 (products of format values are exact).
    return dequantize(q, kernels=kernels) if isinstance(q, QArray) else q.astype(jnp.float32)


def _q_padded(x: jax.Array, fmt: str | None, axis: int, kernels,
              batch_axes=()) -> QArray | jax.Array:
    """Quantizes along `axis`: the `QArray` where the axis holds whole blocks (every
    per-tensor format), else the values quantized with the axis zero-padded to a multiple of
    the block size and sliced back."""
    if fmt is None:
        # Upcast: unquantized operands enter the matmul in f32.
        return x.astype(jnp.float32)
    axis %= x.ndim
    n, bs = x.shape[axis], FORMATS[fmt].block_size
    if bs is None or n % bs == 0:
        return quantize(x, fmt, axis, batch_axes, kernels=kernels)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, bs - n % bs)
    y = _value(quantize(jnp.pad(x, pad), fmt, axis, batch_axes, kernels=kernels), kernels)
    return jax.lax.slice_in_dim(y, 0, n, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _qmm(x, w, fmt, backward, batch_axes, x_dtype, w_dtype, kernels, product):
    return _qmm_fwd(x, w, fmt, backward, batch_axes, x_dtype, w_dtype, kernels, product)[0]


def fp8_codes_product(aq: QArray, bq: QArray, a_axis: int = -1, b_axis: int = 0) -> jax.Array:
    """`dequantize(aq)` contracted with `dequantize(bq)` as an FP8 GEMM of their codes, f32.

    Axis `a_axis` of `aq` against axis `b_axis` of `bq` (the output: `aq`'s other axes, then
    `bq`'s, as `lax.dot_general`), `(c_a . c_b) * s_a * s_b`: per-tensor FP8 `QArray`s, `aq`
    with one scale per index of its other axes or one for all (a token's, or the tensor's),
    `bq` with one scale. The codes' product accumulates in f32 (each product of two codes is
    exact there); the scales multiply the sum, `aq`'s first. The module docstring says where
    it runs: the forward's `x @ w` (the defaults) and the `fresh` backward's two products.
    """
    if aq.format not in FP8_GEMM_FORMATS or bq.format not in FP8_GEMM_FORMATS:
        raise ValueError(f"fp8_codes_product: per-tensor FP8 operands ({FP8_GEMM_FORMATS}), "
                         f"not {aq.format} x {bq.format}")
    a_axis, b_axis = a_axis % aq.codes.ndim, b_axis % bq.codes.ndim
    if bq.scales.size != 1 or aq.scales.shape[a_axis] != 1:
        raise ValueError(f"fp8_codes_product: one scale for the second operand and none along "
                         f"the contracted axis of the first, not scales {aq.scales.shape} and "
                         f"{bq.scales.shape}")
    y = jax.lax.dot_general(aq.codes, bq.codes, (((a_axis,), (b_axis,)), ((), ())),
                            preferred_element_type=jnp.float32)
    s_a = jnp.squeeze(aq.scales, a_axis).reshape(
        *aq.scales.shape[:a_axis], *aq.scales.shape[a_axis + 1:], *[1] * (bq.codes.ndim - 1))
    return y * s_a * bq.scales.reshape(())


def _product(aq, bq, a_axis: int, b_axis: int, fmt: str | None, kernels: str) -> jax.Array:
    """`Q(a)` contracted with `Q(b)` (`aq`, `bq`: `QArray`s or arrays taken as they are): the
    reference, or lowered for cuda the FP8 GEMM of the codes (module docstring)."""
    reference = lambda: _dot(_value(aq, kernels), _value(bq, kernels), a_axis, b_axis)
    if (fmt not in FP8_GEMM_FORMATS or kernels == "off"
            or not (isinstance(aq, QArray) and isinstance(bq, QArray))):
        return reference()
    return jax.lax.platform_dependent(cuda=lambda: fp8_codes_product(aq, bq, a_axis, b_axis),
                                      default=reference)


def _qmm_fwd(x, w, fmt, backward, batch_axes, x_dtype, w_dtype, kernels, product):
    xq = _q(x, fmt, -1, batch_axes, kernels) if _quantizes_x(fmt) else x
    wq = w if isinstance(w, QArray) else _q(w, fmt, 0, (), kernels)
    y = (_product(xq, wq, -1, 0, fmt, kernels) if product is None
         else product(_value(xq, kernels), _value(wq, kernels)))
    # reuse keeps the rounded operands (codes + scales); fresh keeps x and w.
    res = (xq, wq) if backward == "reuse" else (x, w)
    return y, res


def _qmm_bwd(fmt, backward, batch_axes, x_dtype, w_dtype, kernels, product, res, g):
    a, b = res
    n = g.shape[-1]
    if backward == "reuse":
        dx = _dot(g, _value(b, kernels), -1, 1)
        xv = _value(a, kernels)
        dw = _dot(xv.reshape(-1, xv.shape[-1]), g.reshape(-1, n), 0, 0)
    else:
        x, w = a, (b if w_dtype is not None else _value(b, kernels))
        act = _quantizes_x(fmt)
        # dx reduces over N: w along axis 1, g along its last axis.
        w_dx = _q_padded(w, fmt, 1, kernels)
        g_dx = _q_padded(g, fmt, -1, kernels, batch_axes) if act else g
        # dw reduces over the tokens: flatten leading axes, quantize along axis 0.
        x_TxK = x.reshape(-1, x.shape[-1])
        g_TxN = g.reshape(-1, n)
        x_dw = _q_padded(x_TxK, fmt, 0, kernels) if act else _value(x_TxK, kernels)
        g_dw = _q_padded(g_TxN, fmt, 0, kernels) if act else g_TxN
        dx = _product(g_dx, w_dx, -1, 1, fmt, kernels)
        dw = _product(x_dw, g_dw, 0, 0, fmt, kernels)
    # Rounding site: cotangents take the primal dtypes (a bf16 carrier rounds here).
    if w_dtype is None:  # a weight quantized already (`b` is it): no gradient
        return dx.astype(x_dtype), jax.tree.map(jnp.zeros_like, b)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_qmm.defvjp(_qmm_fwd, _qmm_bwd)
