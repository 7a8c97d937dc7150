"""Our params pytree -> a Hugging Face `transformers` model holding the same weights.

The reference implementation that the sampler benchmark races and that parity
tests compare against. The mapping is `models.hf_names.hf_tensor_map` (the
table of docs/design/parameters.md): our linear weights are `[in, out]`, HF's are
`[out, in]`, and our per-layer tensors are stacked along a leading axis `L`.

Dense configs only (Qwen3 with QK-norm, Qwen2 with q/k/v biases, Llama with
neither): Ouro's modeling code is not part of `transformers`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.hf_config import config_to_hf
from jaxrl_lp.models.hf_names import hf_tensor_map

__all__ = ["hf_config", "hf_model", "hf_state_dict"]


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def hf_state_dict(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our params as HF-named, HF-shaped f32 numpy arrays (linear weights transposed).

    Examples:
      >>> sd = hf_state_dict(cfg, params)
      >>> sd["model.layers.0.self_attn.q_proj.weight"].shape  # [out, in]
      (64, 64)
    """
    out = {}
    for e in hf_tensor_map(cfg):
        x = np.asarray(_get(params, e.path), np.float32)
        for i in range(cfg.num_layers) if e.per_layer else [None]:
            xi = x if i is None else x[i]
            out[e.hf_name.format(i=i)] = np.array(xi.T if e.transpose else xi, order="C")  # a copy
    return out


def hf_config(cfg: ModelConfig):
    """The `transformers` config object of a dense `ModelConfig` (f32, eager attention)."""
    import transformers

    if cfg.is_looped:
        raise NotImplementedError(
            "hf_config: Ouro's modeling code ships with its checkpoints, not with transformers; "
            "only dense (qwen3/qwen2/llama) configs have a transformers reference"
        )
    d = config_to_hf(cfg, dialect="5", weights_dtype="f32")
    config_cls = getattr(transformers, d["architectures"][0].replace("ForCausalLM", "Config"))
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type")}
    return config_cls(**d)


def hf_model(cfg: ModelConfig, params: dict, *, threads: int | None = None):
    """A `transformers` causal LM (f32, eval mode, CPU) with exactly our weights.

    Args:
      cfg: a dense architecture.
      params: our parameter pytree (any float dtype; loaded as f32).
      threads: if given, `torch.set_num_threads(threads)`.

    Returns:
      e.g. a `transformers.Qwen3ForCausalLM`; its f32 logits match
      `models.forward` to about 1e-5 (tests/test_parity_hf.py).

    Examples:
      >>> model = hf_model(cfg, params)
      >>> model.generate(torch.tensor(prompt_BxP), max_new_tokens=8, do_sample=False)
    """
    import torch
    import transformers

    if threads is not None:
        torch.set_num_threads(threads)
    config = hf_config(cfg)
    model_cls = getattr(transformers, config_to_hf(cfg)["architectures"][0])
    model = model_cls(config)
    sd = {k: torch.from_numpy(v) for k, v in hf_state_dict(cfg, params).items()}
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # RoPE inv_freq is a non-persistent buffer, rebuilt by the model itself.
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(f"hf_model: state dict mismatch: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.float().eval()
