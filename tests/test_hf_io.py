"""Hugging Face checkpoints: config dialects, load/save round trips, transformers layout, errors."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrl_lp.models.config import ModelConfig, get_preset
from jaxrl_lp.models.hf_config import config_from_hf, config_to_hf, read_hf_config
from jaxrl_lp.models.hf_io import load_hf_params, save_hf_checkpoint

# Tiny configs covering every optional entry of the params tree.
QWEN3 = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=48, rope_theta=10_000.0)
QWEN3_TIED = QWEN3.replace(tie_embeddings=True, num_kv_heads=1)
QWEN2 = QWEN3.replace(qk_norm=False, attention_bias=True)
OURO = QWEN3.replace(family="ouro", qk_norm=False, loop_steps=3, num_kv_heads=4,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
CONFIGS = {"qwen3": QWEN3, "qwen3_tied": QWEN3_TIED, "qwen2": QWEN2, "ouro": OURO}


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random params built from the table in docs/design/parameters.md (independently of hf_names)."""
    rng = np.random.default_rng(seed)
    d, f, hd, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers, \
        cfg.vocab_size
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"q_proj": (L, d, hq), "k_proj": (L, d, hk), "v_proj": (L, d, hk),
              "o_proj": (L, hq, d), "gate_proj": (L, d, f), "up_proj": (L, d, f),
              "down_proj": (L, f, d)}
    if cfg.attention_bias:
        shapes |= {"q_bias": (L, hq), "k_bias": (L, hk), "v_bias": (L, hk)}
    if cfg.qk_norm:
        shapes |= {"q_norm": (L, hd), "k_norm": (L, hd)}
    norms = ["attn_norm_in", "attn_norm_out", "mlp_norm_in", "mlp_norm_out"] if cfg.is_looped \
        else ["attn_norm", "mlp_norm"]
    shapes |= {n: (L, d) for n in norms}
    draw = lambda s: rng.standard_normal(s).astype(np.float32)
    params = {"embed": draw((v, d)), "layers": {k: draw(s) for k, s in shapes.items()},
              "final_norm": draw((d,))}
    if not cfg.tie_embeddings:
        params["lm_head"] = draw((d, v))
    if cfg.is_looped:
        params["exit_gate"] = {"kernel": draw((d, 1)), "bias": draw((1,))}
    return params


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out |= flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": np.asarray(v)}
    return out


def assert_trees_equal(a, b):
    fa, fb = flat(a), flat(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fb[k].dtype == np.float32, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)  # bit-exact, tolerance 0


# ------------------------------------------------------------------ config.json dialects
# Qwen/Qwen3-0.6B config.json as released (transformers 4.x dialect).
QWEN3_06B_V4 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
# ByteDance/Ouro-1.4B config.json as released (4.x dialect, remote code).
OURO_14B_V4 = {
    "architectures": ["OuroForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                 "AutoModel": "modeling_ouro.OuroModel",
                 "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    "bos_token_id": 0, "eos_token_id": 0, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
    "layer_types": ["full_attention"] * 24, "max_position_embeddings": 65536,
    "max_window_layers": 24, "model_type": "ouro", "num_attention_heads": 16,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "pad_token_id": 0,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "total_ut_steps": 4,
    "transformers_version": "4.55.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 49152,
}
# Qwen/Qwen2.5-0.5B-style config.json: no head_dim, q/k/v biases implied by the type.
QWEN2_V4 = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def to_v5(cfg: dict) -> dict:
    """The same config as transformers 5.x writes it."""
    cfg = dict(cfg)
    theta = cfg.pop("rope_theta")
    cfg.pop("rope_scaling", None)
    cfg["dtype"] = cfg.pop("torch_dtype")
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    cfg["transformers_version"] = "5.24.0"
    return cfg


@pytest.mark.parametrize("v5", [False, True], ids=["v4", "v5"])
def test_config_dialects(v5):
    conv = to_v5 if v5 else dict
    assert config_from_hf(conv(QWEN3_06B_V4)) == get_preset("qwen3-0.6b").replace(
        pad_token_id=None)  # the released config.json has no pad_token_id
    assert config_from_hf(conv(OURO_14B_V4)) == get_preset("ouro-1.4b")
    q2 = config_from_hf(conv(QWEN2_V4))
    assert (q2.family, q2.qk_norm, q2.attention_bias, q2.head_dim) == ("qwen3", False, True, 64)
    assert (q2.num_kv_heads, q2.tie_embeddings, q2.rope_theta) == (2, True, 1e6)


def test_ouro_keeps_shipped_special_ids_and_default_loops():
    cfg = config_from_hf(OURO_14B_V4)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.loop_steps) == (0, 0, 0, 4)
    no_steps = {k: v for k, v in OURO_14B_V4.items() if k != "total_ut_steps"}
    assert config_from_hf(no_steps).loop_steps == 4  # OuroConfig's default
    assert config_from_hf(OURO_14B_V4 | {"total_ut_steps": 2}).loop_steps == 2


@pytest.mark.parametrize("bad, exc, words", [
    ({"model_type": "mistral"}, ValueError, ["'mistral'", "qwen3", "ouro"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, NotImplementedError, ["yarn"]),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},
     NotImplementedError, ["linear"]),
    ({"layer_types": ["full_attention"] * 23 + ["sliding_attention"]}, NotImplementedError,
     ["sliding_attention", "[23]"]),
    ({"layer_types": None, "use_sliding_window": True, "sliding_window": 4096,
      "max_window_layers": 20}, NotImplementedError, ["sliding", "20, 21, 22, 23"]),
    ({"attention_bias": True}, NotImplementedError, ["attention_bias"]),
    ({"hidden_act": "gelu"}, NotImplementedError, ["gelu"]),
    ({"hidden_size": None}, ValueError, ["hidden_size"]),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default"}}, ValueError,
     ["rope_theta"]),
])
def test_config_errors_name_the_problem(bad, exc, words):
    with pytest.raises(exc) as e:
        config_from_hf(OURO_14B_V4 | bad)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("dialect", ["4", "5"])
@pytest.mark.parametrize("name", list(CONFIGS) + ["ouro-1.4b", "qwen3-0.6b"])
def test_config_to_hf_round_trip(name, dialect):
    cfg = CONFIGS.get(name) or get_preset(name)
    hf = json.loads(json.dumps(config_to_hf(cfg, dialect, "bf16")))
    assert config_from_hf(hf) == cfg
    assert ("rope_theta" in hf, "rope_parameters" in hf) == (dialect == "4", dialect == "5")
    assert hf["torch_dtype" if dialect == "4" else "dtype"] == "bfloat16"
    if cfg.is_looped:
        assert (hf["model_type"], hf["total_ut_steps"], hf["early_exit_threshold"]) == \
            ("ouro", cfg.loop_steps, 1.0)


def test_config_to_hf_refuses_unmatched_architectures():
    with pytest.raises(NotImplementedError, match="qk_norm=True, attention_bias=True"):
        config_to_hf(QWEN3.replace(attention_bias=True))
    with pytest.raises(ValueError, match="dialect"):
        config_to_hf(QWEN3, dialect="6")


# ------------------------------------------------------------------ save / load
@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_load_round_trip_f32_bit_exact(tmp_path, name):
    cfg = CONFIGS[name]
    params = random_params(cfg)
    save_hf_checkpoint(tmp_path, cfg, params)
    assert read_hf_config(tmp_path) == cfg
    assert_trees_equal(params, load_hf_params(tmp_path, cfg))


def test_ouro_names_follow_design_md(tmp_path):
    """Ouro has no transformers reference here, so its names are pinned by hand."""
    params = random_params(OURO)
    save_hf_checkpoint(tmp_path, OURO, params)
    stored = load_file(tmp_path / "model.safetensors")
    lay = params["layers"]
    for i in range(OURO.num_layers):
        for hf, ours in {"input_layernorm": "attn_norm_in", "input_layernorm_2": "attn_norm_out",
                         "post_attention_layernorm": "mlp_norm_in",
                         "post_attention_layernorm_2": "mlp_norm_out"}.items():
            np.testing.assert_array_equal(stored[f"model.layers.{i}.{hf}.weight"], lay[ours][i])
        np.testing.assert_array_equal(stored[f"model.layers.{i}.self_attn.o_proj.weight"],
                                      lay["o_proj"][i].T)
    np.testing.assert_array_equal(stored["model.early_exit_gate.weight"],
                                  params["exit_gate"]["kernel"].T)  # nn.Linear(D, 1): [1, D]
    np.testing.assert_array_equal(stored["model.early_exit_gate.bias"], params["exit_gate"]["bias"])
    np.testing.assert_array_equal(stored["lm_head.weight"], params["lm_head"].T)
    assert len(stored) == 3 + 2 + OURO.num_layers * 11


def test_save_bf16_rounds_once_and_loads_bit_exact(tmp_path):
    params = random_params(OURO, seed=1)
    save_hf_checkpoint(tmp_path, OURO, params, dtype="bf16", dialect="5")
    stored = load_file(tmp_path / "model.safetensors")
    assert {x.dtype for x in stored.values()} == {np.dtype(ml_dtypes.bfloat16)}
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in flat(params).items()}
    assert_trees_equal(rounded, flat(load_hf_params(tmp_path, OURO)))
    # bf16 values survive f32 -> bf16 -> f32 -> bf16 unchanged: a second save is identical.
    save_hf_checkpoint(tmp_path / "again", OURO, load_hf_params(tmp_path, OURO), dtype="bf16")
    again = load_file(tmp_path / "again" / "model.safetensors")
    for k in stored:
        np.testing.assert_array_equal(stored[k].view(np.uint16), again[k].view(np.uint16))


def test_sharded_checkpoint(tmp_path):
    params = random_params(QWEN3)
    save_hf_checkpoint(tmp_path, QWEN3, params, max_shard_bytes=8_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = sum(x.nbytes for f in shards for x in load_file(tmp_path / f).values())
    assert index["metadata"]["total_size"] == total
    assert_trees_equal(params, load_hf_params(tmp_path, QWEN3))
    # Saving again unsharded removes the shards: one checkpoint per directory.
    save_hf_checkpoint(tmp_path, QWEN3, params)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_hand_written_index_with_renamed_shards(tmp_path):
    """The index, not the file names, says where each tensor is."""
    save_hf_checkpoint(tmp_path / "src", QWEN3, random_params(QWEN3))
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    names = sorted(tensors)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    parts = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, out / file, metadata={"format": "pt"})
    weight_map = {k: f for f, keys in parts.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_trees_equal(load_hf_params(tmp_path / "src", QWEN3), load_hf_params(out, QWEN3))


def test_tied_embeddings(tmp_path):
    params = random_params(QWEN3_TIED)
    save_hf_checkpoint(tmp_path, QWEN3_TIED, params)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert "lm_head" not in load_hf_params(tmp_path, QWEN3_TIED)
    # A tied checkpoint that stores the head anyway loads if the head is the embedding...
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tmp_path / "model.safetensors")
    assert_trees_equal(params, load_hf_params(tmp_path, QWEN3_TIED))
    # ...and is refused if it is not.
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_hf_params(tmp_path, QWEN3_TIED)


# ------------------------------------------------------------------ bad inputs
def rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_params(tmp_path / "nope", QWEN3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_hf_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_params(tmp_path, QWEN3)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_hf_params(tmp_path, QWEN3)


def test_unknown_family_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B_V4 | {"model_type": "gemma3"}))
    with pytest.raises(ValueError, match="'gemma3'.*supported.*qwen3") as e:
        read_hf_config(tmp_path)
    assert "config.json" in str(e.value)


def test_missing_tensor_names_it(tmp_path):
    save_hf_checkpoint(tmp_path, QWEN2, random_params(QWEN2))
    rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.bias'.*missing"):
        load_hf_params(tmp_path, QWEN2)


def test_misshaped_tensor_names_it_and_both_shapes(tmp_path):
    save_hf_checkpoint(tmp_path, QWEN3, random_params(QWEN3))
    name = "model.layers.0.mlp.down_proj.weight"  # HF [D, F] = [32, 48]
    rewrite(tmp_path, lambda t: t.__setitem__(name, np.ascontiguousarray(t[name].T)))
    with pytest.raises(ValueError) as e:
        load_hf_params(tmp_path, QWEN3)
    msg = str(e.value)
    for part in (repr(name), "(48, 32)", "expected (32, 48)", "model.safetensors"):
        assert part in msg


def test_unexpected_tensor_is_an_error_unless_not_strict(tmp_path):
    params = random_params(QWEN3)
    save_hf_checkpoint(tmp_path, QWEN3, params)
    rewrite(tmp_path, lambda t: t.update({
        "model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32),  # ignored
    }))
    with pytest.raises(ValueError, match=r"1 tensor.*o_proj.bias.*strict=False"):
        load_hf_params(tmp_path, QWEN3)
    with pytest.warns(UserWarning, match="o_proj.bias"):
        assert_trees_equal(params, load_hf_params(tmp_path, QWEN3, strict=False))


def test_save_rejects_params_that_do_not_match_the_config(tmp_path):
    params = random_params(QWEN3)
    with pytest.raises(ValueError, match="lm_head"):
        save_hf_checkpoint(tmp_path, QWEN3_TIED.replace(num_kv_heads=2), params)
    params["layers"]["q_norm"] = params["layers"]["q_norm"][:1]
    with pytest.raises(ValueError, match="layers/q_norm.*expected"):
        save_hf_checkpoint(tmp_path, QWEN3, params)


# ------------------------------------------------------------------ against transformers
# docs/design/parameters.md: HF module (per layer) -> our key; nn.Linear stores [out, in].
LINEARS = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
           "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj",
           "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "down_proj"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
         "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
HF_CASES = {  # (transformers class, config kwargs): GQA, tied embeddings, q/k/v biases
    "qwen3_gqa": ("Qwen3", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2_bias": ("Qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
}


def hf_model(case: str, seed: int = 0):
    """A tiny random transformers model whose every parameter (norms too) is random."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    arch, kwargs = HF_CASES[case]
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, head_dim=8, max_position_embeddings=64, rope_theta=10_000.0,
        **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def save_hf_model(model, path, **kwargs):
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:  # 5.x writes safetensors only
        kwargs["safe_serialization"] = True
    model.save_pretrained(path, **kwargs)


def check_matches_torch(model, params, cfg):
    """Each torch module applied to random inputs equals our [in, out] weights applied."""
    import torch

    rng = np.random.default_rng(0)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], sd["model.norm.weight"])
    for i, layer in enumerate(model.model.layers):
        for hf, ours in LINEARS.items():
            module = layer.get_submodule(hf)
            x = rng.standard_normal((3, module.in_features)).astype(np.float32)
            want = module(torch.from_numpy(x)).detach().numpy()
            got = x @ np.asarray(params["layers"][ours][i])
            if module.bias is not None:
                got = got + np.asarray(params["layers"][ours.replace("proj", "bias")][i])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{hf}[{i}]")
        for hf, ours in NORMS.items():
            if ours in params["layers"]:
                np.testing.assert_array_equal(params["layers"][ours][i],
                                              sd[f"model.layers.{i}.{hf}.weight"])
    h = rng.standard_normal((3, cfg.hidden_size)).astype(np.float32)
    want = model.lm_head(torch.from_numpy(h)).detach().numpy()
    head = np.asarray(params["embed"]).T if cfg.tie_embeddings else np.asarray(params["lm_head"])
    np.testing.assert_allclose(h @ head, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_load_transformers_checkpoint(tmp_path, case):
    model = hf_model(case)
    save_hf_model(model, tmp_path)
    cfg = read_hf_config(tmp_path)
    assert (cfg.num_kv_heads, cfg.tie_embeddings) == (model.config.num_key_value_heads,
                                                       model.config.tie_word_embeddings)
    assert cfg.attention_bias == (case == "qwen2_bias") and cfg.qk_norm == (case != "qwen2_bias")
    check_matches_torch(model, load_hf_params(tmp_path, cfg), cfg)


def test_load_transformers_sharded_checkpoint(tmp_path):
    model = hf_model("qwen3_gqa", seed=1)
    save_hf_model(model, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = read_hf_config(tmp_path)
    check_matches_torch(model, load_hf_params(tmp_path, cfg), cfg)


@pytest.mark.parametrize("dialect, dtype", [("4", "f32"), ("5", "f32"), ("4", "bf16")])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "qwen2"])
def test_transformers_loads_our_checkpoint(tmp_path, name, dialect, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = CONFIGS[name]
    params = random_params(cfg, seed=2)
    save_hf_checkpoint(tmp_path, cfg, params, dtype=dtype, dialect=dialect,
                       max_shard_bytes=20_000 if dtype == "f32" else None)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(model).__name__ == config_to_hf(cfg)["architectures"][0]
    assert model.config.tie_word_embeddings == cfg.tie_embeddings
    if dtype == "bf16":  # what was written is the bf16 rounding of our weights
        params = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32)
                  for k, v in flat(params).items()}
        params = {"embed": params.pop("embed"), "final_norm": params.pop("final_norm"),
                  **({"lm_head": params.pop("lm_head")} if "lm_head" in params else {}),
                  "layers": {k.split("/")[1]: v for k, v in params.items()}}
    check_matches_torch(model, params, cfg)
