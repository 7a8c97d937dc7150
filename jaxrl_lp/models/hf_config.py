"""Hugging Face `config.json` <-> `ModelConfig`, for Qwen3, Qwen2, Llama and Ouro checkpoints.

Released checkpoints come in two dialects:

- transformers 4.x (every released Qwen3 and Ouro checkpoint): `rope_theta` and
  `rope_scaling` at the top level, the weights' dtype under `torch_dtype`.
- transformers 5.x: `rope_parameters: {rope_type, rope_theta}` and `dtype`.

Both are read; either is written (`dialect="4"` or `"5"`). The mapping is:

| HF `model_type` | our config |
|---|---|
| `qwen3` | `family="qwen3", qk_norm=True, attention_bias=False` |
| `qwen2` | `family="qwen3", qk_norm=False, attention_bias=True` (q/k/v biases only) |
| `llama` | `family="qwen3", qk_norm=False, attention_bias=False` |
| `ouro` | `family="ouro", qk_norm=False, attention_bias=False`, `total_ut_steps` -> `loop_steps` |

An Ouro config's `early_exit_step` / `early_exit_threshold` become the model's
default `exit_rule` (`models.loop.exit_rule_from_hf`): the reference forward
reads out at `early_exit_step` when set, else at the first loop step whose f32
cumulative exit probability reaches `early_exit_threshold` (1.0 when absent;
with saturated gates that happens before the last step). Saving writes the
keys that make the reference read out by the config's rule
(`exit_rule_to_hf`).

Anything our model would compute differently from the checkpoint's own code is
refused with an error naming the field (RoPE scaling, sliding-window layers,
output-projection or MLP biases, activations other than SiLU) rather than
loaded into a model whose logits would silently differ.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.loop import exit_rule_from_hf, exit_rule_to_hf

__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf", "read_hf_config"]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen3", "qwen2", "llama", "ouro")
Dialect = Literal["4", "5"]

_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "ouro": "OuroForCausalLM",
}
# Ouro's modeling code is not part of transformers; released checkpoints point
# AutoConfig/AutoModel at the files shipped next to the weights.
_OURO_AUTO_MAP = {
    "AutoConfig": "configuration_ouro.OuroConfig",
    "AutoModel": "modeling_ouro.OuroModel",
    "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
}
_TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def _first_id(value: Any) -> int | None:
    # `eos_token_id` is a list in some configs (several stop tokens); the first
    # one is the canonical end-of-sequence id.
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _rope_theta(cfg: dict[str, Any], model_type: str) -> float:
    """Reads the RoPE base from either dialect and refuses RoPE scaling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # 5.x form keyed by layer type
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5.x
        theta, scaling = params["rope_theta"], params
    elif params and cfg.get("rope_theta") is None:
        raise ValueError(f"{model_type} config: rope_parameters {params} has no rope_theta")
    else:  # transformers 4.x; transformers' default base when absent
        theta, scaling = cfg.get("rope_theta") or 10_000.0, cfg.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            raise NotImplementedError(
                f"{model_type} config: RoPE scaling {kind!r} ({scaling}) is not implemented; "
                "only the default (unscaled) RoPE is. Remove the scaling from config.json only "
                "if the checkpoint was trained without it."
            )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(
            f"{model_type} config: partial_rotary_factor={cfg['partial_rotary_factor']} is not "
            "implemented; RoPE is applied to the whole head_dim."
        )
    return float(theta)


def _required(cfg: dict[str, Any], key: str, model_type: str) -> int:
    if cfg.get(key) is None:
        raise ValueError(f"{model_type} config: required field {key!r} is missing")
    return int(cfg[key])


def _check_full_attention(cfg: dict[str, Any], model_type: str, num_layers: int) -> None:
    """Refuses checkpoints with sliding-window layers (we implement full attention only)."""
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        # transformers derives the layer types like this when the list is absent.
        window_from = cfg.get("max_window_layers", num_layers)
        sliding = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
        layer_types = [
            "sliding_attention" if sliding and i >= window_from else "full_attention"
            for i in range(num_layers)
        ]
    bad = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if bad:
        raise NotImplementedError(
            f"{model_type} config: layers {bad} use {layer_types[bad[0]]!r} "
            f"(sliding_window={cfg.get('sliding_window')}); only full attention is implemented. "
            "Set use_sliding_window=false and layer_types to 'full_attention' only if the "
            "checkpoint was trained that way."
        )


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Builds a `ModelConfig` from a Hugging Face `config.json` dict.

    Reads both the transformers 4.x and 5.x dialects. A missing `head_dim` is
    `hidden_size // num_attention_heads`; a missing `num_key_value_heads` means
    no grouping; a list-valued `eos_token_id` keeps its first id. Ouro's shipped
    bos/eos/pad ids (all 0) are kept as they are.

    Args:
      cfg: the parsed `config.json`.

    Returns:
      The equivalent `ModelConfig`.

    Raises:
      ValueError: unknown or missing `model_type`.
      NotImplementedError: a feature the checkpoint uses that our model does not
        compute (RoPE scaling, sliding-window layers, extra biases, non-SiLU MLP).

    Examples:
      >>> config_from_hf(json.load(open("Ouro-1.4B/config.json"))).loop_steps
      4
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: unsupported model_type {model_type!r}; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    num_layers = _required(cfg, "num_hidden_layers", model_type)
    num_heads = _required(cfg, "num_attention_heads", model_type)
    hidden = _required(cfg, "hidden_size", model_type)
    head_dim = cfg.get("head_dim") or hidden // num_heads
    num_kv_heads = cfg.get("num_key_value_heads") or num_heads

    if cfg.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(
            f"{model_type} config: hidden_act={cfg['hidden_act']!r}; only 'silu' (SwiGLU) is "
            "implemented"
        )
    if cfg.get("mlp_bias"):
        raise NotImplementedError(f"{model_type} config: mlp_bias=true is not implemented")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        # Qwen3, Llama and Ouro put the flag on o_proj too; our layout has q/k/v biases only.
        raise NotImplementedError(
            f"{model_type} config: attention_bias=true (biases on q/k/v/o) is not implemented; "
            "only Qwen2's q/k/v biases are"
        )
    _check_full_attention(cfg, model_type, num_layers)

    fields: dict[str, Any] = dict(
        family="ouro" if model_type == "ouro" else "qwen3",
        vocab_size=_required(cfg, "vocab_size", model_type),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        intermediate_size=_required(cfg, "intermediate_size", model_type),
        rope_theta=_rope_theta(cfg, model_type),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        loop_steps=int(cfg.get("total_ut_steps", 4)) if model_type == "ouro" else 1,
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        eos_token_id=_first_id(cfg.get("eos_token_id")),
        pad_token_id=_first_id(cfg.get("pad_token_id")),
        init_std=float(cfg.get("initializer_range", 0.02)),
    )
    if model_type == "ouro":
        fields["exit_rule"] = exit_rule_from_hf(cfg, fields["loop_steps"])
    return ModelConfig(**fields)


def _model_type(config: ModelConfig) -> str:
    if config.is_looped:
        if config.qk_norm or config.attention_bias:
            raise NotImplementedError(
                "config_to_hf: Ouro checkpoints have neither QK-norm nor attention biases; "
                f"got qk_norm={config.qk_norm}, attention_bias={config.attention_bias}"
            )
        return "ouro"
    match (config.qk_norm, config.attention_bias):
        case (True, False):
            return "qwen3"
        case (False, True):
            return "qwen2"
        case (False, False):
            return "llama"
    raise NotImplementedError(
        "config_to_hf: no Hugging Face architecture has QK-norm together with q/k/v-only "
        "biases (qk_norm=True, attention_bias=True); set one of them to False"
    )


def config_to_hf(
    config: ModelConfig, dialect: Dialect = "4", weights_dtype: str = "f32"
) -> dict[str, Any]:
    """Writes a `ModelConfig` as a Hugging Face `config.json` dict.

    Dense configs become `qwen3` (QK-norm), `qwen2` (q/k/v biases) or `llama`
    (neither), all loadable by `transformers.AutoModelForCausalLM`. Looped configs
    become an `OuroConfig` dict (`model_type="ouro"`, `total_ut_steps`, and
    `early_exit_step` / `early_exit_threshold` written from `config.exit_rule`,
    so the reference forward reads out where ours does) with the `auto_map` of
    the released checkpoints, so the checkpoint loads with
    `trust_remote_code=True` once Ouro's `configuration_ouro.py` and
    `modeling_ouro.py` are copied next to it.

    Args:
      config: the model config.
      dialect: `"4"` (top-level `rope_theta`, `torch_dtype`, as released
        checkpoints are written) or `"5"` (`rope_parameters`, `dtype`).
      weights_dtype: dtype of the saved weights, `f32`, `bf16` or `f16`.

    Returns:
      A JSON-serializable dict.

    Examples:
      >>> config_to_hf(get_preset("tiny-qwen3"))["architectures"]
      ['Qwen3ForCausalLM']
    """
    if dialect not in ("4", "5"):
        raise ValueError(f"config_to_hf: dialect must be '4' or '5'; got {dialect!r}")
    if weights_dtype not in _TORCH_DTYPES:
        raise ValueError(
            f"config_to_hf: weights_dtype must be one of {sorted(_TORCH_DTYPES)}; "
            f"got {weights_dtype!r}"
        )
    model_type = _model_type(config)
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    if model_type != "qwen2":  # Qwen2's biases are not switchable
        out["attention_bias"] = False
    if model_type == "llama":
        out["mlp_bias"] = False
    else:
        out.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=config.num_layers,
            layer_types=["full_attention"] * config.num_layers,
        )
    if model_type == "ouro":
        out.update(
            auto_map=dict(_OURO_AUTO_MAP),
            total_ut_steps=config.loop_steps,
            **exit_rule_to_hf(config.exit_rule, config.loop_steps),
        )
    if dialect == "4":
        out.update(rope_theta=config.rope_theta, rope_scaling=None)
        out["torch_dtype"] = _TORCH_DTYPES[weights_dtype]
    else:
        out["rope_parameters"] = {"rope_theta": config.rope_theta, "rope_type": "default"}
        out["dtype"] = _TORCH_DTYPES[weights_dtype]
    return out


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Reads `config.json` from a checkpoint directory into a `ModelConfig`.

    Args:
      path: checkpoint directory (or the `config.json` file itself).

    Returns:
      The `ModelConfig` (see `config_from_hf`).

    Examples:
      >>> read_hf_config("checkpoints/Qwen3-0.6B").num_layers
      28
    """
    path = os.fspath(path)
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isdir(os.path.dirname(file) or "."):
        raise FileNotFoundError(f"checkpoint directory {os.path.dirname(file)!r} does not exist")
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"no config.json in {os.path.dirname(file)!r}: a Hugging Face checkpoint directory "
            "holds config.json next to its model.safetensors"
        )
    with open(file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from e
    try:
        return config_from_hf(cfg)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(f"{file}: {e}") from e
