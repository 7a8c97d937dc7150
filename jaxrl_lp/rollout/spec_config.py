"""`SpecConfig`: how a speculative rollout drafts (a typed, parsed config value).

String forms (`SpecConfig.parse`, and `str` writes them back):

    self:loops=1,k=4                    the looped target at 1 loop step drafts for itself
    dense:PATH,k=4,sink=4,window=256    a dense drafter (checkpoint directory PATH)
    dense:PATH,k=4,rebase=false         ... without re-basing its rotary positions

`k` is the number of tokens drafted per verification (>= 1). A dense
drafter's cache holds `sink` first tokens and a ring of the `window` most
recent ones; `window=0` picks half of what its trained length allows.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["SpecConfig"]

DrafterKind = Literal["self", "dense"]
_KEYS = {"self": ("k", "loops"), "dense": ("k", "sink", "window", "rebase")}


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """A speculative rollout's drafter and draft length (static for the jitted sampler).

    Attributes:
      drafter: `self` (the looped target at fewer loop steps, sharing its
        weights and KV cache) or `dense` (a separate dense model).
      k: tokens drafted per verification forward (>= 1).
      loops: loop steps the self-drafter runs (1 <= loops < the target's R).
      path: the dense drafter's checkpoint directory (Hugging Face safetensors
        or a jaxrl-lp params directory); empty when the params are passed in.
      sink: first tokens a dense drafter always keeps in its cache.
      window: most recent tokens it keeps (a ring); 0 resolves to
        `(trained_length - sink - k) // 2`.
      rebase: re-base its rotary positions so they stay below its trained
        length (False reproduces the un-rebased baseline).
    """

    drafter: DrafterKind = "self"
    k: int = 4
    loops: int = 1
    path: str = ""
    sink: int = 4
    window: int = 0
    rebase: bool = True

    def __post_init__(self):
        if self.drafter not in ("self", "dense"):
            raise ValueError(f"speculative drafter must be 'self' or 'dense'; got {self.drafter!r}")
        for name, lo in (("k", 1), ("loops", 1), ("sink", 0), ("window", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                why = " (tokens drafted per verification)" if name == "k" else ""
                raise ValueError(f"speculative {name} must be an integer >= {lo}{why}; got {v!r}")
        if not isinstance(self.rebase, bool):
            raise ValueError(f"speculative rebase must be true or false; got {self.rebase!r}")

    @classmethod
    def parse(cls, spec: str | SpecConfig | None) -> SpecConfig | None:
        """Reads the string form (module docstring); '' or None gives None (speculation off)."""
        if spec is None or isinstance(spec, SpecConfig):
            return spec
        text = str(spec).strip()
        if not text:
            return None
        kind, _, rest = text.partition(":")
        if kind not in _KEYS:
            raise ValueError(f"bad speculative spec {text!r}: it starts with 'self:' or 'dense:', "
                             "e.g. 'self:loops=1,k=4' or 'dense:PATH,k=4,sink=4,window=256'")
        parts = [p.strip() for p in rest.split(",")] if rest else []
        kw: dict = {"drafter": kind}
        if kind == "dense":
            if not parts or "=" in parts[0]:
                raise ValueError(f"bad speculative spec {text!r}: a dense drafter needs its "
                                 "checkpoint directory first, 'dense:PATH,k=4'")
            kw["path"] = parts.pop(0)
        for p in parts:
            key, sep, value = p.partition("=")
            if not sep or key not in _KEYS[kind]:
                raise ValueError(f"bad speculative spec {text!r}: {p!r} is not one of "
                                 f"{', '.join(k + '=...' for k in _KEYS[kind])}")
            if key == "rebase":
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"bad speculative spec {text!r}: rebase must be true or false")
                kw[key] = value.lower() == "true"
            else:
                try:
                    kw[key] = int(value)
                except ValueError:
                    raise ValueError(f"bad speculative spec {text!r}: {key} must be an integer; "
                                     f"got {value!r}") from None
        return cls(**kw)

    def __str__(self) -> str:
        if self.drafter == "self":
            return f"self:loops={self.loops},k={self.k}"
        out = f"dense:{self.path},k={self.k},sink={self.sink},window={self.window}"
        return out if self.rebase else out + ",rebase=false"

    def resolve(self, cfg, drafter_cfg=None) -> SpecConfig:
        """This spec checked against the target `cfg` (and the dense drafter's), window resolved.

        Raises:
          ValueError: self-speculation on a dense target or at >= R loop steps; a
            dense drafter missing, of another vocabulary, or whose sink + window
            + k exceed its trained length (`max_position_embeddings`).
        """
        if self.drafter == "self":
            if not cfg.is_looped:
                raise ValueError("self-speculation drafts with the looped target at fewer loop "
                                 "steps; this target is a dense model: use a dense drafter")
            if self.loops >= cfg.loop_steps:
                raise ValueError(f"speculative loops={self.loops}: the self-drafter must run "
                                 f"fewer loop steps than the target's {cfg.loop_steps}")
            return self
        if drafter_cfg is None:
            raise ValueError("a dense speculative drafter needs its config and params "
                             "(drafter=(params, cfg), or a checkpoint path)")
        if drafter_cfg.is_looped:
            raise ValueError("the speculative drafter must be a dense model (family 'qwen3'); "
                             "a looped target drafts for itself with 'self:loops=...'")
        if drafter_cfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"the drafter's vocabulary ({drafter_cfg.vocab_size} tokens) differs "
                             f"from the target's ({cfg.vocab_size}); speculative decoding compares "
                             "their distributions token by token and needs one vocabulary")
        trained = drafter_cfg.max_position_embeddings
        window = self.window or (trained - self.sink - self.k) // 2
        if window < 1 or self.sink + window + self.k > trained:
            raise ValueError(
                f"speculative window={window} (with sink={self.sink} and k={self.k}) is larger "
                f"than the drafter's trained length of {trained} tokens allows: sink + window + "
                f"k must be <= {trained} so that its re-based positions stay below it")
        return dataclasses.replace(self, window=window)
