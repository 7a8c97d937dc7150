"""Logits of `from_pretrained` against Hugging Face `transformers` on the same tiny random weights.

f32: 1e-5 absolute, for Qwen3 (QK-norm), Qwen2 (no QK-norm,
q/k/v biases), grouped-query attention and tied embeddings.

bf16: transformers in `torch.bfloat16` rounds the residual stream, the RoPE
rotation and the norm outputs to bf16 at places our `bf16` policy keeps in f32
(its f32 regions), so the two bf16 forwards differ by the same order as each
differs from f32: about 2^-6 of the logit scale here. The test states that
order as its tolerance, and checks that our bf16 is not less accurate than
transformers' own bf16 (relative to the f32 logits).
"""

import numpy as np
import pytest

from jaxrl_lp.models.hf_io import from_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

F32_TOL = 1e-5  # absolute, on logits of magnitude ~4
BF16_TOL = 0.15  # absolute, ~2^-5 of max|logits|; measured 0.05-0.09 on these configs
CASES = {
    "qwen3_gqa": ("Qwen3", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3_gqa_tied": ("Qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3_mha": ("Qwen3", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen2_bias_no_qk_norm": ("Qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
}


def hf_checkpoint(case, path, seed=0):
    """Saves a tiny random transformers model (norms and biases random too) to `path`."""
    arch, kwargs = CASES[case]
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, head_dim=8, max_position_embeddings=64, rope_theta=10_000.0,
        rms_norm_eps=1e-6, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens, dtype):
    with torch.no_grad():
        return model.to(dtype)(torch.from_numpy(tokens)).logits.float().numpy()


def tokens_BxT(seed=0, b=2, t=13):
    return np.random.RandomState(seed).randint(0, 96, (b, t))


@pytest.mark.parametrize("case", list(CASES))
def test_f32_logits_match_transformers(tmp_path, case):
    model = hf_checkpoint(case, tmp_path)
    tokens = tokens_BxT()
    ours = from_pretrained(tmp_path, policy="fp32")
    assert ours.config.qk_norm == (case != "qwen2_bias_no_qk_norm")
    logits = np.asarray(ours(tokens))
    assert logits.dtype == np.float32 and logits.shape == (2, 13, 96)
    np.testing.assert_allclose(logits, hf_logits(model, tokens, torch.float32),
                               rtol=0, atol=F32_TOL)


@pytest.mark.parametrize("case", ["qwen3_gqa", "qwen2_bias_no_qk_norm"])
def test_bf16_logits_close_to_transformers_bf16(tmp_path, case):
    model = hf_checkpoint(case, tmp_path, seed=1)
    tokens = tokens_BxT(seed=1)
    ref_f32 = hf_logits(model, tokens, torch.float32)
    ref_bf16 = hf_logits(model, tokens, torch.bfloat16)
    ours_bf16 = np.asarray(from_pretrained(tmp_path, policy="bf16")(tokens))
    assert ours_bf16.dtype == np.float32  # logits are f32 under every policy
    np.testing.assert_allclose(ours_bf16, ref_bf16, rtol=0, atol=BF16_TOL)
    ours_err, hf_err = np.abs(ours_bf16 - ref_f32).max(), np.abs(ref_bf16 - ref_f32).max()
    assert 0 < ours_err <= 1.5 * hf_err, (ours_err, hf_err)  # bf16 really ran, and no worse
