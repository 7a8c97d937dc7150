"""Weight exporters: optax-style transforms from the f32 master params to the served copy.

An `Exporter` is a pair of pure functions, as an optax transform:

    state          = exporter.init(params_f32)
    served, state  = exporter.apply(params_f32, state, version)

`served` has the structure of `params` (docs/design/parameters.md); a leaf is an array
(cast or kept) or a `QArray` (a quantized matmul weight). The state is a named
`NamedTuple` of arrays (an export counter, error-feedback residuals), so it is
checkpointed with the optimizer state. `apply` is jittable (no static
arguments besides the exporter's closure); layout errors are raised at trace
time. `version` is the learner step the export is stamped with; the exporters
here do not read it (stochastic rounding keys come from the state counter, so
two exports never share a key even if a version repeats).

Exporters: `cast` (bf16/f16 by nearest, stochastic or error-feedback
rounding, docs/design/low_precision.md, "Number formats"), `quantize` (a number format for the matmul
weights), `ternary` (three export paths, `jaxrl_lp.sync.ternary`), `chain`.

Fair Cast: the learner computes its loss on the served copy,
`w_used = straight_through_served(master, served_params_for_forward(served))`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.kernels.quantize import quantize as quantize_array
from jaxrl_lp.models.lora import merge_adapters
from jaxrl_lp.numerics.policy import KERNEL_MODES, parse_dtype
from jaxrl_lp.numerics.qarray import dequantize, get_format
from jaxrl_lp.numerics.rounding import error_feedback_round, round_nearest, round_stochastic
from jaxrl_lp.sync.layout import flatten_served, is_qarray, matmul_weight_paths, path_str

__all__ = [
    "ROUNDINGS",
    "CastState",
    "EmptyState",
    "ErrorFeedbackState",
    "Exporter",
    "cast",
    "chain",
    "map_with_path",
    "quantize",
    "served_params_for_forward",
    "straight_through_served",
]

# The roundings of `cast`: round to nearest even, stochastic, error feedback.
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic", "error_feedback")


class Exporter(NamedTuple):
    """`init(params) -> state`; `apply(params, state, version=None) -> (served, state)`."""

    init: Callable[[Any], Any]
    apply: Callable[..., tuple[Any, Any]]


class EmptyState(NamedTuple):
    """State of a stateless exporter."""


class CastState(NamedTuple):
    """`count`: int32 number of exports so far (stochastic keys are derived from it)."""

    count: jax.Array


class ErrorFeedbackState(NamedTuple):
    """`count`: int32 exports so far; `residual`: f32 tree shaped like the params
    (the carried rounding error `e`; an empty placeholder for non-floating or
    already-quantized leaves)."""

    count: jax.Array
    residual: Any


def map_with_path(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """`tree_map` with the leaf's `a/b/c` path as first argument; `QArray`s are leaves."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(path_str(p), x), tree,
                                            is_leaf=is_qarray)


def _is_float(x: Any) -> bool:
    return not is_qarray(x) and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _check_residual_tree(params: Any, residual: Any) -> None:
    """Raises a ValueError naming the first tensor where `params` and the state disagree."""
    have, want = flatten_served(params), flatten_served(residual)
    if missing := sorted(set(want) - set(have)):
        raise ValueError(f"params tree does not match the exporter state: tensor {missing[0]!r} "
                         f"is missing (missing: {missing})")
    if extra := sorted(set(have) - set(want)):
        raise ValueError(f"params tree does not match the exporter state: unexpected tensor "
                         f"{extra[0]!r} (unexpected: {extra})")
    for p, r in want.items():
        x = have[p]
        shape = tuple(np.shape(x)) if _is_float(x) else (0,)
        if shape != tuple(r.shape):
            raise ValueError(f"params tree does not match the exporter state: tensor {p!r} has "
                             f"shape {tuple(np.shape(x))}, the state was built for {r.shape}")


def cast(dtype: Any = "bf16", rounding: str = "nearest", seed: int = 0) -> Exporter:
    """Casts every floating leaf to `dtype` with the given rounding (QArray leaves pass).

    Maths (docs/design/low_precision.md, "Number formats"): `nearest` is round-to-nearest-even; `stochastic`
    rounds up with probability `(x - lo) / (hi - lo)` (unbiased), with the key
    `fold_in(fold_in(key(seed), count), leaf_index)`, fresh at every export;
    `error_feedback`: `served = RNE(master + e)`, `e <- master + e - served`.

    Args:
      dtype: `bf16`, `f16` or `f32`.
      rounding: one of `ROUNDINGS`.
      seed: base seed of the stochastic keys.

    Returns:
      An `Exporter`; state `CastState` (`ErrorFeedbackState` for error feedback).

    Examples:
      >>> ex = cast("bf16", "stochastic", seed=1)
      >>> state = ex.init(params)
      >>> served, state = ex.apply(params, state, 7)
    """
    target = parse_dtype(dtype, "dtype")
    if rounding not in ROUNDINGS:
        raise ValueError(f"cast: rounding {rounding!r} is not one of {list(ROUNDINGS)}")

    def init(params):
        count = jnp.zeros((), jnp.int32)
        if rounding != "error_feedback":
            return CastState(count)
        residual = jax.tree.map(
            lambda x: jnp.zeros(x.shape if _is_float(x) else (0,), jnp.float32), params,
            is_leaf=is_qarray)
        return ErrorFeedbackState(count, residual)

    def apply(params, state, version=None):
        del version  # not read: see the module docstring
        if rounding == "error_feedback":
            _check_residual_tree(params, state.residual)
            leaves, treedef = jax.tree.flatten(params, is_leaf=is_qarray)
            res = treedef.flatten_up_to(state.residual)
            out = [error_feedback_round(x, r, target) if _is_float(x) else (x, r)
                   for x, r in zip(leaves, res, strict=True)]
            served = treedef.unflatten([s for s, _ in out])
            residual = treedef.unflatten([r for _, r in out])
            return served, ErrorFeedbackState(state.count + 1, residual)
        if rounding == "nearest":
            served = jax.tree.map(lambda x: round_nearest(x, target) if _is_float(x) else x,
                                  params, is_leaf=is_qarray)
            return served, CastState(state.count + 1)
        key = jax.random.fold_in(jax.random.key(seed), state.count)
        leaves, treedef = jax.tree.flatten(params, is_leaf=is_qarray)
        out = [round_stochastic(x, target, jax.random.fold_in(key, i)) if _is_float(x) else x
               for i, x in enumerate(leaves)]
        return treedef.unflatten(out), CastState(state.count + 1)

    return Exporter(init, apply)


def _block_check(path: str, x: Any, fmt: str, axis: int) -> None:
    bs = get_format(fmt).block_size
    if bs is not None and x.shape[axis] % bs:
        raise ValueError(
            f"cannot export tensor {path!r} of shape {tuple(x.shape)} to {fmt!r}: its reduction "
            f"axis {axis} has length {x.shape[axis]}, not a multiple of the block size {bs}"
        )


def quantize(fmt: str, *, include_lm_head: bool = False, kernels: str = "auto") -> Exporter:
    """Quantizes the matmul weights to `fmt` (`QArray` leaves); keeps every other tensor.

    Stacked weights `[L, in, out]` are quantized along axis 1 (the reduction
    axis) with one per-tensor scale per layer (`batch_axes=(0,)`), which is what
    the model's forward computes for each layer of its scan; `lm_head` `[D, V]`
    (only with `include_lm_head`) along axis 0. Embeddings, norms, biases and
    the exit gate keep their dtype and bits.

    Args:
      fmt: a key of `jaxrl_lp.numerics.FORMATS` (`fp8`, `mxfp8`, `nvfp4`, `ternary`...).
      include_lm_head: quantize the untied `lm_head` too.
      kernels: where the block quantize runs (`KERNEL_MODES`, see
        `jaxrl_lp.kernels.dispatch`): the Pallas kernel and the jnp reference give
        the same bits; `auto` is the reference on CPU, `on` is an error there.

    Raises:
      ValueError: naming the tensor, its shape and the block size when a block
        format's block size does not divide a reduction axis, or naming the
        tensor when the params tree does not have the served layout; or for an
        unknown `kernels` mode.
      KernelUnavailableError: (at `apply`) for `kernels="on"` where Pallas
        cannot compile.

    Examples:
      >>> served, _ = quantize("mxfp8").apply(params, EmptyState())
      >>> served["layers"]["q_proj"].scales.dtype
      dtype(float8_e8m0fnu)
    """
    get_format(fmt)
    if kernels not in KERNEL_MODES:
        raise ValueError(f"quantize exporter: kernels {kernels!r} is not one of {list(KERNEL_MODES)}")

    def init(params):
        del params
        return EmptyState()

    def apply(params, state, version=None):
        del version
        axes = matmul_weight_paths(params, include_lm_head)
        flat = flatten_served(params)
        for p, (axis, _) in axes.items():
            if not is_qarray(flat[p]):
                _block_check(p, flat[p], fmt, axis)

        def one(path, x):
            if path not in axes or is_qarray(x):
                return x
            axis, batch = axes[path]
            return quantize_array(x, fmt, axis, batch, kernels=kernels)

        return map_with_path(one, params), state

    return Exporter(init, apply)


def chain(*exporters: Exporter) -> Exporter:
    """Applies exporters in order; the state is the tuple of their states.

    Each exporter's `init` sees the shapes of the previous one's output.

    Examples:
      >>> ex = chain(cast("bf16", "stochastic"), quantize("mxfp8"))
    """

    def init(params):
        states, x = [], params
        for e in exporters:
            s = e.init(x)
            states.append(s)
            x = jax.eval_shape(lambda x, s, e=e: e.apply(x, s)[0], x, s)
        return tuple(states)

    def apply(params, state, version=None):
        if len(state) != len(exporters):
            raise ValueError(f"chain of {len(exporters)} exporters got {len(state)} states")
        new, x = [], params
        for e, s in zip(exporters, state, strict=True):
            x, s = e.apply(x, s, version)
            new.append(s)
        return x, tuple(new)

    return Exporter(init, apply)


def served_params_for_forward(served: Any, dtype: Any = jnp.float32) -> Any:
    """The served tree as arrays the model forward consumes, holding exactly the served values.

    `QArray`s are dequantized (f32, exact); every floating leaf is then cast to
    `dtype` (default f32, exact for bf16/f16 and dequantized values; None keeps
    each leaf's dtype). Use the same `dtype` on the sampler and in the learner's
    `straight_through_served` (whose leaves are f32): XLA compiles a matmul with a
    bf16 operand upcast inside the program differently from one on f32 arrays, so
    equal values in different dtypes need not give bit-equal log-probs.

    Examples:
      >>> held = served_params_for_forward(served)       # what `generate` runs on
      >>> ro = generate(held, cfg, prompts, policy=PRESETS["bf16"])
    """

    def one(x):
        x = dequantize(x) if is_qarray(x) else x
        if dtype is None or not _is_float(x):
            return x
        return jnp.asarray(x).astype(dtype)

    return jax.tree.map(one, served, is_leaf=is_qarray)


def straight_through_served(master: Any, served_dense: Any) -> Any:
    """Fair Cast: weights whose value is the served copy and whose gradient goes to master.

    Maths: `w_used = master + stop_gradient(served - master)`. It is computed as
    `stop_gradient(served) + (master - stop_gradient(master))`: the bracket is
    exactly 0, so the value is the served value bit for bit (the first form
    rounds whenever `served - master` is not exact, e.g. for quantized values far
    from the master), and `d w_used / d master = I`. Leaves are in master's dtype.

    A LoRA forward tree (`models.lora.LoraWeight` leaves) is merged first: its
    master is `W + A B scale` (`merge_adapters`), so the gradient reaches the
    adapters through the merge and the frozen base gets none it could use.

    Args:
      master: f32 master params (or a LoRA forward tree).
      served_dense: the served tree (`served_params_for_forward`; `QArray`s are
        dequantized here if present).

    Returns:
      A tree like `master` (merged, for a LoRA tree).
    """
    master = merge_adapters(master)
    served_dense = served_params_for_forward(served_dense)

    def one(m, s):
        if not _is_float(m):
            return s
        sg = jax.lax.stop_gradient
        # Upcast: served values (bf16 or dequantized f32) are exact in the master dtype.
        return sg(jnp.asarray(s)).astype(m.dtype) + (m - sg(m))

    return jax.tree.map(one, master, served_dense)

