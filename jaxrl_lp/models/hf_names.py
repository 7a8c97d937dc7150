"""The one-to-one map between Hugging Face tensor names and our parameter pytree.

This is the table of `docs/design/parameters.md` as code. HF linear weights are `[out, in]`
(`torch.nn.Linear`), ours are `[in, out]` (`x @ W`), so those entries are
transposed; per-layer tensors `model.layers.{i}.*` are stacked along a leading
layer axis `L` in our tree. Ouro's sandwich norms `input_layernorm`,
`input_layernorm_2`, `post_attention_layernorm`, `post_attention_layernorm_2`
are our `attn_norm_in`, `attn_norm_out`, `mlp_norm_in`, `mlp_norm_out`.
"""

from __future__ import annotations

import dataclasses

from jaxrl_lp.models.config import ModelConfig

__all__ = ["HFTensor", "hf_tensor_map"]


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One parameter: where it lives in our tree and under which HF name."""

    path: tuple[str, ...]  # key path in our params dict
    hf_name: str  # HF tensor name; `{i}` is the layer index for per-layer tensors
    shape: tuple[int, ...]  # our shape, without the leading layer axis
    transpose: bool  # HF stores the transpose ([out, in] for linear weights)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transpose else self.shape


def hf_tensor_map(config: ModelConfig) -> list[HFTensor]:
    """Lists the parameters of `config` in checkpoint order, with their HF names.

    Args:
      config: the architecture; it decides which optional entries exist
        (`q_bias`.. with `attention_bias`, `q_norm`/`k_norm` with `qk_norm`,
        `lm_head` unless tied, sandwich norms and `exit_gate` when looped).

    Returns:
      One `HFTensor` per entry of our params tree.

    Examples:
      >>> [t.hf_name for t in hf_tensor_map(config)][:2]
      ['model.embed_tokens.weight', 'model.layers.{i}.self_attn.q_proj.weight']
    """
    d, f, hd, v = config.hidden_size, config.intermediate_size, config.head_dim, config.vocab_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    out = [HFTensor(("embed",), "model.embed_tokens.weight", (v, d), False)]
    for n, shape in (("q", (d, q)), ("k", (d, kv)), ("v", (d, kv)), ("o", (q, d))):
        out.append(HFTensor(("layers", f"{n}_proj"), f"{attn}{n}_proj.weight", shape, True))
    if config.attention_bias:
        for n, width in (("q", q), ("k", kv), ("v", kv)):
            out.append(HFTensor(("layers", f"{n}_bias"), f"{attn}{n}_proj.bias", (width,), False))
    if config.qk_norm:
        for n in ("q", "k"):
            out.append(HFTensor(("layers", f"{n}_norm"), f"{attn}{n}_norm.weight", (hd,), False))
    for n, shape in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d))):
        out.append(HFTensor(("layers", f"{n}_proj"), f"{mlp}{n}_proj.weight", shape, True))
    if config.is_looped:
        norms = {
            "attn_norm_in": "input_layernorm",
            "attn_norm_out": "input_layernorm_2",
            "mlp_norm_in": "post_attention_layernorm",
            "mlp_norm_out": "post_attention_layernorm_2",
        }
    else:
        norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    for ours, hf in norms.items():
        out.append(HFTensor(("layers", ours), f"model.layers.{{i}}.{hf}.weight", (d,), False))
    out.append(HFTensor(("final_norm",), "model.norm.weight", (d,), False))
    if not config.tie_embeddings:
        out.append(HFTensor(("lm_head",), "lm_head.weight", (d, v), True))
    if config.is_looped:
        out.append(HFTensor(("exit_gate", "kernel"), "model.early_exit_gate.weight", (d, 1), True))
        out.append(HFTensor(("exit_gate", "bias"), "model.early_exit_gate.bias", (1,), False))
    return out
