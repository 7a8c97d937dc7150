"""What the learner's backward pass recomputes instead of reading it saved (`grpo.remat`).

A layer's backward reads what its forward computed. Saving all of it is the
fastest backward and the largest memory: each layer keeps its attention
probabilities, rows x heads x T x T values, next to the products' outputs. The choices
(`jax.checkpoint` with a policy, per layer application):

- `none`: save everything the backward reads.
- `layers`: save each layer's input only; the backward runs the layer's
  forward again (one more forward pass of FLOPs).
- `dots`: save the outputs of the products with the weights (projections and
  MLP, `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); the
  backward recomputes the attention (its products have batch dimensions) and
  the element-wise maths (norms, activations, residuals) from them. The
  recomputed FLOPs are the attention's, a small share of a layer's at these
  lengths.

Recomputation runs the same maths again: the gradients of every choice agree
to float rounding (the compiler fuses a recomputed forward with the backward,
and may round a sum otherwise; `tests/test_remat.py` compares them).

    remat_layer(layer_fn, Remat.DOTS)      # inside a forward, over the layer scan
    Remat.of("dots"), Remat.of(True)       # a config value or the old flag
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import jax

__all__ = ["Remat", "remat_layer"]


class Remat(enum.Enum):
    """Which activations a layer's backward recomputes (module docstring)."""

    NONE = "none"
    LAYERS = "layers"
    DOTS = "dots"

    @classmethod
    def of(cls, value: Remat | bool | str) -> Remat:
        """`value` as a `Remat`: one, its name (`"dots"`), or the flag it replaced (`True`
        is `LAYERS`, `False` is `NONE`).

        Raises:
          ValueError: any other value, naming the allowed ones.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.LAYERS if value else cls.NONE
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"remat must be one of {[r.value for r in cls]} (or true/false, "
                             f"meaning 'layers'/'none'); got {value!r}") from None


def remat_layer(layer_fn: Callable, remat: Remat | bool | str) -> Callable:
    """`layer_fn` (one layer application, as `models.blocks.over_layers` runs it) under
    `remat`: itself, or wrapped in `jax.checkpoint` with the choice's policy."""
    remat = Remat.of(remat)
    if remat is Remat.NONE:
        return layer_fn
    if remat is Remat.LAYERS:
        return jax.checkpoint(layer_fn)
    return jax.checkpoint(layer_fn,
                          policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
