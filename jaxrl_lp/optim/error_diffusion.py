"""The error-diffusion optimizer: binary / ternary weights trained on a k-bit residual.

(docs/design/error_diffusion.md, "Error diffusion"; source: the error-diffusion seed abstract; design of
the form.)

A weight is an integer *code* (binary: -1 or +1; ternary: -1, 0 or +1) held in
int8, with no f32 latent copy. Each code has a signed integer *residual* `r`
of `k` bits (2 <= k <= 8, range `[-2^(k-1), 2^(k-1) - 1]`, stored in int8;
its information content, and what we report, is `k` bits). The residual
counts the update the weight has been asked for but not yet made, in quanta
of `1 / T` of one level, `T = 2^(k-1)` (the *flip threshold*):

    u     = -g / rms(g)                   (per leaf: a stateless normalized step;
                                           `normalize=None` uses u = -g)
    a     = r + SR(lr_t * T * u)          (SR: stochastic rounding, floor(x + U[0, 1)),
                                           unbiased: E[SR(x)] = x; `rounding="nearest"`
                                           is deterministic round-half-to-even)
    up    = a >= T   and code < top        (top: +1)
    down  = a <= -T  and code > bottom     (bottom: -1)
    code' = code + up - down               (binary moves by 2: -1 <-> +1)
    r'    = clip(a - T * up + T * down, -2^(k-1), 2^(k-1) - 1)

So a weight changes by one level (binary: its sign flips; ternary: -1 -> 0 ->
+1) when the accumulated request crosses the threshold, and the residual keeps
the excess (`a - T`, exactly: integer arithmetic, computed in int32). A request
for a move the weight cannot make (binary +1 asked to go up) saturates the
residual at its range. With stochastic rounding an increment far below one
quantum still moves the residual with the right probability, which is what
lets k = 2 learn: the dither carries the information the missing bits would.

The transform returns the code changes (`code' - code`, int8) as its update,
so `optax.apply_updates` keeps the codes int8. Gradients are f32 (taken with
respect to `codes.astype(f32)` by the train step, `optim.weights`). It is an
optax `GradientTransformation`; combine it with Adam for the high-precision
leaves by `optim.partition` (`optax.multi_transform` with a checked labelling).

Training state per weight: the code (binary 1 bit, ternary log2 3 = 1.58
bits) and the residual (k bits); the step counter (int32, seeds the dither)
is one per optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["ErrorDiffusionState", "check_k", "error_diffusion", "flip_threshold",
           "residual_range"]

Levels = Literal["binary", "ternary"]
# The residual widths the optimizer supports: 2..8 bits, held in int8.
K_RANGE: tuple[int, int] = (2, 8)


class ErrorDiffusionState(NamedTuple):
    """The optimizer state: a step counter and one residual per code."""

    count: jax.Array   # [] int32: updates made (seeds the stochastic rounding)
    residual: optax.Params  # like the codes, int8, each in [-2^(k-1), 2^(k-1) - 1]


def check_k(k: int, key: str = "k") -> int:
    """Returns `k` if it is an int in 2..8, else a ValueError naming `key` and the fix."""
    lo, hi = K_RANGE
    if isinstance(k, bool) or not isinstance(k, int) or not lo <= k <= hi:
        raise ValueError(f"{key}={k!r}: the error-diffusion residual width must be an integer "
                         f"from {lo} to {hi} bits (it is stored in int8); choose e.g. {key}=4")
    return k


def flip_threshold(k: int) -> int:
    """`T = 2^(k-1)`: the residual (in quanta) at which a weight moves one level."""
    return 2 ** (check_k(k) - 1)


def residual_range(k: int) -> tuple[int, int]:
    """`(lo, hi) = (-2^(k-1), 2^(k-1) - 1)`: the values a k-bit signed residual holds."""
    t = flip_threshold(k)
    return -t, t - 1


def error_diffusion(learning_rate: float | Callable[[jax.Array], jax.Array], *,
                    levels: Levels = "binary", k: int = 8,
                    normalize: Literal["rms"] | None = "rms",
                    rounding: Literal["stochastic", "nearest"] = "stochastic",
                    seed: int = 0) -> optax.GradientTransformation:
    """The error-diffusion transform for int8 binary / ternary codes (module docstring).

    Args:
      learning_rate: the fraction of one level a unit normalized step asks for
        per update (a float or an optax schedule of the step count).
      levels: `binary` (codes +-1) or `ternary` (codes -1, 0, 1).
      k: residual bits, 2..8.
      normalize: `rms` divides each leaf's gradient by its root mean square
        (stateless: no second moment is kept); None uses the raw gradient.
      rounding: of the scaled increment to whole quanta: `stochastic`
        (unbiased, a fresh key per step from `seed` and the step count) or
        `nearest` (deterministic).
      seed: seeds the stochastic rounding.

    Returns:
      An optax `GradientTransformation`. `init(codes)` takes the int8 codes;
      `update(grads_f32, state, codes)` needs the codes (it must know which
      moves are possible) and returns int8 code changes.

    Examples:
      >>> tx = error_diffusion(0.05, levels="binary", k=4)
      >>> state = tx.init(codes)
      >>> delta, state = tx.update(grads, state, codes)
      >>> codes = optax.apply_updates(codes, delta)   # still int8
    """
    check_k(k)
    if levels not in ("binary", "ternary"):
        raise ValueError(f"levels={levels!r}: choose 'binary' or 'ternary'")
    if normalize not in ("rms", None):
        raise ValueError(f"normalize={normalize!r}: choose 'rms' or None")
    if rounding not in ("stochastic", "nearest"):
        raise ValueError(f"rounding={rounding!r}: choose 'stochastic' or 'nearest'")
    t = flip_threshold(k)
    lo, hi = residual_range(k)
    step_size = learning_rate if callable(learning_rate) else (lambda _: learning_rate)
    # A binary weight moves -1 <-> +1: one flip is the whole range of the code.
    stride = 2 if levels == "binary" else 1

    def init(codes):
        for x in jax.tree.leaves(codes):
            if x.dtype != jnp.int8:
                raise ValueError(f"error_diffusion: codes must be int8 ({levels} weights), got "
                                 f"a {x.dtype} leaf of shape {x.shape}; assign the "
                                 "high-precision parameters to another optimizer (partition)")
        residual = jax.tree.map(lambda c: jnp.zeros(c.shape, jnp.int8), codes)
        return ErrorDiffusionState(jnp.zeros([], jnp.int32), residual)

    def update(grads, state, codes=None):
        if codes is None:
            raise ValueError("error_diffusion needs the current codes: call "
                             "update(grads, state, params)")
        lr = jnp.asarray(step_size(state.count), jnp.float32)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), state.count)
        leaves, treedef = jax.tree.flatten(codes)
        g_leaves = treedef.flatten_up_to(grads)
        r_leaves = treedef.flatten_up_to(state.residual)
        deltas, residuals = [], []
        for i, (c, g, r) in enumerate(zip(leaves, g_leaves, r_leaves, strict=True)):
            # The update arithmetic is f32 (gradients are f32; the increment is a float
            # count of quanta before it is rounded to a whole number).
            g = g.astype(jnp.float32)
            if normalize == "rms":
                g = g / jnp.maximum(jnp.sqrt(jnp.mean(jnp.square(g))), 1e-30)
            x = -lr * t * g
            if rounding == "stochastic":
                inc = jnp.floor(x + jax.random.uniform(jax.random.fold_in(key, i), x.shape))
            else:
                inc = jnp.round(x)
            # Clipped before the cast: a huge step cannot overflow int32 (and it can at
            # most move the weight once and saturate the residual anyway).
            inc = jnp.clip(inc, -4 * t, 4 * t).astype(jnp.int32)
            a = r.astype(jnp.int32) + inc          # int32: the excess is kept exactly
            ci = c.astype(jnp.int32)
            up = (a >= t) & (ci < 1)
            down = (a <= -t) & (ci > -1)
            a = a - t * up.astype(jnp.int32) + t * down.astype(jnp.int32)
            residuals.append(jnp.clip(a, lo, hi).astype(jnp.int8))
            deltas.append((stride * (up.astype(jnp.int32) - down.astype(jnp.int32))
                           ).astype(jnp.int8))
        new_state = ErrorDiffusionState(state.count + 1,
                                        jax.tree.unflatten(treedef, residuals))
        return jax.tree.unflatten(treedef, deltas), new_state

    return optax.GradientTransformation(init, update)
