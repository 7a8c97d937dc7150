"""`OptimizerSpec`: a run's weight representation and optimizer, parsed from a config string.

The string (config key `sft.optimizer`) round-trips through `parse` / `str`:

- `adamw` (default): f32 params, AdamW (the default run, unchanged).
- `error_diffusion:binary:k=8[:lr=X]`, `error_diffusion:ternary:k=4[:lr=X]`:
  int8 codes (+-1, or -1/0/1) and f32 per-channel scales (`CodedWeights`);
  error diffusion (a k-bit residual) on the codes, AdamW on the rest.
- `latent_ste:binary`, `latent_ste:ternary`: f32 latents quantized in the
  forward, straight-through (`LatentSTEWeights`); AdamW on the latents.

`k` (2..8) is the residual width (default 8); `lr` is error diffusion's peak
step, the fraction of one level a unit RMS-normalized gradient asks for per
step (default `DEFAULT_ED_LR`). The high-precision leaves keep the run's Adam
learning rate and schedule; error diffusion follows the same schedule shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import optax

from jaxrl_lp.optim.error_diffusion import check_k, error_diffusion
from jaxrl_lp.optim.partition import partition
from jaxrl_lp.optim.weights import CodedWeights, LatentSTEWeights

__all__ = ["DEFAULT_ED_LR", "OptimizerSpec"]

# Error diffusion's default peak step (fraction of a level per unit normalized gradient).
# Measured on the default model and task (SFT, 1200 steps): see studies/error_diffusion.py.
DEFAULT_ED_LR = 0.05
_KINDS = ("adamw", "error_diffusion", "latent_ste")
_FORMS = ("adamw | error_diffusion:{binary|ternary}[:k=K][:lr=X] | "
          "latent_ste:{binary|ternary}")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """A weight representation and its optimizer (module docstring for the string form).

    Attributes:
      kind: `adamw`, `error_diffusion` or `latent_ste`.
      levels: `binary` or `ternary` (None for adamw).
      k: error diffusion's residual bits, 2..8 (None otherwise).
      lr: error diffusion's peak step (None otherwise).
    """

    kind: Literal["adamw", "error_diffusion", "latent_ste"] = "adamw"
    levels: Literal["binary", "ternary"] | None = None
    k: int | None = None
    lr: float | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"optimizer kind {self.kind!r}: choose one of {list(_KINDS)}")
        if self.kind == "adamw":
            if (self.levels, self.k, self.lr) != (None, None, None):
                raise ValueError("optimizer adamw takes no levels, k or lr")
            return
        if self.levels not in ("binary", "ternary"):
            raise ValueError(f"optimizer {self.kind}: levels {self.levels!r}; choose binary or "
                             "ternary")
        if self.kind == "latent_ste":
            if self.k is not None or self.lr is not None:
                raise ValueError("optimizer latent_ste takes no k or lr (it trains f32 latents "
                                 "with AdamW at sft.lr)")
            return
        check_k(self.k, "k")
        if not (isinstance(self.lr, float | int) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"error_diffusion lr={self.lr!r}: must be a positive number")

    @classmethod
    def parse(cls, text: str, key: str = "optimizer") -> OptimizerSpec:
        """Parses the string form; a ValueError names `key` and the forms allowed."""
        def bad(why: str) -> ValueError:
            return ValueError(f"{key}={text!r}: {why}; allowed: {_FORMS}, e.g. "
                              f"{key}=error_diffusion:binary:k=8")
        if not isinstance(text, str):
            raise bad("expected a string")
        kind, *rest = text.strip().split(":")
        if kind not in _KINDS:
            raise bad(f"unknown optimizer {kind!r}")
        if kind == "adamw":
            if rest:
                raise bad("adamw takes no options")
            return cls()
        if not rest or rest[0] not in ("binary", "ternary"):
            raise bad(f"{kind} needs the weights' levels, binary or ternary, next")
        levels, opts = rest[0], {}
        for item in rest[1:]:
            name, eq, value = item.partition("=")
            if not eq or name not in ("k", "lr") or name in opts or kind == "latent_ste":
                raise bad(f"unexpected option {item!r}" + (" (latent_ste takes none)"
                                                           if kind == "latent_ste" else
                                                           " (options: k=K, lr=X, once each)"))
            opts[name] = value
        if kind == "latent_ste":
            return cls(kind, levels)
        try:
            k = int(opts.get("k", "8"))
        except ValueError:
            raise bad(f"k={opts['k']!r} is not an integer") from None
        try:
            lr = float(opts.get("lr", DEFAULT_ED_LR))
        except ValueError:
            raise bad(f"lr={opts['lr']!r} is not a number") from None
        try:
            return cls(kind, levels, k, lr)
        except ValueError as e:
            raise ValueError(f"{key}={text!r}: {e}") from None

    def __str__(self) -> str:
        if self.kind == "adamw":
            return "adamw"
        if self.kind == "latent_ste":
            return f"latent_ste:{self.levels}"
        return f"error_diffusion:{self.levels}:k={self.k}:lr={self.lr:g}"

    def weights(self) -> CodedWeights | LatentSTEWeights | None:
        """The weight representation (None: the model's f32 params, trained directly)."""
        if self.kind == "error_diffusion":
            return CodedWeights(self.levels)
        if self.kind == "latent_ste":
            return LatentSTEWeights(self.levels)
        return None

    def transform(self, adam: optax.GradientTransformation,
                  lr_scale: float | Callable = 1.0, seed: int = 0) -> optax.GradientTransformation:
        """The run's optimizer: `adam` alone, or error diffusion on the codes beside it.

        Args:
          adam: the transform of the high-precision leaves (the whole tree for
            adamw and latent_ste).
          lr_scale: multiplies error diffusion's `lr` (a float, or a schedule of
            the step count: the warm-start passes its Adam schedule / peak).
          seed: seeds error diffusion's stochastic rounding.
        """
        if self.kind != "error_diffusion":
            return adam
        scale = lr_scale if callable(lr_scale) else (lambda _: lr_scale)
        ed = error_diffusion(lambda c: self.lr * scale(c), levels=self.levels, k=self.k,
                             seed=seed)
        return partition({"codes": ed, "adam": adam}, CodedWeights(self.levels).label)
