"""Our adapters in the PEFT layout: Hugging Face `peft` loads them onto the base and gives our logits.

A tiny random Qwen3 checkpoint written by `transformers`; adapters on every
layer matmul with B non-zero; `save_peft`; `peft.PeftModel.from_pretrained` on
the `transformers` model: f32 logits within 1e-5 of our unmerged LoRA forward
(the base alone is off by several units, so the adapters are what is compared).
`load_peft` reads back the same bits and settings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.lora import LoraConfig, LoraParams, LoraWeights
from jaxrl_lp.lora.peft import CONFIG_FILE, WEIGHTS_FILE, load_peft, peft_names, save_peft
from jaxrl_lp.models.hf_io import load_hf_params, read_hf_config
from jaxrl_lp.models.model import forward
from jaxrl_lp.numerics.policy import FP32

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-5  # absolute, f32 logits (tests/test_parity_hf.py's parity tolerance)


def tiny_qwen3(path, seed=0):
    """A tiny random `transformers` Qwen3 (untied, GQA, random norms) saved to `path`."""
    config = transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.2)
    model.save_pretrained(path)


# Every matmul, and a subset (7 s on 2 shared cores): a subset's directory holds its modules'
# weights only, which `load_peft` reads back as that subset.
@pytest.mark.parametrize("targets", ["all", "q,v,down"])
def test_peft_loads_our_adapters_onto_the_base_and_gives_our_logits(tmp_path, targets):
    base_dir, out = tmp_path / "base", tmp_path / "adapter"
    tiny_qwen3(base_dir)
    mcfg = read_hf_config(base_dir)
    spec = LoraConfig(rank=4, alpha=8.0, targets=targets)
    weights = LoraWeights(spec, mcfg)
    train = weights.from_params(load_hf_params(base_dir, mcfg))
    adapters = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.PRNGKey(2), a.shape),
                            train.adapters)
    files = save_peft(out, mcfg, adapters, spec, str(base_dir))
    assert sorted(files) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    tokens = np.random.RandomState(0).randint(0, 96, (2, 13))
    ours = np.asarray(forward(weights.materialize(LoraParams(train.base, adapters)), mcfg, FP32,
                              jnp.asarray(tokens))[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = hf(torch.from_numpy(tokens)).logits.numpy()
        theirs = peft.PeftModel.from_pretrained(hf, out).eval()(
            torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(ours - base_logits).max() > 0.5  # the adapters change the logits
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)
    # Read back: the same bits and settings.
    back, back_spec = load_peft(out, mcfg)
    assert (back_spec.rank, back_spec.alpha) == (4, 8.0)
    assert back_spec.target_weights() == spec.target_weights()
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(adapters), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_peft_key_names_are_pefts():
    from jaxrl_lp.models import get_preset

    names = peft_names(get_preset("tiny-qwen3"))
    assert names["q_proj"].format(i=3) == "base_model.model.model.layers.3.self_attn.q_proj"
    assert names["down_proj"].format(i=0) == "base_model.model.model.layers.0.mlp.down_proj"
