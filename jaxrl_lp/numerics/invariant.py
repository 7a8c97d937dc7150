"""Batch-invariant forms: a token's values do not depend on how many rows are computed with it.

The sampler decodes B rows a step; the learner's forward computes B x T
tokens at once. On XLA:CPU the two give a row other bits wherever the
library or the code generator picks its algorithm by size
(docs/design/invariant.md; `benchmarks/batch_invariance.py` measures it):

- a product's rows: YNNPACK runs `x @ W` at 1 row, at 2-32 rows and at more
  in kernels that may sum the contraction in other orders (which of them
  agree depends on the CPU, the contraction width and the dtype), and a
  weight read `[out, in]` (the `transposed` decode layout) sums otherwise
  than one read `[in, out]`;
- the attention's two products (batched over sequences and kv heads) the
  same way, by their query rows;
- reductions and the elementwise work beside them (norms, softmax,
  log-softmax): XLA:CPU hands large ones to YNNPACK (its own sums and its
  own `exp`) and emits small ones as a tree of reduce-windows.

The invariant forms fix each of these:

- the weight products in one of two forms (`InvariantForm`, which the
  rollout records; `form_for` picks this CPU's by the probes of
  `numerics.invariant_probe`, `row_chunk` and `column_tile`):
  - weights-major (`columns`): each weight read `[out, in]` (the `transposed`
    layout's copy) as the product's row operand, `w @ x.T`, all the rows at
    once. The kernel sums a column (a row of `x`) by the count of columns
    over whole tiles of the CPU's column tile (`column_tile`, found by a probe;
    docs/design/invariant.md names it by CPU), so the rows are padded with zeros
    to whole tiles and the form's `residue` rows more (`column_residues`: 0, or
    half a tile where that holds too); then a row's bits do not depend on the
    rows beside it, their number or its place. A decode of 8 rows computes 8
    columns where half a tile of 16 holds (a whole tile where the residue is 0),
    the learner's B x T rows the next count with that residue: one whole
    product each. Taken where the tile is at most `MAX_COLUMN_TILE`;
  - row chunks (`columns` None): every product runs over chunks of 2 to
    `chunk` rows (`row_chunk`, found by a probe), in which a row's bits do not
    depend on how many rows are beside it or where it stands; the decode's B
    rows are one chunk when B <= `chunk`, and the learner's B x T rows are cut
    into chunks, each a product of its own (`lax.map`). Whole products of more
    rows are no class: their kernels change again with the row count and the
    widths. Weights are read as stored, `[in, out]`, by the decode and the
    learner alike (an `[out, in]` read sums otherwise);
  either way the learner's forward value is the invariant product, its gradient
  the plain product's (`invariant_dot`);
- `attention_scores` / `attention_values`: the attention's products per
  (sequence, kv head), the query rows in chunks of 2 to `chunk`;
- `COMPILER_OPTIONS`: the programs that use the forms are compiled with
  YNNPACK fusions for dots only, so every reduction and elementwise op is
  XLA's own, whose per-row arithmetic does not depend on the row count.

A form may instead run every product, the weights' and the attention's, in
`kernels.fixed_tile`'s fixed tiles (`InvariantForm.tiles`): a Pallas kernel whose tiles, not a
library's choice, fix a row's bits, for a GPU or TPU (compiled there, interpreted anywhere);
asked for by name, never picked (`unsupported` says where it runs).

A program opts in by tracing inside `invariant_forms(zero, form)` (the
sampler's program in the `invariant` decode layout with its form, the
learner's `invariant` log-probs with the form the rollout records) and being
jitted with `COMPILER_OPTIONS`. The forms are proven on XLA:CPU only
(`unsupported` names why elsewhere); each run checks them at its own shapes
before it writes anything (`train.probe`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_lp.numerics.invariant_probe import (
    COLUMN_TILES,
    COMPILER_OPTIONS,
    ROW_CHUNKS,
    column_residues,
    column_tile,
    columns_product,
    padded_rows,
    row_chunk,
)
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.numerics.products import precision_for, product

__all__ = ["COLUMN_TILES", "COMPILER_OPTIONS", "FIXED_TILES", "MAX_COLUMN_TILE", "ROW_CHUNKS",
           "InvariantForm", "active", "apart", "attention_scores", "attention_values",
           "column_residues", "column_tile", "form_for", "form_holds", "invariant_dot",
           "invariant_forms", "opaque_zero", "padded_rows", "row_chunk", "rsqrt", "total",
           "unsupported", "weights_major_product", "weights_product"]

# The largest column tile the decode takes the weights-major form at: a decode of B rows pads
# them to whole tiles (or half a tile, `column_residues`), which a small tile hides behind the
# weight read and a large one does not (docs/design/invariant.md, "The forms", measures both).
MAX_COLUMN_TILE = 16
# The `tiles` of an `InvariantForm` whose products are `kernels.fixed_tile`'s, and the
# interpreter each names (None: compiled for the platform lowered for).
FIXED_TILES = {"compiled": None, "interpret-gpu": "gpu", "interpret-tpu": "tpu"}


class InvariantForm(NamedTuple):
    """How the invariant forms run a product's rows (`form_for`; a rollout records it).

    chunk: the attention's products (by query rows), and the weight products where `columns`
      is None, run over chunks of 2 to `chunk` rows, each a product of its own.
    columns: the weight products read each weight `[out, in]` (the `transposed` layout's
      copy) as the product's row operand, `w @ x.T`, over all the rows at once, padded with
      zero rows to whole tiles of `columns`, this CPU's column tile (`column_tile`), and
      `residue` rows more. None: the weights read as stored, `[in, out]`, their products in
      row chunks.
    tiles: every product (the weights' and the attention's) is `kernels.fixed_tile`'s, whose
      tiles fix a row's bits by construction: `compiled` (Mosaic GPU on a GPU, Mosaic TPU on
      a TPU), `interpret-gpu` / `interpret-tpu` (that version in Pallas's interpreter, any
      host). `chunk` and `columns` are then unused. None: XLA's products, as above.
    residue: with `columns`, the rows over whole tiles every weight product is padded to, one
      of `column_residues` (0: whole tiles; half a tile, where the decode's rows fill it).
    """
    chunk: int
    columns: int | None = None
    tiles: str | None = None
    residue: int = 0


class _State(NamedTuple):
    zero: jax.Array  # the trace's opaque int32 zero (`apart`)
    form: InvariantForm


# Inside `invariant_forms`: the trace's state; None outside.
_ACTIVE: contextvars.ContextVar[_State | None] = contextvars.ContextVar(
    "jaxrl_lp_invariant", default=None)


@contextlib.contextmanager
def invariant_forms(zero: jax.Array, form: InvariantForm | None) -> Iterator[None]:
    """Within the block (while tracing), the model takes the invariant forms in `form` (None:
    the plain forms).

    Enter it inside the function that is jitted, with `form` derived from that function's
    static arguments (the decode's rows, `form_for`, or the rollout's record), as
    `parallel.use_mesh` is. `zero` is `opaque_zero` of one of that function's inputs:
    `apart` needs a zero the compiler cannot see.
    """
    if form is not None and not isinstance(form, InvariantForm):
        raise TypeError(f"invariant_forms: form is an InvariantForm or None, not {form!r}")
    if form is not None and form.tiles is not None and form.tiles not in FIXED_TILES:
        raise ValueError(f"invariant_forms: tiles is one of {list(FIXED_TILES)} or None, not "
                         f"{form.tiles!r}")
    if form is not None and form.residue and not (
            form.columns is not None and 0 < form.residue < form.columns):
        raise ValueError(f"invariant_forms: {form}: a residue is a count of rows under one "
                         "column tile, for a form with columns")
    token = _ACTIVE.set(None if form is None else _State(zero, form))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether the enclosing trace takes the invariant forms (`invariant_forms`)."""
    return _ACTIVE.get() is not None


def _form() -> InvariantForm:
    state = _ACTIVE.get()
    if state is None:
        raise ValueError("the invariant products are traced inside invariant_forms(zero, form)")
    return state.form


def unsupported(platform: str | None = None, mesh=None,
                form: InvariantForm | None = None) -> str | None:
    """Why the invariant forms (`form`'s, if given) cannot stand for the decode's bits here, or
    None.

    XLA's forms are built and proven for XLA:CPU on one device: a GPU's or TPU's libraries
    pick their kernels by their own rules, and a mesh splits rows over devices. A run that
    asks for them there replays the decode instead. A form whose products are fixed tiles
    (`InvariantForm.tiles`) is asked for by name: compiled on a GPU or TPU, interpreted
    anywhere, on one device.
    """
    platform = platform or jax.default_backend()
    if form is not None and form.tiles is not None:
        if mesh is not None:
            return "the invariant forms run on one device, not a mesh"
        if form.tiles == "compiled" and platform not in ("gpu", "cuda", "tpu"):
            return (f"fixed tiles compiled run on a GPU or TPU, not {platform} (interpret-gpu or "
                    "interpret-tpu run them anywhere)")
        return None
    if platform != "cpu":
        return f"the invariant forms are proven on XLA:CPU only, not {platform}"
    if mesh is not None:
        return "the invariant forms run on one device, not a mesh"
    if platform == jax.default_backend() and row_chunk() is None:
        return (f"no row chunk of {ROW_CHUNKS} gives this CPU's product kernel a row's bits "
                "whatever the rows beside it")
    return None


def form_for(rows: int) -> InvariantForm | None:
    """The form of a decode of `rows` rows on this CPU, or None where no row chunk holds.

    The weight products take the weights-major form where this CPU's column tile is at most
    `MAX_COLUMN_TILE` (`column_tile`), the row chunks elsewhere; the attention's products run
    in row chunks in both. The weights-major form pads the products' rows to the residue of
    `column_residues` that pads the decode's `rows` least (8 rows to 8, not 16, where half a
    tile holds), the smaller residue where two pad alike.
    """
    chunk = row_chunk()
    if chunk is None:
        return None
    tile = column_tile()
    if tile is None or tile > MAX_COLUMN_TILE:
        return InvariantForm(chunk)
    residue = min(column_residues(), key=lambda r: (padded_rows(rows, tile, r), r))
    return InvariantForm(chunk, tile, residue=residue)


def form_holds(form: InvariantForm) -> str | None:
    """Why a rollout sampled in `form` cannot be reproduced by this CPU's products, or None.

    Either form (row chunks or weights-major) is reproduced where its tiles are this CPU's,
    whichever `form_for` picks here; fixed tiles (`InvariantForm.tiles`) wherever they run:
    where they cannot (compiled, lowered for a CPU) the kernel refuses when lowered, in one
    line (`kernels.fixed_tile`), so a CPU host can still lower the program for a GPU or TPU.
    """
    if form.tiles is not None:
        return None
    chunk = row_chunk()
    if chunk is None:
        return unsupported()
    if form.chunk != chunk:
        return (f"the form runs its products in chunks of {form.chunk} rows; this CPU's hold "
                f"in chunks of {chunk}")
    if form.columns is not None and form.columns != (tile := column_tile()):
        return (f"the form sums its weight products in column tiles of {form.columns}; this "
                + ("CPU's weights-major products hold in no tile of "
                   f"{COLUMN_TILES}" if tile is None else f"CPU's hold in tiles of {tile}"))
    if form.columns is not None and form.residue not in column_residues():
        return (f"the form pads its weight products to {form.residue} rows over whole column "
                f"tiles; this CPU's hold at {', '.join(map(str, column_residues()))}")
    return None


def apart(x: jax.Array) -> jax.Array:
    """`x` as it is; inside `invariant_forms`, a value no fused multiply-add can absorb.

    XLA:CPU compiles with fused multiply-add contraction allowed: a product that
    feeds a sum in the same fused loop is contracted into one rounding, and which
    values share a fused loop differs from program to program (a gradient's program
    fuses its forward otherwise). Here the value's bits are XORed with the trace's
    opaque zero (`invariant_forms`' `zero`: computed from a program input, so neither
    XLA nor LLVM can fold it), and the sum that reads it adds the rounded value in
    every program. Its derivative is the identity's (`_xor_zero`): the bits pass
    through integers, which carry no gradient. Floating types of 2, 4 or 8 bytes.
    """
    state = _ACTIVE.get()
    if state is None:
        return x
    return _xor_zero(x, state.zero)


@jax.custom_jvp
def _xor_zero(x: jax.Array, zero: jax.Array) -> jax.Array:
    """`x`'s bits XORed with the int `zero` (`apart`); differentiated as the identity."""
    ints = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(x.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(x, ints) ^ zero.astype(ints)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


@_xor_zero.defjvp
def _xor_zero_jvp(primals, tangents):
    x, zero = primals
    return _xor_zero(x, zero), tangents[0]


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


def _pad(x: jax.Array, rows: int) -> jax.Array:
    """`x` with zero rows appended on axis -2 up to `rows`."""
    if x.shape[-2] >= rows:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rows - x.shape[-2]), (0, 0)])


def _by_rows(fn: Callable[[jax.Array], jax.Array], x_xMxK: jax.Array, chunk: int) -> jax.Array:
    """`fn(x)` for a product `fn` of the rows (axis -2) of `x`, `[..., M, N]`, run in chunks
    of 2 to `chunk` rows: one product where M <= chunk, else a product per chunk of `chunk`
    rows.

    Zero rows fill the last chunk (and a 1-row product, another kernel). The barriers keep
    each product in memory as computed, so no fusion reaches into it.
    """
    m = x_xMxK.shape[-2]
    if m <= chunk:
        x = jax.lax.optimization_barrier(_pad(x_xMxK, 2))
        return jax.lax.optimization_barrier(fn(x))[..., :m, :]
    g = -(-m // chunk)
    lead = x_xMxK.shape[:-2]
    x = _pad(x_xMxK, g * chunk).reshape(*lead, g, chunk, x_xMxK.shape[-1])
    x = jnp.moveaxis(x, -3, 0)  # [G, ..., chunk, K]: a product per chunk
    y = jax.lax.map(lambda c: jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(c))),
                    x)
    y = jnp.moveaxis(y, 0, -3)
    return y.reshape(*lead, g * chunk, y.shape[-1])[..., :m, :]


def weights_major_product(x_MxK: jax.Array, w_NxK: jax.Array) -> jax.Array:
    """`x @ w_NxK.T` in f32, `[M, N]`, for a weight read `[out, in]` (the decode's
    `TransposedWeight` copy) in an active form with `columns`."""
    columns = _form().columns
    if columns is None:
        raise ValueError("invariant forms: a weight read [out, in] is for a form with columns; "
                         "this form reads the weights as stored")
    with jax.named_scope("invariant_columns"):
        return columns_product(x_MxK, w_NxK, columns, _form().residue)


def _fixed_tiles(form: InvariantForm, x_xMxK: jax.Array, w_xKxN: jax.Array) -> jax.Array:
    """`kernels.fixed_tile`'s product in `form`'s version (`FIXED_TILES`)."""
    from jaxrl_lp.kernels.fixed_tile import fixed_tile_product

    return fixed_tile_product(x_xMxK, w_xKxN, interpret=FIXED_TILES[form.tiles])


def weights_product(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
    """`x @ w` in f32, `[M, N]`, in the active form (module docstring): the rows in chunks, or
    with `columns` the weights-major product over a copy of `w` read `[out, in]`."""
    form = _form()
    if form.tiles is not None:
        with jax.named_scope("invariant_tiles"):
            return _fixed_tiles(form, x_MxK, w_KxN)
    if form.columns is not None:
        with jax.named_scope("invariant_columns"):
            return columns_product(x_MxK, w_KxN.T, form.columns, form.residue)
    dot = lambda x: jax.lax.dot_general(x, w_KxN, (((1,), (0,)), ((), ())),
                                        precision=precision_for(x_MxK, w_KxN),
                                        preferred_element_type=jnp.float32)
    with jax.named_scope("invariant_rows"):
        return _by_rows(dot, x_MxK, form.chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def invariant_dot(x_xK: jax.Array, w_KxN: jax.Array, policy: Policy) -> jax.Array:
    """`product("...k,kn->...n", x, w, policy)` by `weights_product`: the f32 accumulator.

    The gradient is the plain product's (`numerics.products`): only the value has to be the
    decode's.
    """
    k, n = w_KxN.shape
    return weights_product(x_xK.reshape(-1, k), w_KxN).reshape(*x_xK.shape[:-1], n)


def _invariant_dot_fwd(x, w, policy):
    return invariant_dot(x, w, policy), (x, w)


def _invariant_dot_bwd(policy, res, g):
    x, w = res
    _, vjp = jax.vjp(lambda x, w: product("...k,kn->...n", x, w, policy), x, w)
    return vjp(g)


invariant_dot.defvjp(_invariant_dot_fwd, _invariant_dot_bwd)


def attention_scores(q_BxKxMxDh: jax.Array, k_BxKxSxDh: jax.Array) -> jax.Array:
    """`q @ k.T` per (sequence, kv head), `[B, K, M, S]` f32, each query row's bits those of
    its chunk class: the M query rows in chunks (`InvariantForm.chunk`), or fixed tiles."""
    if (form := _form()).tiles is not None:
        return _fixed_tiles(form, q_BxKxMxDh, jnp.swapaxes(k_BxKxSxDh, -1, -2))
    dot = lambda q: jax.lax.dot_general(q, k_BxKxSxDh, (((3,), (3,)), ((0, 1), (0, 1))),
                                        precision=precision_for(q_BxKxMxDh, k_BxKxSxDh),
                                        preferred_element_type=jnp.float32)
    return _by_rows(dot, q_BxKxMxDh, _form().chunk)


def attention_values(p_BxKxMxS: jax.Array, v_BxKxSxDh: jax.Array) -> jax.Array:
    """`p @ v` per (sequence, kv head), `[B, K, M, Dh]` f32, the M query rows in chunks, or
    fixed tiles."""
    if (form := _form()).tiles is not None:
        return _fixed_tiles(form, p_BxKxMxS, v_BxKxSxDh)
    dot = lambda p: jax.lax.dot_general(p, v_BxKxSxDh, (((3,), (2,)), ((0, 1), (0, 1))),
                                        precision=precision_for(p_BxKxMxS, v_BxKxSxDh),
                                        preferred_element_type=jnp.float32)
    return _by_rows(dot, p_BxKxMxS, _form().chunk)
