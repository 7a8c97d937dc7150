"""`LoraConfig`: the `lora` section of a training config, and its checks against the model.

Keys (`--set lora.rank=8 ...`):

- `rank`: the adapters' rank r; 0 (the default) trains the full model, exactly
  as a run without the section.
- `alpha`: the adapters' scale is `alpha / r` (PEFT's `lora_alpha`).
- `targets`: which layer matmuls get an adapter, comma-separated short names
  from `q, k, v, o, gate, up, down`, or `all` (the default).
- `base_format`: how the frozen base is held: `f32`, `bf16` (every tensor
  bf16), or a number format for the layer matmuls (`fp8`, `mxfp8`, `mxfp4`,
  `nvfp4`: codes and scales, QLoRA-style; the other tensors bf16).
- `serve`: what the sampler runs: `unmerged` (the base and the adapters, as
  the learner computes them: replay == sampler) or `merged` (`W + A B s`,
  rounded to the served format: `sync.exporter`, or the base's own format when
  that is `none`; with `sync.loss_on_served` the loss runs on that copy).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl_lp.fields import check_choice, check_int, check_number, check_str

__all__ = ["BASE_FORMATS", "TARGETS", "LoraConfig"]

# The layer matmuls an adapter may target, by short name (`lora.targets`), and their
# weights in the params tree (docs/design/parameters.md).
TARGETS: dict[str, str] = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
}
# How the frozen base may be held (`lora.base_format`): plain dtypes, or a number format
# of the layer matmuls (`numerics.FORMATS`; weights-only ternary/binary are not bases).
BASE_FORMATS: tuple[str, ...] = ("f32", "bf16", "fp8", "mxfp8", "mxfp4", "nvfp4")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA: low-rank adapters trained beside a frozen base (jaxrl_lp.lora).

    Attributes:
      rank: the adapters' rank r; 0 trains the full model (LoRA off, the default).
      alpha: the adapters' output is scaled by alpha / rank (PEFT's lora_alpha).
      targets: the layer matmuls adapted, comma-separated from q, k, v, o, gate, up, down,
        or `all`.
      base_format: how the frozen base is held: f32, bf16 (every tensor), or fp8, mxfp8,
        mxfp4, nvfp4 (the layer matmuls as codes and scales, QLoRA-style; the rest bf16).
      serve: `unmerged`: the sampler runs the base and the adapters as the learner does
        (replay == sampler bit for bit); `merged`: it runs W + A B alpha/r rounded to the
        served format (sync.exporter, or the base's format when that is none), and with
        sync.loss_on_served the loss runs on that copy (straight-through to the adapters).

    Where the base comes from: a pretrained `init_from` checkpoint (LoRA from the first
    step, warm-start included), else the run's own full warm-start (LoRA from the first
    GRPO step). docs/design/lora.md, "LoRA".
    """

    rank: int = 0
    alpha: float = 16.0
    targets: str = "all"
    base_format: str = "f32"
    serve: Literal["unmerged", "merged"] = "unmerged"

    def __post_init__(self):
        check_int("lora.rank", self.rank, minimum=0, why=" (0: LoRA off, the full model trains)")
        check_number("lora.alpha", self.alpha, gt=0, why=" (the adapters' scale is alpha / rank)")
        check_str("lora.targets", self.targets, nonempty=True,
                  what="matmul names from q,k,v,o,gate,up,down (comma-separated) or all")
        self.target_weights()  # names checked
        check_choice("lora.base_format", self.base_format, BASE_FORMATS)
        check_choice("lora.serve", self.serve, ("unmerged", "merged"))
        if not self.enabled:  # a LoRA setting without a rank would be silently ignored
            changed = [f"lora.{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                       if f.name != "rank" and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"lora.rank=0 turns LoRA off, so {', '.join(changed)} would do "
                                 "nothing; set lora.rank to a positive rank (e.g. 8), or leave "
                                 "the other lora keys at their defaults")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """`alpha / rank`, what the adapters' product is multiplied by."""
        return float(self.alpha) / self.rank

    def target_weights(self) -> tuple[str, ...]:
        """The params-tree names of the targeted weights (`q_proj`, ...), in model order."""
        names = [t.strip() for t in self.targets.split(",")]
        if names == ["all"]:
            return tuple(TARGETS.values())
        unknown = [n for n in names if n not in TARGETS]
        if unknown or not all(names):
            bad = unknown[0] if unknown else ""
            raise ValueError(f"lora.targets={self.targets!r}: unknown target {bad!r}; choose "
                             f"from {', '.join(TARGETS)} (comma-separated) or all")
        if len(set(names)) != len(names):
            raise ValueError(f"lora.targets={self.targets!r} names a target twice")
        chosen = {TARGETS[n] for n in names}
        return tuple(w for w in TARGETS.values() if w in chosen)

    def check_model(self, shapes: dict[str, tuple[int, int]]) -> None:
        """Raises unless `rank` fits every targeted matrix: r <= min(in, out).

        Args:
          shapes: `{weight name: (in, out)}` of the model's layer matmuls.
        """
        if not self.enabled:
            return
        for name in self.target_weights():
            n_in, n_out = shapes[name]
            if self.rank > min(n_in, n_out):
                raise ValueError(
                    f"lora.rank={self.rank} is larger than the {name} matrix allows "
                    f"([{n_in}, {n_out}]: a rank above min(in, out) = {min(n_in, n_out)} adds "
                    f"parameters and no capacity); set lora.rank to at most {min(n_in, n_out)} "
                    f"or drop {name.removesuffix('_proj')} from lora.targets")
