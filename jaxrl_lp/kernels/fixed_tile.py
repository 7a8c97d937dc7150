"""A product whose rows' bits are fixed by its tiles: the same row gives the same result among
any number of rows, at any place.

The invariant forms (`numerics.invariant`, docs/design/invariant.md) make the learner's
parallel forward give the sampler's decode bits. On XLA:CPU they are XLA programs whose
kernels a probe has shown to hold; on a GPU, cuBLAS and XLA's autotuner pick a product's
algorithm (its tiles, a split of the contraction) by its shape, so a decode's `[B, K] @ [K, N]`
and the learner's `[B x T, K] @ [K, N]` may sum a row otherwise. Here the tiles are ours:

    y[i, j] = sum over k-tiles t, in order, of x[i, t] @ w[t, j]     (an f32 accumulator)

with the row tile, the column tile and the contraction tile fixed by the platform and the
dtype, never by M. A row's result then does not depend on how many rows are beside it: every
output tile runs the same instructions over the same contraction tiles in the same order.
That it does not depend on the row's place in its tile either is the matrix units' property
(no instruction mixes rows, and each row's dot product is summed alike), which a device shows
(`benchmarks/fixed_tile.py`). Zero rows pad M to the row tile, zero columns N, zero
contraction entries K (both operands: products of 0). A batch of products
(`[..., M, K] @ [..., K, N]`: the attention's, per sequence and kv head) is one kernel whose
grid adds the batch axis; a weight `[K, N]` is every product's.

Versions (`fixed_tile_product`), one per platform, chosen for the platform lowered for:

- `cuda`: Mosaic GPU (`plgpu.kernel`, Hopper's `wgmma`), a grid of (batch, M / 64, N / 64)
  thread blocks; each pipelines its contraction in tiles of 64 (128 bytes of a 2-byte dtype, the
  swizzle `wgmma` reads) through shared memory, two stages deep, into a register accumulator.
  2-byte operands of one dtype (bf16, f16): `wgmma` reads f32 as tf32, which is not an f32
  product, so an f32 product is refused when lowered for cuda.
- `tpu`: Mosaic TPU (`pallas_call`), a grid of (batch, M / 128, N / 256, K / 256), the
  contraction axis sequential into an f32 scratch accumulator.
- elsewhere (`cpu`, `rocm`): refused when lowered (one line): XLA:CPU's invariant forms are
  `numerics.invariant`'s own.

`interpret="gpu"` / `"tpu"` runs that platform's version in Pallas's interpreter on any host:
what the CPU tests check, at small shapes. Mosaic GPU's interpreter simulates shared memory,
barriers and `wgmma`, each `wgmma` a NumPy product of the tiles, whose BLAS may sum a row by
its place in the tile; the TPU interpreter's tile products are XLA's.

Its gradient is the plain product's (`jax.custom_vjp`): the invariant forms need the forward's
bits, and a backward pass is not part of the decode.

Whether XLA's own products already hold on a GPU, whether these do, and what they cost beside
XLA's, is `benchmarks/fixed_tile.py`'s measurement (`SUITE=invariant benchmarks/gpu.sh`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from jaxrl_lp.kernels.dispatch import refuse

__all__ = ["GPU_TILES", "INTERPRET", "TPU_TILES", "Tiles", "fixed_tile_product", "gpu_misfit"]

INTERPRET = ("gpu", "tpu")


class Tiles(NamedTuple):
    """A product's tiles: `m` rows, `n` columns, `k` of the contraction per step."""

    m: int
    n: int
    k: int


# Mosaic GPU: `wgmma`'s row tile is a warpgroup's 64; the contraction tile is the 128-byte
# swizzle of a 2-byte dtype; 64 columns keep a decode's narrow products (N = 1024) on 16
# thread blocks rather than 8.
GPU_TILES = Tiles(64, 64, 64)
# Mosaic TPU: whole MXU passes (128 x 128 on v5e, 256 wide on v6e), bf16's (16, 128) tiles.
TPU_TILES = Tiles(128, 256, 256)


def gpu_misfit(x_dtype, w_dtype) -> str | None:
    """Why the Mosaic GPU version cannot take these operand dtypes, or None."""
    x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
    if x_dtype != w_dtype:
        return f"its operands are of one dtype, not {x_dtype} and {w_dtype}"
    if x_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (f"its operands are bf16 or f16, not {x_dtype} (Hopper's wgmma reads f32 as tf32, "
                "which is not an f32 product)")
    return None


def _pad_to(x: jax.Array, multiples: tuple[int, int]) -> jax.Array:
    """`x` `[G, R, C]` with zeros appended to R and C up to multiples of `multiples`."""
    pads = [(0, 0)] + [(0, -(-d // m) * m - d)
                       for d, m in zip(x.shape[1:], multiples, strict=True)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _dims(x_GxMxK: jax.Array, w_GxKxN: jax.Array) -> tuple[int, int, int, int, bool]:
    """(G, M, K, N, whether the weight is every product's) of padded operands."""
    return (*x_GxMxK.shape, w_GxKxN.shape[2], w_GxKxN.shape[0] == 1)


def _gpu_version(x_GxMxK: jax.Array, w_GxKxN: jax.Array, tiles: Tiles,
                 interpret: bool) -> jax.Array:
    """The Mosaic GPU kernel on operands padded to `tiles` (module docstring); a weight with a
    batch of 1 is every product's."""
    g, m, k, n, shared = _dims(x_GxMxK, w_GxKxN)
    swizzle = plgpu.find_swizzle(tiles.k * jnp.dtype(x_GxMxK.dtype).itemsize * 8)
    layout = (plgpu.TilingTransform((8, swizzle // jnp.dtype(x_GxMxK.dtype).itemsize)),
              plgpu.SwizzleTransform(swizzle))

    def fixed_tile(x_gmem, w_gmem, y_gmem, y_smem):  # the kernel's name in a compile
        # The grid's indices by name: Mosaic GPU's interpreter reads `axis_index`.
        b, i, j = (jax.lax.axis_index(a) for a in ("g", "m", "n"))

        def accumulate(acc):
            def step(_, x_smem, w_smem):
                plgpu.wgmma(acc, x_smem, w_smem)
                plgpu.wgmma_wait(1)  # the next step's copy overlaps this product

            plgpu.emit_pipeline(
                step, grid=(k // tiles.k,), max_concurrent_steps=2,
                in_specs=[plgpu.BlockSpec((tiles.m, tiles.k), lambda t: (i, t), transforms=layout,
                                          delay_release=1),
                          plgpu.BlockSpec((tiles.k, tiles.n), lambda t: (t, j), transforms=layout,
                                          delay_release=1)],
            )(x_gmem.at[b], w_gmem.at[0 if shared else b])
            y_smem[...] = acc[...]

        pl.run_scoped(accumulate, plgpu.ACC((tiles.m, tiles.n), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[b, pl.ds(i * tiles.m, tiles.m),
                                                  pl.ds(j * tiles.n, tiles.n)])
        plgpu.wait_smem_to_gmem(0)

    options = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        options["interpret"] = InterpretGPUParams()
    return plgpu.kernel(fixed_tile, out_type=jax.ShapeDtypeStruct((g, m, n), jnp.float32),
                        scratch_types={"y_smem": plgpu.SMEM((tiles.m, tiles.n), jnp.float32)},
                        grid=(g, m // tiles.m, n // tiles.n), grid_names=("g", "m", "n"),
                        **options)(x_GxMxK, w_GxKxN)


def _tpu_version(x_GxMxK: jax.Array, w_GxKxN: jax.Array, tiles: Tiles,
                 interpret: bool) -> jax.Array:
    """The Mosaic TPU kernel on operands padded to `tiles` (module docstring); a weight with a
    batch of 1 is every product's."""
    g, m, k, n, shared = _dims(x_GxMxK, w_GxKxN)
    precision = jax.lax.Precision.HIGHEST if x_GxMxK.dtype == jnp.float32 else None

    def body(x_ref, w_ref, y_ref, acc_ref):
        @pl.when(pl.program_id(3) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], precision=precision,
                                preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(3) == pl.num_programs(3) - 1)
        def _():
            y_ref[...] = acc_ref[...]

    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((g, m, n), jnp.float32),
        grid=(g, m // tiles.m, n // tiles.n, k // tiles.k),
        in_specs=[pl.BlockSpec((None, tiles.m, tiles.k), lambda b, i, j, t: (b, i, t)),
                  pl.BlockSpec((None, tiles.k, tiles.n),
                               lambda b, i, j, t: (0 if shared else b, t, j))],
        out_specs=pl.BlockSpec((None, tiles.m, tiles.n), lambda b, i, j, t: (b, i, j)),
        scratch_shapes=[pltpu.VMEM((tiles.m, tiles.n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(x_GxMxK, w_GxKxN)


def _tiled(version, tiles: Tiles, x_xMxK: jax.Array, w_xKxN: jax.Array,
           interpret: bool) -> jax.Array:
    """`version` on the operands padded to `tiles`, their batch dimensions as one, the result
    cut back to `[..., M, N]`."""
    batch, (m, k), n = x_xMxK.shape[:-2], x_xMxK.shape[-2:], w_xKxN.shape[-1]
    x = _pad_to(x_xMxK.reshape(-1, m, k), (tiles.m, tiles.k))
    w = _pad_to(w_xKxN.reshape(-1, k, n), (tiles.k, tiles.n))
    return version(x, w, tiles, interpret)[:, :m, :n].reshape(*batch, m, n)


def _plain(x_xMxK: jax.Array, w_xKxN: jax.Array) -> jax.Array:
    """XLA's product in f32: what the fixed tiles replace, and their gradient."""
    precision = jax.lax.Precision.HIGHEST if x_xMxK.dtype == jnp.float32 else None
    return jnp.matmul(x_xMxK, w_xKxN, precision=precision, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(x_xMxK: jax.Array, w_xKxN: jax.Array, interpret: str | None) -> jax.Array:
    if interpret == "gpu":  # what the compiled version cannot take is no interpreted check
        if (misfit := gpu_misfit(x_xMxK.dtype, w_xKxN.dtype)) is not None:
            raise ValueError(f"fixed_tile_product, interpret='gpu': {misfit}")
        return _tiled(_gpu_version, GPU_TILES, x_xMxK, w_xKxN, True)
    if interpret == "tpu":
        return _tiled(_tpu_version, TPU_TILES, x_xMxK, w_xKxN, True)

    def cuda():
        misfit = gpu_misfit(x_xMxK.dtype, w_xKxN.dtype)
        if misfit is not None:
            return refuse(f"fixed_tile_product on cuda: {misfit}; cast the operands, or let "
                          "the updates replay the decode", _plain(x_xMxK, w_xKxN))
        return _tiled(_gpu_version, GPU_TILES, x_xMxK, w_xKxN, False)

    def elsewhere():
        return refuse("fixed_tile_product has compiled versions for cuda (Mosaic GPU) and tpu "
                      "(Mosaic TPU) only; on XLA:CPU the invariant forms are "
                      "numerics.invariant's, and interpret='gpu' or 'tpu' runs these anywhere",
                      _plain(x_xMxK, w_xKxN))

    return jax.lax.platform_dependent(
        cuda=cuda, tpu=lambda: _tiled(_tpu_version, TPU_TILES, x_xMxK, w_xKxN, False),
        default=elsewhere)


def _product_fwd(x_xMxK, w_xKxN, interpret):
    return _product(x_xMxK, w_xKxN, interpret), (x_xMxK, w_xKxN)


def _product_bwd(interpret, residuals, dy_MxN):
    del interpret
    x_xMxK, w_xKxN = residuals
    return jax.vjp(_plain, x_xMxK, w_xKxN)[1](dy_MxN)


_product.defvjp(_product_fwd, _product_bwd)


def fixed_tile_product(x_xMxK: jax.Array, w_xKxN: jax.Array, *,
                       interpret: str | None = None) -> jax.Array:
    """`x @ w` in f32, `[..., M, N]`, in tiles fixed by the platform and the dtype (module
    docstring): a row's bits do not depend on M or on the row's place.

    Not jitted itself; every platform's version is traced and lowering keeps one.

    Args:
      x_xMxK: rows `[M, K]`, or a batch of them `[..., M, K]` (each product its own).
      w_xKxN: the weight `[K, N]` (read as stored, `[in, out]`), every product's, or one per
        product, `[..., K, N]` with `x`'s batch dimensions.
      interpret: None for the compiled version of the platform lowered for; "gpu" or "tpu":
        that platform's version in Pallas's interpreter, on any host.

    Returns:
      `[..., M, N]` f32. Differentiable: the gradient is the plain product's.

    Raises:
      ValueError: operands that are not `[..., M, K]` and `[K, N]` or `[..., K, N]`, an
        unknown `interpret`, or `interpret="gpu"` with operands the GPU version cannot take
        (`gpu_misfit`).
      KernelUnavailableError: when lowered for a platform with no version (cpu), or for cuda
        with operands it cannot take (`gpu_misfit`).

    Examples:
      >>> y = fixed_tile_product(x, w, interpret="gpu")   # x [M, K], w [K, N], bf16
      >>> s = fixed_tile_product(q_BxKxMxDh, jnp.swapaxes(k_BxKxSxDh, -1, -2))  # [B, K, M, S]
    """
    if interpret not in (None, *INTERPRET):
        raise ValueError(f"fixed_tile_product: interpret is None, 'gpu' or 'tpu', not "
                         f"{interpret!r}")
    x_shape, w_shape = x_xMxK.shape, w_xKxN.shape
    if (x_xMxK.ndim < 2 or w_xKxN.ndim < 2 or x_shape[-1] != w_shape[-2]
            or (w_xKxN.ndim > 2 and w_shape[:-2] != x_shape[:-2])):
        raise ValueError(f"fixed_tile_product: operands [..., M, K] and [K, N] or [..., K, N] "
                         f"(the same batch), not {x_shape} and {w_shape}")
    return _product(x_xMxK, w_xKxN, interpret)
