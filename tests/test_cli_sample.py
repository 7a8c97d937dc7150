"""`jaxrl-lp sample` and `jaxrl-lp bench sampler`, run in-process through the CLI entry point."""

import json

import jax
import numpy as np
import pytest

from jaxrl_lp.cli.main import main
from jaxrl_lp.models import forward, get_preset, init_params
from jaxrl_lp.models.tokenizer import CharTokenizer
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout import LoopSpec, SamplingConfig, generate


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_sample_preset_prints_text_and_writes_rollouts(tmp_path, capsys):
    out = tmp_path / "rollouts.npz"
    argv = ["sample", "--preset", "tiny-ouro", "--seed", "3", "--prompt", "12+30=", "--prompt",
            "7*6=", "--num-samples", "2", "--max-new-tokens", "5", "--temperature", "0.8",
            "--top-k", "40", "--exit-rule", "threshold:0.5", "--compute-mode", "deferred",
            "--out", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln[:5] for ln in lines[:4]] == ["[0.0]", "[0.1]", "[1.0]", "[1.1]"]
    assert "'12+30=' -> " in lines[0] and "mean exit step" in lines[0]
    assert lines[-1] == f"wrote 4 rollouts to {out}"

    saved = np.load(out)
    assert saved["completion_tokens"].shape == (4, 5) and saved["logprobs"].dtype == np.float32
    assert str(saved["loop"]) == "threshold:0.5:1/deferred" and float(saved["temperature"]) == 0.8
    assert len(saved["texts"]) == 4
    # The CLI is `generate` on the seeded preset: same weights, same key, same tokens.
    cfg, tok = get_preset("tiny-ouro"), CharTokenizer()
    ro = generate(init_params(cfg, jax.random.PRNGKey(3)), cfg,
                  [tok.encode("12+30=", add_bos=True), tok.encode("7*6=", add_bos=True)],
                  sampling=SamplingConfig(temperature=0.8, top_k=40), max_new_tokens=5,
                  num_samples=2, eos_id=tok.eos_id, pad_id=0, key=jax.random.PRNGKey(3),
                  loop=LoopSpec("threshold:0.5", "deferred"))
    np.testing.assert_array_equal(saved["completion_tokens"], ro.completion_tokens)
    np.testing.assert_array_equal(saved["exit_steps"], ro.exit_steps)


def test_sample_from_checkpoint_directory_equals_preset(tmp_path, capsys):
    from jaxrl_lp.models.hf_io import save_hf_checkpoint

    cfg = get_preset("tiny-qwen3")
    save_hf_checkpoint(tmp_path, cfg, init_params(cfg, jax.random.PRNGKey(0)))
    common = ["--greedy", "--prompt-ids", "1,5,9,14", "--max-new-tokens", "4", "--json"]
    assert main(["sample", "--checkpoint", str(tmp_path), *common]) == 0
    captured = capsys.readouterr()
    from_ckpt = _json_lines(captured.out)
    # The directory has no tokenizer.json: one warning line says so and how to pass one.
    warning = captured.err.strip()
    assert warning.startswith("jaxrl-lp sample: warning:") and "\n" not in warning
    assert "no tokenizer.json" in warning and "character tokenizer" in warning
    assert "--tokenizer" in warning
    assert main(["sample", "--preset", "tiny-qwen3", "--seed", "0", *common]) == 0
    captured = capsys.readouterr()
    from_preset = _json_lines(captured.out)
    assert "warning" not in captured.err  # a preset uses the character tokenizer by design
    assert len(from_ckpt) == 1 and from_ckpt[0]["completion_ids"] == from_preset[0]["completion_ids"]
    assert from_ckpt[0]["logprob"] == pytest.approx(from_preset[0]["logprob"], abs=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny-qwen3", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--preset", "tiny-qwen3", "--temperature", "0"], "temperature must be > 0"),
    (["--preset", "tiny-qwen3", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--preset", "tiny-qwen3", "--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["--preset", "tiny-qwen3", "--prompt-ids", ",".join(["1"] * 600)], "exceeds the model's context"),
    (["--preset", "tiny-qwen3", "--exit-rule", "threshold:0.5"], "looped models only"),
    (["--preset", "no-such-model"], "unknown model preset"),
    (["--checkpoint", "/nonexistent/ckpt"], "does not exist"),
])
def test_sample_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(["sample", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxrl-lp sample: error:") and message in err and "\n" not in err


def test_hf_reference_model_has_our_weights():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxrl_lp.bench.hf_ref import hf_model

    # Qwen3 (QK-norm, untied head) and Qwen2 (q/k/v biases, tied head).
    for cfg in (get_preset("tiny-qwen3"),
                get_preset("tiny-qwen3").replace(qk_norm=False, attention_bias=True,
                                                 tie_embeddings=True)):
        params = init_params(cfg.replace(init_std=0.2), jax.random.PRNGKey(1))
        if cfg.attention_bias:  # init_params zeroes biases; make them count
            for name in ("q_bias", "k_bias", "v_bias"):
                params["layers"][name] = 0.1 + params["layers"][name]
        tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 11))
        with torch.no_grad():
            ref = hf_model(cfg, params)(torch.from_numpy(tokens)).logits.numpy()
        ours = np.asarray(forward(params, cfg, Policy.parse("fp32"), tokens)[0])
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


def test_bench_sampler_prints_one_json_object(capsys):
    pytest.importorskip("transformers")
    argv = ["bench", "sampler", "--sizes", "tiny", "--looped-sizes", "tiny", "--looped-batches",
            "1", "--batch", "2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
            "--min-time", "0", "--hf-threads", "1"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf", "compile_s",
                "bound_tokens_per_s"):
        assert res[key]["tiny"] > 0
    tiny = res["dense"]["tiny"]
    assert tiny["batch"] == 2 and tiny["new_tokens"] == 4 and tiny["policy"] == "fp32"
    assert tiny["tokens_equal_hf"] == 1.0  # same weights, f32, greedy
    looped = res["looped"]["tiny"]["batch_1"]
    for key in ("dense_tokens_per_s", "deferred_tokens_per_s", "deferred_speedup",
                "mean_exit_depth", "ideal_speedup"):
        assert looped[key] > 0 and res[key]["tiny_batch_1"] == looped[key]
    assert looped["mean_exit_depth"] < 4  # the gate makes exits early
    # The decomposition runs (all exits at the first / last step) were timed too.
    assert {"loop_step_ms_per_token", "fixed_ms_per_token", "attainable_speedup"} <= set(looped)
    assert looped["ideal_speedup"] == pytest.approx(4 / looped["mean_exit_depth"], abs=2e-3)
    assert set(res["targets_met"]) == {"ratio_vs_hf_tiny>=3.0",
                                       "deferred_speedup_tiny_batch_1>=0.7*ideal"}


@pytest.mark.slow
# 34 s cold on 2 cores; the command's own run is the test above
def test_bench_sampler_takes_presets_and_batches_as_the_gpu_cells_do(capsys):
    """`benchmarks/gpu.sh`'s speed cells at tiny sizes: a dense preset by name at two batches,
    a looped preset by name; the bound counts the weights as the loop reads them (f32-carried
    bf16 on CPU: as many bytes as the master) and the KV cache at the mean context."""
    argv = ["bench", "sampler", "--sizes", "tiny-qwen3", "--batch", "2,4", "--looped-sizes",
            "tiny-ouro", "--looped-batches", "2", "--prompt-len", "8", "--new-tokens", "5",
            "--repeats", "1", "--min-time", "0", "--no-hf", "--policy", "bf16"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["bandwidth_gbps"] == 15.0 and res["bandwidth_source"].startswith("a batch-8 f32")
    two, four = res["dense"]["tiny-qwen3_batch_2"], res["dense"]["tiny-qwen3_batch_4"]
    cfg = get_preset("tiny-qwen3")
    # Keys and values of every layer, batch x kv heads x head width x mean context (8 + 2), f32.
    assert two["kv_bytes_per_step"] == 2 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 10 * 4
    assert four["kv_bytes_per_step"] == 2 * two["kv_bytes_per_step"]
    assert two["weight_bytes_per_step"] == four["weight_bytes_per_step"] > 0
    assert 0 < two["ours_fraction_of_bound"] == res["ours_fraction_of_bound"]["tiny-qwen3_batch_2"]
    looped = res["looped"]["tiny-ouro"]["batch_2"]
    assert looped["deferred_tokens_per_s"] > 0 and looped["mean_exit_depth"] <= 4
    for bad, why in ((["--sizes", "tiny-ouro"], "is a looped preset; pass it to --looped-sizes"),
                     (["--looped-sizes", "tiny-qwen3"], "is a dense preset; pass it to --sizes"),
                     (["--batch", "2,x"], "batch sizes are integers")):
        assert main(["bench", "sampler", "--no-hf", *bad]) == 2
        assert why in capsys.readouterr().err
