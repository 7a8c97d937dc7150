"""How the MX quantize kernels (`kernels.quantize`) cut a tensor: views, tiles, fits, versions.

The module docstring of `kernels.quantize` describes the views and each
platform's tiles and rules; this is their arithmetic. A plan is checked before
anything is traced: a tile that breaks a compiler's rule or its memory budget
is a `dispatch.Version` with the reason (`cuda_misfit`, `tpu_misfit`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxrl_lp.kernels import dispatch
from jaxrl_lp.kernels.targets import budget_misfit

__all__ = ["CUDA_TILES", "TPU_TILES", "QuantTiles", "along", "compiler_params", "cuda_misfit",
           "local_view", "rows_axes", "specs", "tile_dims", "tile_text", "tpu_misfit", "platform_versions",
           "views", "vmem_bytes"]


class QuantTiles(NamedTuple):
    """A kernel tile: `rows` of P (the `[P, N]` view only), `blocks` scale blocks of N,
    `cols` of Q (the `[P, N, Q]` view only). A dim smaller than its tile is whole (in
    Triton, its next power of two)."""

    rows: int = 1
    blocks: int = 1
    cols: int = 1


# Default tiles by view rank (module docstring).
CUDA_TILES = {2: QuantTiles(rows=32, blocks=4), 3: QuantTiles(blocks=1, cols=128)}
TPU_TILES = {2: QuantTiles(rows=32, blocks=128), 3: QuantTiles(blocks=32, cols=128)}
_LANES, _SUBLANES_8BIT = 128, 32
_TPU_TEMPS = 12  # f32 tile-sized temporaries counted in the VMEM estimate (the high side)
_ONE_HOT_BYTES = 10  # per element of the one-hot matrix: two int32 iotas and the bf16 matrix



def rows_axes(view: tuple[int, ...]):
    """The logical axes of a view's operands under a mesh (`dispatch.per_shard`): an
    activation's `[P, N]` view is P = batch x tokens, split over the batch shards like the
    activation (blocks run along N, within a row); a weight's `[P, N, Q]` view is whole on
    every device (FSDP gathers a weight before its matmul anyway). A P that does not divide
    by the shards stays whole too."""
    if len(view) == 2 and view[0] % dispatch.shard_count("batch") == 0:
        return ("batch", None)
    return None


def local_view(view: tuple[int, ...]) -> tuple[int, ...]:
    """The view one device's kernel sees (`rows_axes`): what its tile is planned for."""
    if rows_axes(view) is None:
        return view
    return (view[0] // dispatch.shard_count("batch"), *view[1:])


def along(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return shape[:axis] + (n,) + shape[axis + 1:]


def views(shape: tuple[int, ...], axis: int, bs: int):
    """The values' view `[P, N(, Q)]`, the scales' `[P, N/bs(, Q)]`, the tensor scale's `[P, 1(, Q)]`."""
    p, n, q = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    if q == 1:
        return (p, n), (p, n // bs), (p, 1)
    return (p, n, q), (p, n // bs, q), (p, 1, q)


def tile_dims(platform: str, view: tuple[int, ...], bs: int, tiles: QuantTiles):
    """(rows, blocks, cols) of `tiles` on `view`: a dim smaller than its tile is whole (cuda: its
    power of two, a Triton block, masked past the end)."""
    fit = (lambda t, d: min(t, 1 << (d - 1).bit_length())) if platform == "cuda" else min
    if len(view) == 2:
        return fit(tiles.rows, view[0]), fit(tiles.blocks, view[1] // bs), 1
    return 1, fit(tiles.blocks, view[1] // bs), fit(tiles.cols, view[2])


def specs(platform: str, view: tuple[int, ...], bs: int, tiles: QuantTiles):
    """BlockSpecs of the values, the scales and the tensor scale, and the grid."""
    tp, nb, tq = tile_dims(platform, view, bs, tiles)
    if len(view) == 2:
        grid = (pl.cdiv(view[0], tp), pl.cdiv(view[1], nb * bs))
        return (pl.BlockSpec((tp, nb * bs), lambda i, j: (i, j)),
                pl.BlockSpec((tp, nb), lambda i, j: (i, j)),
                pl.BlockSpec((tp, 1), lambda i, j: (i, 0)), grid)
    grid = (view[0], pl.cdiv(view[1], nb * bs), pl.cdiv(view[2], tq))
    return (pl.BlockSpec((None, nb * bs, tq), lambda p, j, k: (p, j, k)),
            pl.BlockSpec((None, nb, tq), lambda p, j, k: (p, j, k)),
            pl.BlockSpec((None, 1, tq), lambda p, j, k: (p, 0, k)), grid)


def tile_text(platform, view, bs, tiles) -> str:
    tp, nb, tq = tile_dims(platform, view, bs, tiles)
    dims = (tp, nb * bs) if len(view) == 2 else (nb * bs, tq)
    return f"[{dims[0]}, {dims[1]}] ({nb} blocks of {bs}) of the view {list(view)}"


def cuda_misfit(view, bs, tiles: QuantTiles, x_dtype) -> str | None:
    """Triton: power-of-two blocks; at most one f32 copy of values and scales in shared memory."""
    del x_dtype
    tp, nb, tq = tile_dims("cuda", view, bs, tiles)
    text = tile_text("cuda", view, bs, tiles)
    dims = {"rows": tp, "blocks": nb} if len(view) == 2 else {"blocks": nb, "cols": tq}
    bad = dispatch.pow2_misfit(1, **dims)
    if bad is not None:
        return f"the tile {text}: {bad} (Triton blocks are powers of two)"
    values = tp * nb * bs * tq
    return budget_misfit("cuda", 4 * (values + values // bs), text)


def vmem_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of a VMEM block: its last two dims padded to Mosaic's (8 * 4 / itemsize, 128) tile."""
    *lead, r, c = (1, *shape) if len(shape) == 1 else shape
    sub = 8 * 4 // itemsize
    return math.prod(lead) * (-(-r // sub) * sub) * (-(-c // _LANES) * _LANES) * itemsize


def tpu_misfit(view, bs, tiles: QuantTiles, x_dtype) -> str | None:
    """Mosaic's block rules (ours for `uint8`, module docstring) and the VMEM estimate."""
    tp, nb, tq = tile_dims("tpu", view, bs, tiles)
    tn, text = nb * bs, tile_text("tpu", view, bs, tiles)
    if len(view) == 2:
        rules = [(tp == view[0] or tp % _SUBLANES_8BIT == 0,
                  f"rows={tp} is neither P={view[0]} nor a multiple of {_SUBLANES_8BIT} (the "
                  "uint8 codes' sublane tile)"),
                 (nb == view[1] // bs or nb % _LANES == 0,
                  f"blocks={nb} is neither N/bs={view[1] // bs} nor a multiple of {_LANES} "
                  "(Mosaic's lane rule, on the scales)"),
                 (tn % _LANES == 0, f"its N={tn} is not a multiple of the {_LANES} lanes the "
                                    "block butterfly rotates")]
        blocks = [((tp, tn), x_dtype.itemsize), ((tp, tn), 1), ((tp, nb), 1), ((tp, 1), 4)]
        temps = 4 * _TPU_TEMPS * tp * tn + _ONE_HOT_BYTES * tn * nb
    else:
        rules = [(nb == view[1] // bs or nb % _SUBLANES_8BIT == 0,
                  f"blocks={nb} is neither N/bs={view[1] // bs} nor a multiple of "
                  f"{_SUBLANES_8BIT} (the uint8 scales' sublane tile)"),
                 (tq == view[2] or tq % _LANES == 0,
                  f"cols={tq} is neither Q={view[2]} nor a multiple of {_LANES} (Mosaic's lane "
                  "rule)")]
        blocks = [((tn, tq), x_dtype.itemsize), ((tn, tq), 1), ((nb, tq), 1), ((1, tq), 4)]
        temps = 4 * _TPU_TEMPS * tn * tq
    for ok, why in rules:
        if not ok:
            return f"the tile {text}: {why}"
    # Every block double-buffered: the values (`x_dtype`), codes, scales and tensor scales.
    need = 2 * sum(vmem_bytes(s, b) for s, b in blocks) + temps
    return budget_misfit("tpu", need, text)


def compiler_params(platform: str, view, bs, tiles: QuantTiles):
    if platform == "tpu":
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * len(view))
    tp, nb, tq = tile_dims("cuda", view, bs, tiles)
    # About 16 values a thread; no loop in the kernel, so nothing to pipeline.
    return pltriton.CompilerParams(num_warps=8 if tp * nb * bs * tq >= 4096 else 4, num_stages=1)


def platform_versions(run, mode: str, view, bs: int, x_dtype, tiles, tpu_tiles) -> dict:
    """The cuda and tpu `Version`s of a `run(platform, tile, interpret)`."""
    versions = {}
    for platform, given, default, misfit in (("cuda", tiles, CUDA_TILES, cuda_misfit),
                                             ("tpu", tpu_tiles, TPU_TILES, tpu_misfit)):
        tile = given or default[len(view)]
        bad = misfit(view, bs, tile, x_dtype)
        if bad is not None and given is not None and mode == "auto":
            tile = default[len(view)]  # a caller's tile that does not fit: the default plan
            bad = misfit(view, bs, tile, x_dtype)
        interpreted = given or default[len(view)]
        versions[platform] = dispatch.Version(
            lambda interpret, p=platform, t=tile, i=interpreted: run(p, i if interpret else t,
                                                                     interpret), bad)
    return versions
