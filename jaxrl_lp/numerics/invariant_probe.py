"""What this CPU's product kernels hold: the row chunks and column tiles the invariant forms
(`numerics.invariant`) may take, found by probes once a process.

Which kernel XLA:CPU (YNNPACK) sums a product's row with, and in which order, depends on
the CPU, the contraction width and the dtype (docs/design/invariant.md), so the forms'
chunks and tiles are probed here on small programs compiled as the forms' are
(`COMPILER_OPTIONS`, the weights-major form's `columns_product`), never assumed.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.numerics.products import precision_for

__all__ = ["COLUMN_TILES", "COMPILER_OPTIONS", "ROW_CHUNKS", "column_residues", "column_tile",
           "columns_product", "padded_rows", "row_chunk"]

# YNNPACK fusions for dots only: reductions and elementwise ops are XLA's own loops, whose
# bits per row do not depend on the row count (with YNNPACK's reductions and `exp` they do).
COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

# The row chunks `row_chunk` tries, largest first: YNNPACK's product kernel for 2-32 rows
# gives a row the same bits at any row count in that range, and another kernel runs at more.
ROW_CHUNKS = (32, 16, 8, 4)
# The column tiles `column_tile` tries, smallest first: a weights-major product `w @ x.T`
# sums each of its columns (the rows of `x`) by the kernel of the tile the column lands in.
COLUMN_TILES = (8, 16, 32, 64)


def _probe_cases(rng) -> list[tuple[Callable, np.ndarray, np.ndarray]]:
    """(product of rows, rows, other operand): weight products `[M, K] @ [K, N]` in f32 and
    bf16 at contraction widths whose kernels differ, and the attention's batched products."""
    def weights(dtype):
        precision = jax.lax.Precision.HIGHEST if dtype == np.float32 else None
        return lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                                precision=precision,
                                                preferred_element_type=jnp.float32)
    scores = lambda q, k: jnp.einsum("bkmd,bksd->bkms", q, k, precision="highest")
    values = lambda p, v: jnp.einsum("bkms,bksd->bkmd", p, v, precision="highest")
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    cases = []
    for k, n in ((512, 256), (1408, 128)):
        x, w = normal(ROW_CHUNKS[0], k), normal(k, n) * 0.05
        cases.append((weights(np.float32), x, w))
        cases.append((weights(jnp.bfloat16), x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
    q, kv = normal(2, 2, ROW_CHUNKS[0], 64), normal(2, 2, 96, 64)
    cases += [(scores, q, kv), (values, normal(2, 2, ROW_CHUNKS[0], 96), kv)]
    return cases


@functools.cache
def row_chunk() -> int | None:
    """The largest chunk of `ROW_CHUNKS` in which products of 2 to `chunk` rows give every
    row the bits it has among `chunk` rows, wherever it stands (XLA:CPU's product kernel under
    `COMPILER_OPTIONS`, f32 and bf16 weight products and the attention's); None when none
    holds.

    Which kernel sums a row, and in which order, depends on the CPU, so it is probed here
    (once a process: a few small programs) rather than assumed.
    """
    bits = lambda y: np.asarray(y, np.float32).view(np.uint32)
    with jax.ensure_compile_time_eval():
        cases = [(jax.jit(f, compiler_options=COMPILER_OPTIONS), x, w)
                 for f, x, w in _probe_cases(np.random.default_rng(0))]

        def rows(f, x, w, m, shift=0):  # the first m rows, rolled by `shift` within them
            return bits(f(np.roll(x[..., :m, :], shift, axis=-2), w))

        for chunk in ROW_CHUNKS:
            counts = sorted({2, 3, chunk // 2 + 1, chunk - 1})
            if all((rows(f, x, w, chunk, 5) == np.roll(full, 5, -2)).all()
                   and all((rows(f, x, w, m) == full[..., :m, :]).all() for m in counts)
                   for f, x, w in cases for full in [rows(f, x, w, chunk)]):
                return chunk
    return None


def padded_rows(m: int, columns: int, residue: int = 0) -> int:
    """The fewest rows, at least `m`, whose count leaves `residue` over whole tiles of
    `columns` (at least `columns` rows where `residue` is 0)."""
    return m + (residue - m) % columns if m > residue else residue or columns


def columns_product(x_MxK: jax.Array, w_NxK: jax.Array, columns: int,
                    residue: int = 0) -> jax.Array:
    """`x @ w_NxK.T` in f32, `[M, N]`, computed as `w_NxK @ x.T` over all the rows at once, the
    rows padded with zeros to a count that leaves `residue` over whole tiles of `columns`
    (`padded_rows`).

    The barriers keep the product `[N, M]` in memory as computed and the weight's copy as
    given: without them XLA lays the product out as the transpose wants it, or folds a
    transposed copy back into the stored weight's read, and sums otherwise.
    """
    m = x_MxK.shape[0]
    x = jnp.pad(x_MxK, ((0, padded_rows(m, columns, residue) - m), (0, 0)))
    w = jax.lax.optimization_barrier(w_NxK)
    y = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), precision=precision_for(x, w),
                            preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(jax.lax.optimization_barrier(y).T)[:m]


def _columns_cases(rng) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows `[M, K]`, weight `[N, K]`) of weights-major products: f32 and bf16 at the two
    contraction widths of `_probe_cases`, `M` enough rows for 64 of the largest tile."""
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    cases = []
    for k, n in ((512, 256), (1408, 128)):
        x, w = normal(64 * COLUMN_TILES[-1], k), normal(n, k) * 0.05
        cases += [(x, w), (x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))]
    return cases


def _columns_hold(tile: int, residue: int) -> bool:
    """Whether weights-major products of rows padded to `residue` over whole tiles of `tile`
    (`columns_product`) give every row the bits it has in the product of its own group of
    `residue` rows (of `tile` rows where `residue` is 0), whatever the other rows of the group
    (zeros included), the number of tiles or the row's group (`_columns_cases`' products)."""
    bits = lambda y: np.asarray(y, np.float32).view(np.uint32)
    unit = residue or tile
    with jax.ensure_compile_time_eval():
        product = jax.jit(columns_product, static_argnums=(2, 3),
                          compiler_options=COMPILER_OPTIONS)

        def holds(x, w):  # lazily, so a tile that fails stops compiling early
            many = x[:64 * tile + residue]
            full = bits(product(many, w, tile, residue))
            pairs = itertools.chain(
                ((many[i * unit:(i + 1) * unit], full[i * unit:(i + 1) * unit])
                 for i in range(3)),                                          # a group alone
                ((many[:m], full[:m]) for m in (1, 2, unit - 1)),             # padded
                [(np.roll(many, 5, 0), np.roll(full, 5, 0))])                 # rolled
            return all((bits(product(rows, w, tile, residue)) == want).all()
                       for rows, want in pairs)

        return all(holds(x, w) for x, w in _columns_cases(np.random.default_rng(1)))


@functools.cache
def column_tile() -> int | None:
    """The smallest tile of `COLUMN_TILES` at which a weights-major product (`w @ x.T`,
    `weights_major_product`) gives every row the bits it has in the product of its own tile's
    rows, whatever the other rows of the tile (zeros included), the number of tiles or the
    row's tile; None when none holds (XLA:CPU's product kernel under `COMPILER_OPTIONS`).

    The kernel may sum a narrow last tile of columns otherwise than a full one, so every
    product's rows are padded to whole tiles (and a residue, `column_residues`). Probed once
    a process, as `row_chunk` is.
    """
    return next((tile for tile in COLUMN_TILES if _columns_hold(tile, 0)), None)


@functools.cache
def column_residues() -> tuple[int, ...]:
    """The counts of rows over whole column tiles (`column_tile`) to which a weights-major
    product's rows may be padded, every row then keeping the bits it has in the product of its
    own group of that many rows: 0 (whole tiles) and half a tile where that holds too; () where
    no tile holds.

    Where the kernel sums every column of a product by the count of its columns over whole
    tiles (docs/design/invariant.md names a CPU where it does), products of `k * tile + 1` to
    `k * tile + tile / 2` rows sum each row as one of `tile / 2` rows, the rest as one of
    `tile`: a decode of half a tile of rows then computes half a tile of columns, not a whole
    one. Probed once a process.
    """
    tile = column_tile()
    if tile is None:
        return ()
    return (0,) + ((tile // 2,) if _columns_hold(tile, tile // 2) else ())
