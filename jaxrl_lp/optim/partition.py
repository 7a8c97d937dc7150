"""`partition`: `optax.multi_transform` with every parameter's assignment checked.

Each leaf of the params tree is labelled by a function of its path
(`layers/q_proj/codes`, `embed`, ...). A leaf the labelling leaves unassigned
(`None`), or assigns to a label with no transform, is a ValueError naming the
parameter and the fix, raised by `init`: optax's own error for the second
case is a bare `KeyError`, and it has no notion of the first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from jaxrl_lp.sync.layout import path_str

__all__ = ["param_labels", "partition"]


def param_labels(params: Any, label_of: Callable[[str], str | None],
                 transforms: Mapping[str, Any] | None = None) -> Any:
    """The tree of labels `label_of(path)` of `params`, every leaf checked.

    Raises:
      ValueError: naming the first parameter left unassigned (`label_of` gave
        None) or assigned to a label not in `transforms` (when given).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    labels = []
    for p, _ in flat:
        name = path_str(p)
        label = label_of(name)
        if label is None:
            raise ValueError(f"optimizer partition leaves parameter {name!r} unassigned: every "
                             "parameter needs a label naming its optimizer; add a rule for "
                             "it (or a default label) to the labelling function")
        if transforms is not None and label not in transforms:
            raise ValueError(f"optimizer partition assigns parameter {name!r} to {label!r}, "
                             f"which has no transform (labels with one: {sorted(transforms)}); "
                             "add a transform for it or relabel the parameter")
        labels.append(label)
    return jax.tree_util.tree_unflatten(treedef, labels)


def partition(transforms: Mapping[str, optax.GradientTransformation],
              label_of: Callable[[str], str | None]) -> optax.GradientTransformation:
    """`optax.multi_transform(transforms, labels)` with the labels checked (module docstring).

    Args:
      transforms: label -> optax transform (e.g. `{"codes": error_diffusion(...),
        "adam": optax.adam(...)}`).
      label_of: a parameter's path (`/`-joined) -> its label, or None.

    Returns:
      An optax `GradientTransformation`; its `init` raises the ValueError of
      `param_labels` for a parameter without a (known) label.

    Examples:
      >>> tx = partition({"codes": error_diffusion(0.05), "adam": optax.adam(1e-3)},
      ...                lambda p: "codes" if p.endswith("/codes") else "adam")
    """
    transforms = dict(transforms)
    if not transforms:
        raise ValueError("partition: no transforms given; pass at least one label -> transform")
    return optax.multi_transform(transforms, lambda params: param_labels(params, label_of,
                                                                         transforms))
