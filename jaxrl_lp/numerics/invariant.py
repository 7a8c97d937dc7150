"""Batch-invariant forms: a token's values do not depend on how many rows are computed with it.

The sampler decodes B rows a step; the learner's forward computes B x T
tokens at once. On XLA:CPU the two give a row other bits wherever the
library or the code generator picks its algorithm by size
(docs/design/invariant.md; `benchmarks/batch_invariance.py` measures it):

- a product's rows: `x @ W` runs one YNNPACK kernel at 2-32 rows and another
  at more (and at 1), which sum the contraction in other orders; the decode
  layout's `W @ x.T` (`models.layers.TransposedWeight`) takes its columns in
  tiles of 16 and sums a last tile of 1-8 columns in another order;
- the attention's two products (batched over sequences and kv heads) the
  same way, by their query rows;
- reductions and the elementwise work beside them (norms, softmax,
  log-softmax): XLA:CPU hands large ones to YNNPACK (its own sums and its
  own `exp`) and emits small ones as a tree of reduce-windows.

The invariant forms fix each of these:

- `weights_major(x, w_NxK)`: the product as `W @ x.T` with the rows padded to
  a multiple of the kernel's column tile (`column_tile`: 16 on an AVX2 CPU,
  64 on an AVX-512 one, found by a probe), so every column is computed by the
  full-tile kernel whatever the row count; the decode's weights are its
  `[out, in]` copy (the `transposed` layout's), the learner transposes its
  stored weights in its program (`invariant_dot`, whose backward is the plain
  product's);
- `attention_scores` / `attention_values`: the attention's products in the
  same form per (sequence, kv head), the keys and values as the row operand
  and the query rows as columns, padded;
- `COMPILER_OPTIONS`: the programs that use the forms are compiled with
  YNNPACK fusions for dots only, so every reduction and elementwise op is
  XLA's own, whose per-row arithmetic does not depend on the row count.

A program opts in by tracing inside `invariant_forms()` (the sampler's
program in the `invariant` decode layout, the learner's `invariant`
log-probs) and being jitted with `COMPILER_OPTIONS`. The forms are proven on
XLA:CPU only (`unsupported` names why elsewhere); each run checks them at its
own shapes before it writes anything (`train.probe`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.products import precision_for, product

__all__ = ["COLUMN_TILES", "COMPILER_OPTIONS", "active", "apart", "attention_scores",
           "attention_values", "column_tile", "invariant_dot", "invariant_forms", "opaque_zero",
           "pad_rows", "rsqrt", "total", "unsupported", "weights_major"]

# The column tiles `column_tile` tries, smallest first: YNNPACK's f32 product kernel takes
# the columns of `W @ x.T` in tiles of 16 on an AVX2 CPU (a last tile of 1-8 columns summed
# in another order) and of 64 on an AVX-512 one (a last tile of 1-48 columns otherwise).
COLUMN_TILES = (16, 32, 64, 128)
# YNNPACK fusions for dots only: reductions and elementwise ops are XLA's own loops, whose
# bits per row do not depend on the row count (with YNNPACK's reductions and `exp` they do).
COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

# Inside `invariant_forms`: the trace's opaque int32 zero (`apart`); None outside.
_ACTIVE: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "jaxrl_lp_invariant", default=None)


@contextlib.contextmanager
def invariant_forms(zero: jax.Array, on: bool = True) -> Iterator[None]:
    """Within the block (while tracing), the model takes the invariant forms.

    Enter it inside the function that is jitted, with `on` derived from that
    function's static arguments, as `parallel.use_mesh` is. `zero` is
    `opaque_zero` of one of that function's inputs: `apart` needs a zero the
    compiler cannot see.
    """
    token = _ACTIVE.set(zero if on else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether the enclosing trace takes the invariant forms (`invariant_forms`)."""
    return _ACTIVE.get() is not None


def unsupported(platform: str | None = None, mesh=None) -> str | None:
    """Why the invariant forms cannot stand for the decode's bits here, or None.

    They are built and proven for XLA:CPU on one device: a GPU's or TPU's
    libraries pick their kernels by their own rules, and a mesh splits rows
    over devices. A run that asks for them there replays the decode instead.
    """
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return f"the invariant forms are proven on XLA:CPU only, not {platform}"
    if mesh is not None:
        return "the invariant forms run on one device, not a mesh"
    if platform == jax.default_backend() and column_tile() is None:
        return (f"no column tile of {COLUMN_TILES} gives this CPU's product kernel a column's "
                "bits whatever the column count")
    return None


@functools.cache
def column_tile() -> int | None:
    """The smallest tile of `COLUMN_TILES` whose multiples of columns give `W @ x.T` (f32,
    XLA:CPU's product kernel under `COMPILER_OPTIONS`) every column's bits of a product over
    1024 columns, or None when none does.

    Which kernel sums a column, and in which order, depends on the CPU's vector width, so
    it is probed here (once a process: a few small programs) rather than assumed.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 128)).astype(np.float32)
    w = (rng.standard_normal((64, 128)) * 0.05).astype(np.float32)
    dims = (((1,), (1,)), ((), ()))
    with jax.ensure_compile_time_eval():
        cols = jax.jit(lambda w, x: jax.lax.dot_general(w, x, dims,
                                                        precision=jax.lax.Precision.HIGHEST),
                       compiler_options=COMPILER_OPTIONS)
        bits = lambda y: np.asarray(y).view(np.uint32)
        wide = bits(cols(w, x))
        for tile in COLUMN_TILES:
            if all((bits(cols(w, x[:n])) == wide[:, :n]).all() for n in (tile, 2 * tile, 3 * tile)):
                return tile
    return None


def apart(x: jax.Array) -> jax.Array:
    """`x` as it is; inside `invariant_forms`, a value no fused multiply-add can absorb.

    XLA:CPU compiles with fused multiply-add contraction allowed: a product that
    feeds a sum in the same fused loop is contracted into one rounding, and which
    values share a fused loop differs from program to program (a gradient's program
    fuses its forward otherwise). Here the value's bits are XORed with the trace's
    opaque zero (`invariant_forms`' `zero`: computed from a program input, so neither
    XLA nor LLVM can fold it), and the sum that reads it adds the rounded value in
    every program. Floating types of 2, 4 or 8 bytes.
    """
    state = _ACTIVE.get()
    if state is None:
        return x
    ints = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(x.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(x, ints) ^ state.astype(ints)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


def total(x: jax.Array, axis: int = -1) -> jax.Array:
    """`jnp.sum(x, axis, keepdims=True)`; inside `invariant_forms`, summed as a fixed tree.

    XLA:CPU emits a reduction by the shape and the fusion it lands in (with a
    transposed producer fused into it, the small preset's norms came out in other
    bits at one row than at many), so the sum is written out: zeros pad the axis to a
    power of two and each level adds the second half to the first, elementwise
    additions whose order no emitter chooses. Floating values."""
    if not active():
        return jnp.sum(x, axis=axis, keepdims=True)
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return jnp.moveaxis(x, -1, axis)


def rsqrt(x: jax.Array) -> jax.Array:
    """`lax.rsqrt(x)`; inside `invariant_forms`, `1 / sqrt(x)`: two correctly rounded
    operations, the same bits in a vectorized loop and in a scalar one (XLA:CPU's
    `rsqrt` is an approximation whose vector and scalar forms may differ)."""
    if not active():
        return jax.lax.rsqrt(x)
    return 1.0 / jnp.sqrt(x)


def opaque_zero(count: jax.Array) -> jax.Array:
    """An int32 zero computed from `count`, a program input that is never negative
    (a weights version): `min(count, 0)`, which no compiler can fold (`apart`)."""
    return jnp.minimum(jnp.asarray(count, jnp.int32).reshape(()), 0)


def pad_rows(x: jax.Array, axis: int, tile: int | None = None) -> jax.Array:
    """`x` with zeros appended along `axis` to a multiple of `tile` entries (default: this
    CPU's `column_tile`)."""
    pad = -x.shape[axis] % (tile or column_tile() or 1)
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _columns_product(w_xNxK: jax.Array, x_xRxK: jax.Array, batch: int) -> jax.Array:
    """`w @ x.T` over `batch` leading axes, the rows of `x` padded to whole column tiles:
    `[*lead, N, R]` f32.

    The barrier keeps the `[N, Rp]` product in memory as computed (as the `transposed`
    layout's product, `models.layers.TransposedWeight`).
    """
    r = x_xRxK.shape[-2]
    lead = tuple(range(batch))
    dims = (((batch + 1,), (batch + 1,)), (lead, lead))
    w_xNxK, x_xRpxK = jax.lax.optimization_barrier((w_xNxK, pad_rows(x_xRxK, batch)))
    y = jax.lax.dot_general(w_xNxK, x_xRpxK, dims,
                            precision=precision_for(w_xNxK, x_xRxK),
                            preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(y)[..., :r]


def weights_major(x_RxK: jax.Array, w_NxK: jax.Array) -> jax.Array:
    """`x @ w_NxK.T` in f32, `[R, N]`, each row's bits independent of R (module docstring)."""
    with jax.named_scope("weights_major"):
        y = _columns_product(w_NxK, x_RxK, 0)
    return jax.lax.optimization_barrier(y.T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def invariant_dot(x_xK: jax.Array, w_KxN: jax.Array, policy: Policy) -> jax.Array:
    """`product("...k,kn->...n", x, w, policy)` by `weights_major`: the f32 accumulator.

    The stored `[in, out]` weight is transposed in the program, so the sums
    are those of the decode's `[out, in]` copy. The gradient is the plain
    product's (`numerics.products`): only the value has to be the decode's.
    """
    k, n = w_KxN.shape
    return weights_major(x_xK.reshape(-1, k), w_KxN.T).reshape(*x_xK.shape[:-1], n)


def _invariant_dot_fwd(x, w, policy):
    return invariant_dot(x, w, policy), (x, w)


def _invariant_dot_bwd(policy, res, g):
    x, w = res
    _, vjp = jax.vjp(lambda x, w: product("...k,kn->...n", x, w, policy), x, w)
    return vjp(g)


invariant_dot.defvjp(_invariant_dot_fwd, _invariant_dot_bwd)


def attention_scores(q_BxKxMxDh: jax.Array, k_BxKxSxDh: jax.Array) -> jax.Array:
    """`q @ k.T` per (sequence, kv head), `[B, K, M, S]` f32, each query row's bits
    independent of M: the keys are the row operand and the M query rows the columns."""
    y = _columns_product(k_BxKxSxDh, q_BxKxMxDh, 2)  # [B, K, S, M]
    return jax.lax.optimization_barrier(jnp.swapaxes(y, 2, 3))


def attention_values(p_BxKxMxS: jax.Array, v_BxKxSxDh: jax.Array) -> jax.Array:
    """`p @ v` per (sequence, kv head), `[B, K, M, Dh]` f32, each query row's bits
    independent of M: `v.T` (materialized) is the row operand, the weights the columns."""
    v_t = jax.lax.optimization_barrier(jnp.swapaxes(v_BxKxSxDh, 2, 3))  # [B, K, Dh, S]
    y = _columns_product(v_t, p_BxKxMxS, 2)  # [B, K, Dh, M]
    return jax.lax.optimization_barrier(jnp.swapaxes(y, 2, 3))
