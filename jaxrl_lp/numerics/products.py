"""The model's products of two compute-precision operands, and their backward, by the policy.

`product(spec, a, b, policy)` is `einsum(spec, a, b)` accumulated in f32 (the
accumulator a caller rounds where the policy says). Its precision follows its
operands: `HIGHEST` where an operand is f32 (the CPU's f32-carried low
precision, or an f32 policy: exact products), the platform's default where
both are stored in a low-precision dtype (bf16 tensor-core or MXU products,
f32 accumulation; `HIGHEST` would ask a GPU for an f32 product of values
that are bf16 already).

Its backward, under a low-precision policy, rounds the cotangent to the
compute dtype (`policy.round`) and multiplies it with the saved operands as
they are stored: stored in bf16 (a GPU, a TPU) the two backward products are
bf16 x bf16 with f32 accumulation, where autodiff would form an f32 x bf16
product of the f32 cotangent (an f32 GEMM on a GPU). Each input's gradient is
rounded to that input's dtype, as autodiff's. Where the forward rounds the
accumulator (every layer product, attention's), the cotangent arriving here
is a compute-dtype value already and the rounding changes nothing; where the
accumulator is read in f32 (a looped model's exit gate, attention scores
under the `softmax` region) the backward products take the cotangent
rounded, as mixed-precision training does (FlashAttention's dS, a bf16
autocast's grad outputs). An f32 policy differentiates the einsum as
autodiff does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_lp.numerics.policy import Policy

__all__ = ["precision_for", "product"]


def precision_for(*operands: jax.Array) -> jax.lax.Precision:
    """`HIGHEST` where an operand is f32, else `DEFAULT` (module docstring)."""
    if any(jnp.dtype(x.dtype) == jnp.float32 for x in operands):
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


def _einsum(spec: str, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype,
                      precision=precision_for(a, b))


def product(spec: str, a: jax.Array, b: jax.Array, policy: Policy) -> jax.Array:
    """`einsum(spec, a, b)` as an f32 accumulator, differentiated as the module docstring says."""
    if not policy.is_low_precision:
        return _einsum(spec, a, b, jnp.float32)
    return _low_precision_product(spec, a, b, policy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _low_precision_product(spec, a, b, policy):
    return _einsum(spec, a, b, jnp.float32)


def _fwd(spec, a, b, policy):
    return _einsum(spec, a, b, jnp.float32), (a, b)


def _bwd(spec, policy, res, g):
    a, b = res
    g = policy.round(g)  # the compute dtype, stored in the carrier (bf16 on GPU and TPU)
    # The einsum whose output has the cotangent's dtype: its transposes multiply `g` with the
    # other operand as stored and round to each operand's dtype, as autodiff's would. Each is
    # the transpose of the linear map in one operand (`jax.vjp` would also trace the forward
    # product, dead but counted by a reader of the program, `plan.hotpath`).
    (da,) = jax.linear_transpose(lambda a: _einsum(spec, a, b, g.dtype), a)(g)
    (db,) = jax.linear_transpose(lambda b: _einsum(spec, a, b, g.dtype), b)(g)
    return da, db


_low_precision_product.defvjp(_fwd, _bwd)
