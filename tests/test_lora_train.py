"""LoRA in the training program: checkpoints, exact resume, the base's identity, eval and convert.

- On a pretrained base (`init_from`, a tiny Qwen3 Hugging Face checkpoint):
  LoRA SFT then LoRA GRPO (with a KL term to another checkpoint, so the GRPO
  updates move the adapters). Checkpoints hold the adapters and their
  optimizer states only, and the base's fingerprint, which equals the
  pretrained weights' at every checkpoint (the base did not change a bit). A run
  stopped inside the SFT phase and again inside GRPO, resumed each time, ends
  bit-identical to the uninterrupted one (state, metadata, metrics). `jaxrl-lp
  eval` scores it as the run did; `convert run-to-peft` gives a directory
  `peft` loads onto the base with our logits (1e-5); `convert run-to-hf` writes
  it merged. A resume against a changed base is one clear error.
- On the run's own warm-start (the default task's flow): the warm-start is full,
  LoRA starts at the first GRPO step; `<run>/lora_base` is the warm-start's
  params bit for bit; served merged as NVFP4 codes with the loss on that copy,
  every batch's replay equals the sampler's bits (`grpo.verify_every=1`); with
  a KL term to another model the adapters move, and the run stopped twice ends
  as the uninterrupted one.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_MODEL, assert_bit_equal, bits_equal, checkpoints, sets, short_run

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.lora import LoraWeights, hold_base
from jaxrl_lp.models.hf_io import from_pretrained, load_hf_params, save_hf_checkpoint
from jaxrl_lp.models.model import forward, init_params
from jaxrl_lp.numerics.fingerprint import tree_fingerprint
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.logger import without_wall_clock
from jaxrl_lp.train.lora_run import read_lora_params
from jaxrl_lp.train.validate import validate

QWEN = [*TINY_MODEL, "model.family=qwen3", "model.loop_steps=1", "model.qk_norm=true"]
LORA = ["lora.rank=4", "lora.alpha=8.0", "grpo.verify_every=1"]


def _hf(path, seed, model=QWEN):
    """A tiny random checkpoint (Qwen3 by default, else the `model` overrides) with the
    arithmetic task's vocabulary."""
    mcfg = validate(apply_overrides(default_config(), [*model, f"run.out_dir={path}_unused"])).model
    save_hf_checkpoint(path, mcfg, init_params(mcfg, jax.random.PRNGKey(seed)))
    return mcfg


def _records(run_dir):
    return [without_wall_clock(json.loads(x))
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_lora_on_a_pretrained_base_resumes_exactly_evaluates_and_exports(tmp_path, capsys):
    hf, other = tmp_path / "hf", tmp_path / "other"
    mcfg = _hf(hf, 5)
    _hf(other, 6)  # the KL reference: another model, so the GRPO updates have a gradient
    common = [*short_run(sft_steps=4, grpo_steps=2), *QWEN, *LORA, f"init_from={hf}",
              "loss.kl_beta=0.05", f"loss.reference={other}"]
    cfg = lambda d, *x: apply_overrides(default_config(), [*common, f"run.out_dir={d}", *x])
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    summary = run_train(cfg(ref))
    assert run_train(cfg(cut), stop_after=3)["interrupted"]  # inside LoRA SFT
    assert run_train(cfg(cut), stop_after=5)["interrupted"]  # inside LoRA GRPO
    run_train(cfg(cut))
    a, b = checkpoints(ref), checkpoints(cut)
    assert sorted(a) == [4, 6] and sorted(b) == [5, 6]  # the stop at 5 saved one
    assert a[6]["meta"] == b[6]["meta"]
    assert bits_equal(a[6]["state"], b[6]["state"])
    assert _records(ref) == _records(cut)
    # The checkpoints hold the adapters and their optimizer states, not the base; its
    # fingerprint, taken at every save, is the pretrained weights' (as held, f32).
    base = hold_base(load_hf_params(hf, mcfg), "f32")
    for s, c in a.items():
        assert set(c["state"]["params"]) == {"adapters"}, s
        assert c["meta"]["lora"]["base_fingerprint"] == tree_fingerprint(base).tolist(), s
        assert c["meta"]["lora"]["base_source"] == {"kind": "init_from", "path": str(hf)}
    moved = lambda x, y: not bits_equal(x, y)
    assert moved(a[4]["state"]["params"], a[6]["state"]["params"])  # GRPO moved the adapters
    assert moved(a[4]["state"]["opt_grpo"], a[6]["state"]["opt_grpo"])
    # `jaxrl-lp eval` rebuilds the base, checks it and scores as the run did.
    capsys.readouterr()
    assert cli_main(["eval", "--run", str(ref)]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == summary["final_accuracy"]
    # The run's adapted model, as the learner computes it (f32, unmerged).
    ckpt = Checkpointer(ref, create=False)
    params, meta = ckpt.restore_params(6)
    ckpt.close()
    lora, spec = read_lora_params(ref, params, meta, mcfg)
    weights = LoraWeights(spec, mcfg)
    tokens = np.random.RandomState(0).randint(1, mcfg.vocab_size, (2, 11))
    ours = np.asarray(forward(weights.materialize(lora), mcfg, Policy.parse("fp32"), jnp.asarray(tokens))[0])
    # convert run-to-peft: PEFT on the base (init_from itself: held in f32) gives our logits.
    torch, transformers, peft = (pytest.importorskip(m) for m in ("torch", "transformers", "peft"))
    assert cli_main(["convert", "run-to-peft", "--run", str(ref), "--out",
                     str(tmp_path / "adapter")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["base_model"] == str(hf) and out["rank"] == 4
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()(
            torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    # convert run-to-hf: the merged weights, a plain checkpoint with (nearly) the same logits.
    assert cli_main(["convert", "run-to-hf", "--run", str(ref), "--out", str(tmp_path / "m")]) == 0
    merged = np.asarray(from_pretrained(tmp_path / "m", policy="fp32")(tokens))
    np.testing.assert_allclose(merged, ours, rtol=0, atol=1e-5)
    # Resuming against another base (the checkpoint directory's weights replaced) is refused.
    save_hf_checkpoint(hf, mcfg, init_params(mcfg, jax.random.PRNGKey(9)))
    with pytest.raises(ValueError, match="fingerprint"):
        run_train(cfg(ref, "grpo.steps=4"))


@pytest.mark.slow
def test_lora_grpo_on_the_warm_start_keeps_its_base_and_serves_merged_nvfp4_exactly(tmp_path):
    run, ref, other = tmp_path / "run", tmp_path / "ref", tmp_path / "other"
    _hf(other, 6, model=TINY_MODEL)  # the KL reference: another model of the run's shapes
    over = [*short_run(sft_steps=4, grpo_steps=4), *LORA, "lora.base_format=nvfp4",
            "lora.serve=merged", "sync.loss_on_served=true", "loss.kl_beta=0.05",
            f"loss.reference={other}"]
    cfg = lambda d: apply_overrides(default_config(), [*over, f"run.out_dir={d}"])
    run_train(cfg(ref))  # uninterrupted
    run_train(cfg(run), stop_after=4)  # the full warm-start
    warm = checkpoints(run)[4]["state"]
    assert "lora" not in checkpoints(run)[4]["meta"]
    run_train(cfg(run), stop_after=6)
    run_train(cfg(run))  # resumed from a LoRA checkpoint with the merged copy's sync state
    # The base is the warm-start's params, kept whole once; every LoRA checkpoint records the
    # fingerprint of that base as held (NVFP4 codes), taken from the base in memory.
    store = Checkpointer(run, subdir="lora_base")
    base_params, _ = store.restore_params(4)
    store.close()
    assert bits_equal(base_params, warm["params"])
    held = tree_fingerprint(hold_base(base_params, "nvfp4")).tolist()
    ckpts = checkpoints(run)
    assert sorted(ckpts) == [6, 8]
    for c in ckpts.values():
        assert c["meta"]["lora"]["base_fingerprint"] == held
        assert c["meta"]["lora"]["base_source"]["kind"] == "warm_start"
        assert c["state"]["opt_sft"] == {}  # the warm-start's Adam state is dropped
    # Stopped twice and resumed, the run ends as the uninterrupted one: every kept checkpoint
    # whole, every record; and the KL term moved the adapters and their optimizer state
    # between the two checkpoints compared.
    whole = checkpoints(ref)
    assert sorted(whole) == [6, 8]
    for step, c in whole.items():
        assert_bit_equal(ckpts[step]["state"], c["state"])
        assert ckpts[step]["meta"] == c["meta"]
    for part in ("params", "opt_grpo"):
        assert not bits_equal(whole[6]["state"][part], whole[8]["state"][part]), part
    assert _records(run) == _records(ref)
    grpo = [r for r in _records(run) if r["phase"] == "grpo"]
    assert len(grpo) == 4
    # The loss on the merged NVFP4 copy: every batch's replay is the sampler's bits, and
    # the learner's log-probs are the sampler's (mismatch 0).
    assert all(r["replay_verified"] == 1.0 and r["mismatch_max_abs_dlogp"] == 0.0 for r in grpo)


@pytest.mark.slow
# 20 s on 2 shared cores: the `jaxrl-lp sft` command's own LoRA path
def test_jaxrl_lp_sft_is_lora_sft_on_a_pretrained_base(tmp_path, capsys):
    hf = tmp_path / "hf"
    _hf(hf, 5)
    run = tmp_path / "run"
    args = ["sft", *sets(*short_run(sft_steps=3), *QWEN, *LORA, f"init_from={hf}",
                         f"run.out_dir={run}")]
    assert cli_main(args) == 0
    ckpt = Checkpointer(run)
    state, meta = ckpt.manager.restore(3)["state"], ckpt.meta(3)
    ckpt.close()
    assert set(state["params"]) == {"adapters"} and meta["lora"]["start"] == 0
    b = state["params"]["adapters"]["layers"]["q_proj"]["b"]
    assert float(np.abs(np.asarray(b)).max()) > 0  # B left zero: the SFT steps trained it


@pytest.mark.slow
# 55 s on 2 shared cores: the one LoRA run on a mesh
def test_lora_on_a_mesh_shards_the_adapters_and_resumes(tmp_path):
    """bf16 base, rank 8 over fsdp=8 (the session's 8 CPU devices), a KL term to another
    model (so the adapters move: to the GRPO start, the merged copy itself, it is 0 with a
    zero gradient): every batch's replay is the sampler's bits, and a run resumed from a
    LoRA checkpoint on the mesh ends as the whole run, state and records."""
    other = tmp_path / "other"
    _hf(other, 6, model=TINY_MODEL)
    over = [*short_run(sft_steps=2, grpo_steps=4, checkpoint_every=3), *LORA,
            "lora.rank=8", "lora.base_format=bf16", "run.mesh=fsdp=8",
            "grpo.prompts_per_step=8", "loss.kl_beta=0.05", f"loss.reference={other}"]
    cfg = lambda d: apply_overrides(default_config(), [*over, f"run.out_dir={d}"])
    run_train(cfg(tmp_path / "ref"))
    assert run_train(cfg(tmp_path / "cut"), stop_after=3)["interrupted"]  # a LoRA checkpoint
    run_train(cfg(tmp_path / "cut"))
    grpo = [r for r in _records(tmp_path / "ref") if r["phase"] == "grpo"]
    assert len(grpo) == 4 and all(r["replay_verified"] == 1.0 for r in grpo)
    assert _records(tmp_path / "ref") == _records(tmp_path / "cut")
    ref, cut = checkpoints(tmp_path / "ref"), checkpoints(tmp_path / "cut")
    assert sorted(ref) == sorted(cut) == [3, 6]
    assert_bit_equal(ref[6]["state"], cut[6]["state"])
    assert ref[6]["meta"] == cut[6]["meta"]
    for part in ("params", "opt_grpo"):  # GRPO moved them after the restored checkpoint
        assert not bits_equal(ref[3]["state"][part], ref[6]["state"][part]), part
