"""Ternary (BitNet b1.58) export: three paths and the code disagreement they cause.

The training quantizer (`numerics.formats`, format `ternary`) runs on the f32
latents: `gamma = mean|W|` accumulated in f32, `codes = clip(floor(W/gamma +
0.5), -1, 1)` (round half up). A stacked weight `[L, in, out]` has one gamma
per layer.

The legacy export (Falcon-E export tool, BitNet reference code run in bf16)
casts the latents to bf16 and quantizes in bf16 (`legacy_ternary_quantize`):

    Wb    = bf16(W)
    g     = max(bf16(mean|Wb|), bf16(1e-5))    (mean accumulated in f32, rounded)
    inv   = bf16(1 / g)
    codes = clip(round_half_even(bf16(Wb * inv)), -1, 1)
    value = bf16(codes / inv)                  (= codes * bf16(1 / inv))

It disagrees with the training codes near the threshold `|W| = gamma / 2`:
there bf16(Wb * inv) rounds onto 0.5, which round-half-even sends to 0 and the
training rule's round-half-up sends to 1; the bf16 latents and scale move the
threshold too.

Paths of `ternary(path)`:

- `bf16_then_quantize`: the legacy path, a measured baseline. Writes the legacy
  codes and scale as a `QArray`.
- `direct_codes`: the training quantizer on the f32 latents; writes its codes
  and gamma (`QArray`, format `ternary`). Zero disagreement by construction.
- `bf16_fixed_point`: writes bf16 *latent values* `V` (start: `bf16(W)`) that
  both a legacy bf16 consumer and the f32 training quantizer map back to
  exactly the training codes. Elements whose code is wrong are stepped one
  bf16 ulp towards their training code, and the codes are recomputed,
  because each step moves the mean and so the scale; repeated until no code is
  wrong (at most `max_iters` steps). The result stays a bf16 latent checkpoint
  within a few ulps of `bf16(W)`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes

from jaxrl_lp.numerics.formats import TERNARY_EPS
from jaxrl_lp.numerics.formats import quantize as quantize_array
from jaxrl_lp.numerics.qarray import QArray
from jaxrl_lp.sync.export import EmptyState, Exporter, map_with_path
from jaxrl_lp.sync.layout import flatten_served, is_qarray, matmul_axes, matmul_weight_paths

__all__ = ["TERNARY_PATHS", "code_disagreement", "legacy_ternary_quantize", "ternary",
           "ternary_fixed_point"]

# The three ternary export paths of `ternary(path)` (module docstring).
TERNARY_PATHS: tuple[str, ...] = ("bf16_then_quantize", "direct_codes", "bf16_fixed_point")
_BF16 = jnp.dtype(ml_dtypes.bfloat16)


def _reduce_axes(ndim: int, batch_axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i not in batch_axes)


def legacy_ternary_quantize(w: jax.Array, batch_axes: tuple[int, ...] = ()):
    """The legacy bf16 ternary quantizer (module docstring): `(codes int8, scale f32)`.

    `scale` is the legacy consumer's dequantized magnitude `bf16(1 / inv)`, shaped
    like a per-tensor scale (one per index of `batch_axes`), so
    `codes * scale` is the legacy value exactly.
    """
    wb = jnp.asarray(w).astype(_BF16)
    reduce = _reduce_axes(wb.ndim, batch_axes)
    # Upcast: the bf16 mean is accumulated in f32 and rounded once, as torch does.
    mean = jnp.mean(jnp.abs(wb).astype(jnp.float32), axis=reduce, keepdims=True)
    g = jnp.maximum(mean.astype(_BF16), jnp.asarray(TERNARY_EPS, _BF16))
    # Rounding sites: each bf16 op is an f32 op (exact for the reciprocal's input and
    # for bf16 products) rounded to bf16.
    inv = (1.0 / g.astype(jnp.float32)).astype(_BF16)
    y = (wb.astype(jnp.float32) * inv.astype(jnp.float32)).astype(_BF16)
    codes = jnp.clip(jnp.round(y.astype(jnp.float32)), -1, 1).astype(jnp.int8)  # half to even
    scale = (1.0 / inv.astype(jnp.float32)).astype(_BF16).astype(jnp.float32)
    return codes, scale


def _training_codes(w, axis, batch_axes):
    return quantize_array(w, "ternary", axis, batch_axes).codes


def _step_bf16(v: jax.Array, direction: jax.Array) -> jax.Array:
    """Moves bf16 `v` by one ulp up (`direction` +1), down (-1) or not at all (0)."""
    b = jax.lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.int32)
    sign, mag = b >> 15, b & 0x7FFF
    mag = mag + direction * jnp.where(sign == 0, 1, -1)
    # Through zero: -0 moving up (or +0 moving down) becomes the smallest value of the
    # other sign.
    crossed = mag < 0
    sign = jnp.where(crossed, 1 - sign, sign)
    mag = jnp.where(crossed, 1, mag)
    return jax.lax.bitcast_convert_type(((sign << 15) | mag).astype(jnp.uint16), _BF16)


def ternary_fixed_point(w: jax.Array, axis: int = 0, batch_axes: tuple[int, ...] = (),
                        max_iters: int = 64):
    """bf16 values that the legacy and the training quantizer both map to `w`'s codes.

    Args:
      w: f32 latents.
      axis: as `numerics.quantize` (stacked weights: 1).
      batch_axes: as `numerics.quantize` (stacked weights: (0,)).
      max_iters: at most this many one-ulp steps per element.

    Returns:
      (tuple[jax.Array, jax.Array]): `(v, wrong)`: bf16 values of `w`'s shape,
        and the int32 number of elements whose codes still disagree (0 once
        converged).
    """
    target = _training_codes(w, axis, batch_axes)

    def direction(v):
        legacy, _ = legacy_ternary_quantize(v, batch_axes)
        # Upcast: the training quantizer reads the bf16 values in f32 (exact).
        train = _training_codes(v.astype(jnp.float32), axis, batch_axes)
        d_legacy = jnp.sign(target.astype(jnp.int32) - legacy.astype(jnp.int32))
        d_train = jnp.sign(target.astype(jnp.int32) - train.astype(jnp.int32))
        return jnp.where(d_legacy != 0, d_legacy, d_train)

    def cond(s):
        i, _, d = s
        return (i < max_iters) & jnp.any(d != 0)

    def body(s):
        i, v, d = s
        v = _step_bf16(v, d)
        return i + 1, v, direction(v)

    v0 = jnp.asarray(w).astype(_BF16)
    _, v, d = jax.lax.while_loop(cond, body, (jnp.int32(0), v0, direction(v0)))
    return v, jnp.sum(d != 0).astype(jnp.int32)


def ternary(path: str = "direct_codes", *, include_lm_head: bool = False,
            max_iters: int = 64) -> Exporter:
    """Exports the matmul weights as ternary by one of `TERNARY_PATHS` (module docstring).

    Other tensors are kept. Stacked weights have one scale per layer.

    Args:
      path: `bf16_then_quantize`, `direct_codes` or `bf16_fixed_point`.
      include_lm_head: export the untied `lm_head` too.
      max_iters: iteration cap of `bf16_fixed_point`.

    Returns:
      An `Exporter` (state `EmptyState`). Served leaves: `QArray` (format
      `ternary`) for the first two paths, bf16 arrays for `bf16_fixed_point`.

    Examples:
      >>> served, _ = ternary("direct_codes").apply(params, EmptyState())
      >>> code_disagreement(params, served)["layers/q_proj"]
      0.0
    """
    if path not in TERNARY_PATHS:
        raise ValueError(f"ternary: path {path!r} is not one of {list(TERNARY_PATHS)}")

    def init(params):
        del params
        return EmptyState()

    def apply(params, state, version=None):
        del version
        axes = matmul_weight_paths(params, include_lm_head)

        def one(p, x):
            if p not in axes or is_qarray(x):
                return x
            axis, batch = axes[p]
            if path == "direct_codes":
                return quantize_array(x, "ternary", axis, batch)
            if path == "bf16_then_quantize":
                codes, scale = legacy_ternary_quantize(x, batch)
                return QArray(codes, scale, "ternary", axis, batch)
            return ternary_fixed_point(x, axis, batch, max_iters)[0]

        return map_with_path(one, params), state

    return Exporter(init, apply)


def code_disagreement(latents: Any, exported: Any, *, consumer: str = "legacy",
                      include_lm_head: bool = False) -> dict[str, float]:
    """Fraction of each matmul weight's codes that differ from the training codes.

    Training codes: the `ternary` training quantizer on the f32 latents. Exported
    codes: a `QArray`'s codes; for a bf16-valued leaf (`bf16_fixed_point`), the
    codes the `consumer` quantizer gives it: `legacy` (bf16 legacy quantizer) or
    `training` (the f32 training quantizer on the bf16 values).

    Args:
      latents: the f32 params the export was made from.
      exported: the output of a `ternary(...)` exporter.
      consumer: `legacy` or `training`.
      include_lm_head: as for the exporter.

    Returns:
      `{path: fraction}` as python floats (computed in one jitted program).
    """
    if consumer not in ("legacy", "training"):
        raise ValueError(f"consumer must be 'legacy' or 'training'; got {consumer!r}")
    exp = flatten_served(exported)
    for p in matmul_weight_paths(latents, include_lm_head):
        if p not in exp:
            raise ValueError(f"exported tree has no tensor {p!r}")
    rates = _disagreement(latents, exported, consumer, include_lm_head)
    return {p: float(r) for p, r in rates.items()}


@functools.partial(jax.jit, static_argnums=(2, 3))
def _disagreement(latents, exported, consumer, include_lm_head):
    lat, exp = flatten_served(latents), flatten_served(exported)
    out = {}
    for p in matmul_weight_paths(latents, include_lm_head):
        axis, batch = matmul_axes(p, include_lm_head)
        target = _training_codes(lat[p], axis, batch)
        e = exp[p]
        if is_qarray(e):
            got = e.codes
        elif consumer == "legacy":
            got = legacy_ternary_quantize(e, batch)[0]
        else:
            got = _training_codes(jnp.asarray(e).astype(jnp.float32), axis, batch)
        out[p] = jnp.mean((got.astype(jnp.int32) != target.astype(jnp.int32)).astype(jnp.float32))
    return out
