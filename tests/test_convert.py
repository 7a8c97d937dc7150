"""`jaxrl-lp convert`: run <-> Hugging Face round trips, parity with transformers and the Ouro
reference checkpoints, the served layout (bit-exact round trips), and bad input."""

import dataclasses
import json
import re
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import sets, short_run
from safetensors.numpy import load_file

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.models.hf_io import from_pretrained, load_hf_params, save_hf_checkpoint
from jaxrl_lp.models.model import CausalLM, init_params
from jaxrl_lp.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl_lp.sync.export import served_params_for_forward
from jaxrl_lp.sync.served_io import read_served
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.run_io import model_config_of, save_tokenizer, served_export
from jaxrl_lp.train.sync_hooks import make_exporter

FIXTURES = Path(__file__).parent / "fixtures" / "ouro"
SHORT = short_run(sft_steps=2, grpo_steps=2)
DENSE = ["model.family=qwen3", "model.qk_norm=true", "model.loop_steps=1"]
F32_TOL = 1e-5  # absolute, logits against transformers (the parity tolerance of tests/test_parity_hf.py)


def _convert(capsys, *args):
    capsys.readouterr()
    assert cli_main(["convert", *map(str, args)]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _params(run, step=None):
    ckpt = Checkpointer(run, create=False)
    try:
        return ckpt.restore_params(step)
    finally:
        ckpt.close()


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _header(file):
    """The safetensors header: `{name: {"dtype", "shape", ...}}`."""
    raw = Path(file).read_bytes()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])


@pytest.fixture
def looped_run(finished_runs):
    """The session's finished looped Fair Cast run: a bf16 error-feedback exporter (its
    residual is checkpointed), 8 steps, checkpoints 6 and 8."""
    return finished_runs["fair"][0]


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """A dense (Qwen3) run stopped after its 2 warm-start steps."""
    run = tmp_path_factory.mktemp("convert") / "dense"
    run_train(apply_overrides(default_config(), [*SHORT, *DENSE, f"run.out_dir={run}"]),
              stop_after=2)
    return run


def test_dense_run_to_hf_matches_transformers(dense_run, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = _convert(capsys, "run-to-hf", "--run", dense_run, "--out", tmp_path)
    assert out["step"] == 2 and out["model_type"] == "qwen3"
    params, meta = _params(dense_run)
    ours = CausalLM(model_config_of(meta), params)
    tok = CharTokenizer()
    tokens = np.asarray([tok.encode(t, add_bos=True) for t in ("12+30=24", "57+18=57")])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(tokens)), ref, rtol=0, atol=F32_TOL)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok("12+30=24\n")["input_ids"] == tok.encode("12+30=24\n")
    assert hf_tok.eos_token_id == model.config.eos_token_id == tok.eos_id
    assert HFTokenizer.from_file(tmp_path).encode(tok.alphabet) == tok.encode(tok.alphabet)


def _name_pattern(names):
    return {re.sub(r"\.layers\.\d+\.", ".layers.{i}.", n) for n in names}


def test_looped_run_to_hf_reads_back_and_follows_the_ouro_layout(looped_run, tmp_path, capsys):
    _convert(capsys, "run-to-hf", "--run", looped_run, "--out", tmp_path)
    params, meta = _params(looped_run)
    back = from_pretrained(tmp_path)
    _assert_trees_equal(back.params(), params)
    tokens = np.asarray([CharTokenizer().encode("12+30=24", add_bos=True)])
    ours = CausalLM(model_config_of(meta), params)
    np.testing.assert_array_equal(np.asarray(back(tokens)), np.asarray(ours(tokens)))
    cfg = json.loads((tmp_path / "config.json").read_text())
    ref_dir = FIXTURES / "mha_r4_default"
    ref = json.loads((ref_dir / "config.json").read_text())
    assert cfg["model_type"] == ref["model_type"] == "ouro"
    assert cfg["architectures"] == ref["architectures"]
    assert cfg["total_ut_steps"] == model_config_of(meta).loop_steps
    assert ref["auto_map"].items() <= cfg["auto_map"].items()
    assert _name_pattern(load_file(tmp_path / "model.safetensors")) == _name_pattern(
        _header(ref_dir / "model.safetensors").keys() - {"__metadata__"})


def test_reference_ouro_checkpoint_round_trips_bit_for_bit(tmp_path, capsys):
    ref_dir = FIXTURES / "gqa_r4_threshold1"
    run = tmp_path / "run"
    out = _convert(capsys, "hf-to-run", "--hf", ref_dir, "--out", run, *sets("run.progress=false"))
    assert out["step"] == 0 and out["model_type"] == "ouro"
    params, meta = _params(run, 0)
    _assert_trees_equal(params, load_hf_params(ref_dir, model_config_of(meta)))
    _convert(capsys, "run-to-hf", "--run", run, "--out", tmp_path / "hf", "--dtype", "bf16")
    ref, back = _header(ref_dir / "model.safetensors"), _header(tmp_path / "hf" / "model.safetensors")
    assert {k: (v["dtype"], v["shape"]) for k, v in back.items() if k != "__metadata__"} == {
        k: (v["dtype"], v["shape"]) for k, v in ref.items() if k != "__metadata__"}
    a, b = load_file(ref_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    ref_cfg = json.loads((ref_dir / "config.json").read_text())
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("model_type", "total_ut_steps", "early_exit_threshold", "num_key_value_heads"):
        assert cfg[key] == ref_cfg[key], key
    tokens = np.load(ref_dir / "reference.npz")["tokens"]
    np.testing.assert_array_equal(np.asarray(from_pretrained(tmp_path / "hf")(tokens)),
                                  np.asarray(from_pretrained(ref_dir)(tokens)))


def test_dense_hf_to_run_to_hf_f32_identical(tmp_path, capsys):
    cfg = default_config().model.replace(family="qwen3", qk_norm=True, loop_steps=1,
                                         vocab_size=88, hidden_size=32, num_layers=2)
    save_hf_checkpoint(tmp_path / "hf", cfg, init_params(cfg, jax.random.PRNGKey(3)))
    _convert(capsys, "hf-to-run", "--hf", tmp_path / "hf", "--out", tmp_path / "run",
             *sets("run.progress=false"))
    params, meta = _params(tmp_path / "run")
    _assert_trees_equal(params, load_hf_params(tmp_path / "hf", cfg))
    _convert(capsys, "run-to-hf", "--run", tmp_path / "run", "--out", tmp_path / "back")
    a = load_file(tmp_path / "hf" / "model.safetensors")
    b = load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["init_from"] == str((tmp_path / "hf").absolute())


def test_served_default_exporter_continues_the_run(looped_run, tmp_path, capsys):
    out = _convert(capsys, "served", "--run", looped_run, "--out", tmp_path)
    assert (out["exporter"], out["exporter_state"], out["step"]) == ("bf16:error_feedback",
                                                                     "checkpoint", 8)
    ckpt = Checkpointer(looped_run, create=False)
    try:
        state = ckpt.manager.restore(8)["state"]  # the whole saved state
        params, meta = ckpt.restore_params(8)
        mine, _ = served_export(ckpt, params, meta, 8)
    finally:
        ckpt.close()
    ex = make_exporter("bf16:error_feedback")
    saved = state["sync"]["exporter"]  # orbax gives a NamedTuple back as a dict
    saved = type(ex.init(params))(**saved) if isinstance(saved, dict) else saved
    expected, _ = jax.jit(ex.apply)(params, saved)
    _assert_trees_equal(read_served(tmp_path), expected)
    _assert_trees_equal(mine, expected)
    fresh, _ = jax.jit(ex.apply)(params, ex.init(params))  # without the run's residual
    assert any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(fresh), jax.tree.leaves(expected), strict=True))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    assert cfg["jaxrl_lp_export"]["exporter"] == "bf16:error_feedback"
    assert all(v["dtype"] == "BF16" for k, v in _header(tmp_path / "model.safetensors").items()
               if k != "__metadata__")


def test_served_mxfp8_and_nvfp4_layouts(looped_run, tmp_path, capsys):
    params, meta = _params(looped_run)
    for spec in ("fmt:mxfp8", "fmt:nvfp4"):
        out_dir = tmp_path / spec.split(":")[1]
        _convert(capsys, "served", "--run", looped_run, "--out", out_dir, "--exporter", spec)
        header = _header(out_dir / "model.safetensors")
        q = "model.layers.0.self_attn.q_proj.weight"
        _, d_in, d_out = params["layers"]["q_proj"].shape
        tensors = read_served(out_dir)
        expected, _ = jax.jit(make_exporter(spec).apply)(params, make_exporter(spec).init(params))
        _assert_trees_equal(tensors, expected)
        if spec == "fmt:mxfp8":
            assert header[q]["dtype"] == "F8_E4M3" and header[f"{q}_scale"]["dtype"] == "F8_E8M0"
            assert f"{q}_scale_2" not in header
            scales = np.asarray(tensors["layers"]["q_proj"].scales).astype(np.float32)
            mant, _ = np.frexp(scales)
            assert np.all(mant == 0.5) and np.all(scales > 0)  # powers of two
        else:
            assert (header[q]["dtype"], header[q]["shape"]) == ("U8", [d_out, d_in // 2])
            assert header[f"{q}_scale"]["dtype"] == "F8_E4M3"
            assert header[f"{q}_scale"]["shape"] == [d_out, d_in // 16]
            assert header[f"{q}_scale_2"]["dtype"] == "F32" and header[f"{q}_scale_2"]["shape"] == []
        qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
        assert qc["format"] == spec.split(":")[1] and qc["block_axis"] == 1
        norm = "model.layers.0.input_layernorm.weight"
        assert header[norm]["dtype"] == "F32"  # kept in high precision, bit-exact
        assert np.asarray(tensors["layers"]["attn_norm_in"]).tobytes() == np.asarray(
            params["layers"]["attn_norm_in"]).tobytes()
        _assert_trees_equal(served_params_for_forward(tensors), served_params_for_forward(expected))


def test_a_gsm8k_run_exports_its_init_from_tokenizer(tmp_path):
    hf = tmp_path / "hf"
    CharTokenizer(alphabet="0123456789 #").save(hf)  # stands in for a real tokenizer.json
    (hf / "special_tokens_map.json").write_text("{}")
    base = default_config()
    cfg = dataclasses.replace(base, init_from=str(hf),
                              task=dataclasses.replace(base.task, kind="gsm8k", path="g.jsonl"))
    files = save_tokenizer(cfg, tmp_path / "out")
    assert sorted(files) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert all((tmp_path / "out" / f).read_bytes() == (hf / f).read_bytes() for f in files)
    (hf / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        save_tokenizer(cfg, tmp_path / "out2")


def _fails(capsys, args, *words):
    capsys.readouterr()
    assert cli_main(["convert", *map(str, args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxrl-lp convert: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_bad_input_is_one_line_and_exit_2(looped_run, tmp_path, capsys):
    out = tmp_path / "out"
    _fails(capsys, ["run-to-hf", "--run", tmp_path / "missing", "--out", out], "does not exist")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((looped_run / "config.json").read_text())
    _fails(capsys, ["run-to-hf", "--run", tmp_path / "empty", "--out", out], "no checkpoints")
    _fails(capsys, ["served", "--run", looped_run, "--out", out, "--exporter", "fmt:nope"], "nope")
    _fails(capsys, ["served", "--run", looped_run, "--out", out, "--exporter", "bf16:up"],
           "not one of")
    _fails(capsys, ["served", "--run", looped_run, "--out", out, "--step", 3],
           "no checkpoint at step 3", "[6, 8]")
    _fails(capsys, ["run-to-hf", "--run", looped_run, "--out", out, "--step", 1], "step 1")
    _fails(capsys, ["hf-to-run", "--hf", tmp_path / "nohf", "--out", out], "does not exist")
    _fails(capsys, ["hf-to-run", "--hf", FIXTURES / "mha_r4_default", "--out", looped_run],
           "already holds a run")
    assert not out.exists()
    capsys.readouterr()
    assert cli_main(["convert"]) == 2  # no form: the help
    assert "run-to-hf" in capsys.readouterr().out
