"""Diagnostics of the served copy: retention, staleness, ulp distance, KL, served progress.

All functions are pure and jittable over pytrees. Served trees may hold `QArray`
leaves; they are compared by their dequantized values. Sums run in f32.

- `update_retention(prev, served)`: fraction of elements whose served value
  changed at this export.
- `StalenessState` / `staleness_init` / `staleness_update`: a per-element int32
  counter of exports since the element's served value last changed.
- `served_ulp` / `ulp_distance(master, served)`: `|master - served|` in units of
  the served ulp (bf16/f16 ulp of a cast leaf; the code spacing times the scale
  of a quantized one).
- `kl_from_logits` / `kl_from_logprobs`: KL(served || master) on a probe batch.
- `served_progress(s0, s, m0, m) = <s - s0, m - m0> / |m - m0|^2`, and
  `ProgressState` / `progress_init` / `progress_update`, which also record the
  lag: the first export at which the progress reaches 0.5.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxrl_lp.numerics.qarray import FORMATS, expand_block_scales
from jaxrl_lp.numerics.rounding import ulp
from jaxrl_lp.sync.export import served_params_for_forward
from jaxrl_lp.sync.layout import is_qarray

__all__ = [
    "LAG_THRESHOLD", "ProgressState", "StalenessState", "kl_from_logits", "kl_from_logprobs",
    "progress_init", "progress_update", "served_progress", "served_ulp", "staleness_init",
    "staleness_update", "ulp_distance", "update_retention",
]

# The served progress at which the served copy counts as caught up (`ProgressState.lag`).
LAG_THRESHOLD = 0.5
_LOG_RATIO_CLIP = 20.0


def _dense(tree: Any) -> list[jax.Array]:
    """Floating leaves of a (served) tree as f32 arrays, QArrays dequantized."""
    leaves = jax.tree.leaves(served_params_for_forward(tree))
    # Upcast: comparisons and sums of served values run in f32 (exact for bf16/f16).
    return [jnp.asarray(x).astype(jnp.float32) for x in leaves
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]


def update_retention(prev_served: Any, served: Any) -> jax.Array:
    """Fraction of elements whose served value changed from `prev_served` to `served`."""
    changed = sum(jnp.sum(a != b) for a, b in zip(_dense(prev_served), _dense(served), strict=True))
    total = sum(a.size for a in _dense(served))
    return changed.astype(jnp.float32) / total


class StalenessState(NamedTuple):
    """`served`: the last served values (f32 list); `age`: int32 exports since each changed."""

    served: list
    age: list


def staleness_init(served: Any) -> StalenessState:
    """The staleness tracker at the first export (`served`): every element starts fresh."""
    dense = _dense(served)
    return StalenessState(dense, [jnp.zeros(x.shape, jnp.int32) for x in dense])


def staleness_update(state: StalenessState, served: Any) -> tuple[StalenessState, dict]:
    """Advances the counters by one export.

    Returns:
      `(state, metrics)` with `retention` (fraction changed at this export),
      `staleness_mean` and `staleness_max` (exports since last change).
    """
    dense = _dense(served)
    changed = [a != b for a, b in zip(state.served, dense, strict=True)]
    age = [jnp.where(c, 0, g + 1) for c, g in zip(changed, state.age, strict=True)]
    total = sum(x.size for x in dense)
    metrics = {
        "retention": sum(jnp.sum(c) for c in changed).astype(jnp.float32) / total,
        "staleness_mean": sum(jnp.sum(g) for g in age).astype(jnp.float32) / total,
        "staleness_max": jnp.max(jnp.stack([jnp.max(g) for g in age])),
    }
    return StalenessState(dense, age), metrics


def _element_ulp(codes_f32: jax.Array, element_dtype: np.dtype) -> jax.Array:
    """Spacing of the element format's grid at each code (subnormal spacing at 0)."""
    if not jnp.issubdtype(element_dtype, jnp.floating):
        return jnp.ones_like(codes_f32)  # integer codes (ternary/binary): spacing 1
    fi = ml_dtypes.finfo(element_dtype)
    _, e = jnp.frexp(codes_f32)  # |c| = m * 2^e, m in [0.5, 1): floor(log2|c|) = e - 1
    k = jnp.maximum(jnp.where(codes_f32 == 0, fi.minexp, e - 1), fi.minexp) - fi.nmant
    return jnp.ldexp(jnp.ones_like(codes_f32), k)


def served_ulp(leaf: Any) -> jax.Array:
    """The served grid spacing of every element of a served leaf, f32."""
    if not is_qarray(leaf):
        return ulp(leaf, leaf.dtype)
    spec = FORMATS[leaf.format]
    # Upcast: codes and scales are exact in f32.
    step = _element_ulp(leaf.codes.astype(jnp.float32), spec.element_dtype)
    s = leaf.scales.astype(jnp.float32)
    if spec.is_block:
        s = expand_block_scales(s, leaf.axis, spec.block_size)
    if leaf.tensor_scale is not None:
        s = s * leaf.tensor_scale
    return step * s


def ulp_distance(master: Any, served: Any) -> dict[str, jax.Array]:
    """`|master - served| / served_ulp` over all floating elements: mean and max."""
    m_leaves = jax.tree.leaves(master)
    s_leaves = jax.tree.leaves(served, is_leaf=is_qarray)
    dense = jax.tree.leaves(served_params_for_forward(served))
    ratios = []
    for m, s, d in zip(m_leaves, s_leaves, dense, strict=True):
        if not jnp.issubdtype(jnp.asarray(m).dtype, jnp.floating):
            continue
        # Upcast: the distance is measured in f32.
        diff = jnp.abs(jnp.asarray(m).astype(jnp.float32) - jnp.asarray(d).astype(jnp.float32))
        ratios.append((diff / served_ulp(s)).ravel())
    r = jnp.concatenate(ratios)
    return {"mean": jnp.mean(r), "max": jnp.max(r)}


def _masked_mean(x: jax.Array, mask: Any) -> jax.Array:
    if mask is None:
        return jnp.mean(x)
    m = jnp.asarray(mask, jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def kl_from_logits(served_logits: jax.Array, master_logits: jax.Array, mask: Any = None) -> jax.Array:
    """Exact KL(served || master) per token from full logits [..., V], averaged over tokens."""
    lp = jax.nn.log_softmax(served_logits.astype(jnp.float32), axis=-1)
    lq = jax.nn.log_softmax(master_logits.astype(jnp.float32), axis=-1)
    return _masked_mean(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1), mask)


def kl_from_logprobs(served_lp: jax.Array, master_lp: jax.Array, mask: Any = None) -> dict:
    """KL(served || master) estimated from log-probs of tokens sampled from the served policy.

    Maths: with `r = log q - log p` (q master, p served), `k1 = E[-r]` and
    `k3 = E[exp(r) - 1 - r]` (unbiased, non-negative); `r` is clipped to
    [-20, 20] before `exp`.
    """
    r = jnp.clip(master_lp.astype(jnp.float32) - served_lp.astype(jnp.float32),
                 -_LOG_RATIO_CLIP, _LOG_RATIO_CLIP)
    return {"k1": _masked_mean(-r, mask), "k3": _masked_mean(jnp.expm1(r) - r, mask)}


def _progress(s0, s, m0, m) -> jax.Array:
    num = sum(jnp.sum((b - a) * (d - c)) for a, b, c, d in zip(s0, s, m0, m, strict=True))
    den = sum(jnp.sum(jnp.square(d - c)) for c, d in zip(m0, m, strict=True))
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.nan)


def served_progress(served0: Any, served: Any, master0: Any, master: Any) -> jax.Array:
    """`<s - s0, m - m0> / |m - m0|^2` (f32): 1 when the served copy moved as far as the
    master along the master's displacement, 0 when it did not move; NaN when the
    master has not moved."""
    return _progress(_dense(served0), _dense(served), _dense(master0), _dense(master))


class ProgressState(NamedTuple):
    """Start points (f32 lists), `step` (exports since init, int32) and `lag` (the
    first step whose progress reached 0.5; -1 until then)."""

    served0: list
    master0: list
    step: jax.Array
    lag: jax.Array


def progress_init(served: Any, master: Any) -> ProgressState:
    """The progress tracker at the first export: `served` and `master` become the start points."""
    return ProgressState(_dense(served), _dense(master), jnp.zeros((), jnp.int32),
                         jnp.full((), -1, jnp.int32))


def progress_update(state: ProgressState, served: Any, master: Any) -> tuple[ProgressState, jax.Array]:
    """One export later: `(state, progress)`; records the lag the first time progress >= 0.5."""
    step = state.step + 1
    p = _progress(state.served0, _dense(served), state.master0, _dense(master))
    lag = jnp.where((state.lag < 0) & (p >= LAG_THRESHOLD), step, state.lag)
    return ProgressState(state.served0, state.master0, step, lag), p
