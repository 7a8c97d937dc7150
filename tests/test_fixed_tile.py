"""The fixed-tile product (`kernels.fixed_tile`): its versions for cuda (Mosaic GPU) and tpu
(Mosaic TPU) run in Pallas's interpreters here, equal to the f32 product within bf16
summation, a row's bits the same at any row count; both lower from this CPU with their kernel
in the program; what they cannot take is refused when lowered, in one line.

What the tiles fix is checked with each row at its place in its tile: the interpreters
compute a tile's product on this CPU (Mosaic GPU's each `wgmma` as a NumPy product, whose BLAS
may sum a row by its place in the tile), so whether a row moved within a tile keeps its bits
is the device's matrix units' property, which `benchmarks/fixed_tile.py` measures on a GPU
(a decode's row b against the learner's row b x T + t).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.kernels import fixed_tile
from jaxrl_lp.kernels.dispatch import KernelUnavailableError
from jaxrl_lp.kernels.fixed_tile import GPU_TILES, TPU_TILES, fixed_tile_product
from jaxrl_lp.kernels.lowering import lower_for

K, N = 200, 150  # neither a multiple of a tile: the contraction and the columns are padded


def _bits(y) -> np.ndarray:
    return np.asarray(y, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2 * TPU_TILES.m + 2, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.bfloat16)
    return x, w


def _rows_alone(x, w, mode, starts, counts):
    """For each (start, count): the product of rows start..start+count alone."""
    return [(s, np.asarray(fixed_tile_product(x[s:s + c], w, interpret=mode)))
            for s, c in zip(starts, counts, strict=True)]


@pytest.mark.parametrize("mode", ["gpu", "tpu"])
def test_rows_keep_their_bits_at_any_row_count(operands, mode):
    x, w = operands
    full = np.asarray(fixed_tile_product(x, w, interpret=mode))
    want = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                              precision="highest"))
    # f32 sums of 200 bf16 products in another order: a few ulps of the row's magnitude
    np.testing.assert_allclose(full, want, rtol=0, atol=4e-6 * np.abs(want).max())
    m = {"gpu": GPU_TILES, "tpu": TPU_TILES}[mode].m
    # Rows at their places in a tile, among 1, 5, m, 7 and 2m + 2 rows (zero rows pad the rest).
    for s, y in _rows_alone(x, w, mode, (0, 0, m, m, 2 * m), (1, 5, m, 7, 2)):
        assert (_bits(y) == _bits(full[s:s + len(y)])).all(), (mode, s, len(y))


def test_a_tile_chosen_by_the_row_count_changes_a_rows_bits(operands, monkeypatch):
    """The plant: tiles picked by M (as a library picks its algorithm by shape) give the rows of
    a 5-row product other bits than among 258 rows; the test above would go red."""
    x, w = operands
    full = np.asarray(fixed_tile_product(x, w, interpret="gpu"))
    tiled = fixed_tile._tiled

    def by_rows(version, tiles, x_MxK, w_KxN, interpret):
        if x_MxK.shape[0] <= 8:  # few rows: a wider contraction tile, as a split-K would differ
            tiles = tiles._replace(k=2 * tiles.k)
        return tiled(version, tiles, x_MxK, w_KxN, interpret)

    monkeypatch.setattr(fixed_tile, "_tiled", by_rows)
    few = np.asarray(fixed_tile_product(x[:5], w, interpret="gpu"))
    assert (_bits(few) != _bits(full[:5])).any()


@pytest.mark.parametrize("mode", ["gpu", "tpu"])
def test_a_batch_of_products_is_each_product_alone(operands, mode):
    """The attention's products (per sequence and kv head, their own weights) and rows of a
    batch on one weight: each product's bits are those of the product computed alone."""
    x, w = operands
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.standard_normal((2, 3, 9, 40)), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((2, 3, 40, 70)) * 0.2, jnp.bfloat16)
    both = np.asarray(fixed_tile_product(xs, ws, interpret=mode))
    assert both.shape == (2, 3, 9, 70)
    for i, j in ((0, 0), (1, 2)):
        alone = np.asarray(fixed_tile_product(xs[i, j], ws[i, j], interpret=mode))
        assert (_bits(alone) == _bits(both[i, j])).all(), (mode, i, j)
    shared = np.asarray(fixed_tile_product(x.reshape(2, -1, K)[:, :5], w, interpret=mode))
    assert (_bits(shared[1]) == _bits(fixed_tile_product(x.reshape(2, -1, K)[1, :5], w,
                                                         interpret=mode))).all()


def test_gradient_is_the_plain_products(operands):
    x, w = operands
    dy = jnp.asarray(np.random.default_rng(1).standard_normal((x.shape[0], N)), jnp.float32)
    loss = lambda f: lambda a, b: (f(a, b) * dy).sum()
    got = jax.grad(loss(lambda a, b: fixed_tile_product(a, b, interpret="tpu")), (0, 1))(x, w)
    want = jax.grad(loss(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)),
                    (0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        assert (_bits(g.astype(jnp.float32)) == _bits(r.astype(jnp.float32))).all()


@pytest.mark.parametrize("platform, call", [("cuda", "@mosaic_gpu_v2("),
                                            ("tpu", "@tpu_custom_call(")])
def test_lowers_with_its_kernel(platform, call):
    x = jax.ShapeDtypeStruct((32, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 3072), jnp.bfloat16)
    text = lower_for((lambda a, b: fixed_tile_product(a, b), (x, w)), platform)
    assert text.count(call) == 1
    # the attention's scores at Qwen3-0.6B's heads: [B, kv heads, 2 query rows, 128] x slots
    q = jax.ShapeDtypeStruct((32, 8, 2, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((32, 8, 128, 384), jnp.bfloat16)
    text = lower_for((lambda a, b: fixed_tile_product(a, b), (q, k)), platform)
    assert text.count(call) == 1


@pytest.mark.parametrize("platform, dtype, message", [
    ("cuda", jnp.float32, "fixed_tile_product on cuda: its operands are bf16 or f16, not float32"),
    ("cpu", jnp.bfloat16, "compiled versions for cuda (Mosaic GPU) and tpu (Mosaic TPU) only"),
])
def test_refused_when_lowered_where_it_has_no_version(platform, dtype, message):
    x = jax.ShapeDtypeStruct((8, 128), dtype)
    w = jax.ShapeDtypeStruct((128, 128), dtype)
    with pytest.raises(KernelUnavailableError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lower_for((lambda a, b: fixed_tile_product(a, b), (x, w)), platform)


@pytest.mark.parametrize("x_shape, w_shape, interpret, message", [
    ((8, 16), (32, 16), "gpu", r"operands \[\.\.\., M, K\] and \[K, N\] or"),
    ((8,), (8, 16), "gpu", r"not \(8,\) and \(8, 16\)"),
    ((2, 8, 16), (3, 16, 16), "gpu", r"\(the same batch\), not \(2, 8, 16\) and \(3, 16, 16\)"),
    ((8, 16), (16, 16), "cpu", "interpret is None, 'gpu' or 'tpu', not 'cpu'"),
])
def test_bad_arguments_one_line(x_shape, w_shape, interpret, message):
    with pytest.raises(ValueError, match=message):
        fixed_tile_product(jnp.zeros(x_shape, jnp.bfloat16), jnp.zeros(w_shape, jnp.bfloat16),
                           interpret=interpret)


@pytest.mark.parametrize("platform, call", [("cuda", "@mosaic_gpu_v2("),
                                            ("tpu", "@tpu_custom_call(")])
def test_the_forms_programs_in_fixed_tiles_lower_at_qwen3_shapes(platform, call):
    """A decode step and the learner's invariant forward in fixed tiles, Qwen3-0.6B's widths
    (2 of its layers), bf16 stored as on the device, lower from this CPU with every product a
    kernel of the platform: the weights' (q, k, v, o, gate, up, down a layer, and the head)
    and the attention's two, none refused (an f32 operand would be, on cuda). The learner's
    program is traced directly: on a CPU host `jit_learner_logprobs` would take the replay
    (compiled tiles run on a GPU or TPU)."""
    from jaxrl_lp.bench.mosaic_aot import fixed_tiles_programs
    from jaxrl_lp.models.config import get_preset
    from jaxrl_lp.numerics.policy import Policy
    from jaxrl_lp.plan.programs import native

    cfg = get_preset("qwen3-0.6b").replace(num_layers=2)
    programs = fixed_tiles_programs(cfg, native(Policy.parse("bf16")), rows=8)
    text = lower_for(programs["decode_step"], platform)
    # 7 weight products and the attention's 2 a layer, and the head: all the kernel's
    assert text.count(call) == 9 * cfg.num_layers + 1, text.count(call)
    text = lower_for(programs["learner_forward"], platform)
    assert text.count(call) == 9 + 1, text.count(call)  # the layers one scanned body
