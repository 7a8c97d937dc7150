"""Model configuration: one frozen dataclass for the dense (Qwen3) and looped (Ouro) families."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxrl_lp.models.loop import ExitRule

__all__ = ["ModelConfig", "PRESETS", "get_preset"]

Family = Literal["qwen3", "ouro"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only language model.

    Attributes:
      family: `qwen3` (dense pre-norm decoder; Qwen2 checkpoints load into it
        with `attention_bias=True, qk_norm=False`) or `ouro` (looped decoder
        with sandwich norms, shared weights across `loop_steps`, exit gate).
      vocab_size: number of token ids.
      hidden_size: width of the residual stream, D.
      num_layers: decoder layers L (per loop step for `ouro`).
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention when fewer).
      head_dim: width of one head.
      intermediate_size: SwiGLU hidden width F.
      rope_theta: RoPE base.
      rms_eps: RMSNorm epsilon.
      tie_embeddings: the output projection is the transposed embedding.
      qk_norm: RMSNorm over head_dim on queries and keys (Qwen3).
      attention_bias: biases on the q/k/v projections (Qwen2).
      max_position_embeddings: the context length the model was trained for.
      loop_steps: R, the number of loop steps (`total_ut_steps`); 1 for dense.
      bos_token_id / eos_token_id / pad_token_id: special ids (may coincide;
        the shipped Ouro config sets all three to 0).
      init_std: standard deviation of the random initialization.
      exit_rule: a looped model's default exit rule and read-out (`full`,
        `fixed:K`, `threshold:T`): what `CausalLM.__call__`, the sampler and
        `jaxrl-lp sample` use unless told otherwise. An Ouro checkpoint sets it
        from its `early_exit_step` / `early_exit_threshold` (`threshold:1.0`
        when absent, as its reference code reads out); `full` for dense models.
    """

    family: Family = "qwen3"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    qk_norm: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    loop_steps: int = 1
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    init_std: float = 0.02
    exit_rule: str = "full"

    def __post_init__(self):
        if self.family not in ("qwen3", "ouro"):
            raise ValueError(
                f"ModelConfig.family: unknown family {self.family!r}; allowed: 'qwen3', 'ouro'"
            )
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings", "loop_steps"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{f} must be a positive integer; got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE; got {self.head_dim}")
        if self.family == "qwen3" and self.loop_steps != 1:
            raise ValueError("ModelConfig.loop_steps must be 1 for the dense 'qwen3' family")
        for f in ("rope_theta", "rms_eps", "init_std"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a finite number > 0; got {v!r}")
        for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, f)  # any integer: some Hugging Face configs write -1 for "none"
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"ModelConfig.{f} must be None or an integer; got {v!r}")
        try:
            rule = ExitRule.parse(self.exit_rule)
            rule.check(self.loop_steps)
        except ValueError as e:
            raise ValueError(f"ModelConfig.exit_rule: {e}") from None
        if self.family == "qwen3" and rule.kind != "full":
            raise ValueError(f"ModelConfig.exit_rule must be 'full' for the dense 'qwen3' family; "
                             f"got {self.exit_rule!r}")
        object.__setattr__(self, "exit_rule", str(rule))

    @property
    def is_looped(self) -> bool:
        return self.family == "ouro"

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        """Number of parameters, computed from the shapes (see `models.init_params`)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        norms = (4 if self.is_looped else 2) * d + (2 * hd if self.qk_norm else 0)
        per_layer = attn + 3 * d * f + norms
        total = self.num_layers * per_layer + self.vocab_size * d + d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        if self.is_looped:
            total += d + 1  # exit gate
        return total


# Named model configs for `get_preset`: published Qwen3/Ouro shapes and tiny test sizes.
PRESETS: dict[str, ModelConfig] = {
    # Published Ouro configs (ByteDance/Ouro-1.4B and -2.6B config.json).
    "ouro-1.4b": ModelConfig(
        family="ouro", vocab_size=49152, hidden_size=2048, num_layers=24, num_heads=16,
        num_kv_heads=16, head_dim=128, intermediate_size=5632, rope_theta=1_000_000.0,
        rms_eps=1e-6, tie_embeddings=False, qk_norm=False, max_position_embeddings=65536,
        loop_steps=4, bos_token_id=0, eos_token_id=0, pad_token_id=0, exit_rule="threshold:1.0",
    ),
    "ouro-2.6b": ModelConfig(
        family="ouro", vocab_size=49152, hidden_size=2048, num_layers=48, num_heads=16,
        num_kv_heads=16, head_dim=128, intermediate_size=5632, rope_theta=1_000_000.0,
        rms_eps=1e-6, tie_embeddings=False, qk_norm=False, max_position_embeddings=65536,
        loop_steps=4, bos_token_id=0, eos_token_id=0, pad_token_id=0, exit_rule="threshold:1.0",
    ),
    # Qwen/Qwen3-0.6B config.json.
    "qwen3-0.6b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, intermediate_size=3072, rope_theta=1_000_000.0,
        rms_eps=1e-6, tie_embeddings=True, qk_norm=True, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
    ),
    # Qwen/Qwen3-4B config.json.
    "qwen3-4b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=2560, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=9728, rope_theta=1_000_000.0,
        rms_eps=1e-6, tie_embeddings=True, qk_norm=True, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
    ),
    # Tiny sizes for tests and the CPU default.
    "tiny-qwen3": ModelConfig(
        family="qwen3", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
        rope_theta=10_000.0,
    ),
    "tiny-ouro": ModelConfig(
        family="ouro", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, qk_norm=False,
        max_position_embeddings=512, loop_steps=4, rope_theta=10_000.0,
    ),
    # The "small" size of the sampler benchmark: 8 layers, hidden 512, vocab 32000.
    "small-qwen3": ModelConfig(
        family="qwen3", vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8,
        num_kv_heads=4, head_dim=64, intermediate_size=1408, max_position_embeddings=2048,
        rope_theta=10_000.0,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Returns a preset config by name (see `PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]
