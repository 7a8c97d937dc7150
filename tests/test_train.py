"""The training program: exact resume after SIGKILL, non-finite steps, bad input, CLI errors."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import FAIR_CAST, FINISHED, FINISHED_STEPS, sets, short_run

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.train import NonFiniteError, apply_overrides, default_config, run_train
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.logger import without_wall_clock

# A run small enough to compile and finish in seconds on 2 cores.
SHORT = short_run()


def _cfg(tmp_path, *extra):
    return apply_overrides(default_config(), [*SHORT, f"run.out_dir={tmp_path}", *extra])


def _records(run_dir):
    """metrics.jsonl without its wall-clock figures."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [without_wall_clock(r) for r in recs]


def _final_params(run_dir):
    ckpt = Checkpointer(run_dir)
    step = ckpt.latest_step()
    restored = ckpt.manager.restore(step)
    ckpt.close()
    return step, restored["state"]["params"]


def test_sigkill_and_resume_is_bit_identical(tmp_path, finished_runs):
    """A Fair Cast run (the exporter's error-feedback residual must survive the kill too)."""
    ref_dir, summary = finished_runs["fair"]
    cut_dir = tmp_path / "cut"
    assert summary["steps"] == FINISHED_STEPS
    # The same run in a subprocess, killed with SIGKILL once a mid-run checkpoint exists.
    args = [sys.executable, "-m", "jaxrl_lp.cli.main", "train",
            *sets(*FINISHED, *FAIR_CAST, f"run.out_dir={cut_dir}")]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    ckpts = cut_dir / "checkpoints"
    rs = np.random.RandomState(0)
    target = int(rs.choice([2, 4, 6]))  # a random point: after the 1st, 2nd or 3rd checkpoint
    while time.time() < deadline and proc.poll() is None:
        done = [p for p in ckpts.glob("*") if p.name.isdigit()] if ckpts.exists() else []
        if any(int(p.name) >= target for p in done):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step_killed = Checkpointer(cut_dir).latest_step()
    assert step_killed is not None and step_killed < FINISHED_STEPS, "the kill should land mid-run"
    # The resume runs in a fresh process too, as a user's would. (In-process, late in a long
    # test session, XLA CPU segfaulted (every time) deserializing this run's programs from the
    # persistent compilation cache; a fresh process reads the same entries cleanly.)
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, timeout=600)
    resumed = json.loads((cut_dir / "summary.json").read_text())
    assert resumed["steps"] == FINISHED_STEPS
    _, p_ref = _final_params(ref_dir)
    _, p_cut = _final_params(cut_dir)
    jax.tree.map(np.testing.assert_array_equal, p_ref, p_cut)
    assert resumed["final_accuracy"] == summary["final_accuracy"]
    # One record per step and phase across the kill: the records the killed run wrote past
    # its last checkpoint were dropped and redone, so the log equals the uninterrupted one's.
    assert _records(cut_dir) == _records(ref_dir)
    for name in ("metrics.jsonl", "summary.json", "sft_loss.png", "reward.png", "accuracy.png",
                 "mismatch.png", "timing.png"):
        assert (ref_dir / name).exists(), name
    assert list((ref_dir / "tb").glob("events.*"))
    s = json.loads((ref_dir / "summary.json").read_text())
    assert {"initial_accuracy", "final_accuracy", "steps", "wall_seconds"} <= set(s)
    assert 0.0 <= s["final_accuracy_served"] <= 1.0  # the bf16 served copy, scored apart
    # Matched policies, loss on the served copy: the learner takes the sampler's recorded
    # log-probs, and where it replays them (the first GRPO step, `grpo.verify_every`) they
    # are the sampler's exactly; the checks pass.
    grpo = [r for r in _records(ref_dir) if r["phase"] == "grpo"]
    assert len(grpo) == 6
    measured = [r for r in grpo if r["behaviour_recomputed"] == 1.0]
    assert measured == grpo[:1] and measured[0]["replay_verified"] == 1.0
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 for r in measured)
    checked = [r for r in grpo if "sync/probe_logprobs" in r]
    assert checked and all(r[k] == 1.0 for r in checked for k in r if k.startswith("sync/"))


def test_warm_start_resumes_with_another_exporter_but_a_grpo_run_does_not(tmp_path):
    run_train(_cfg(tmp_path), stop_after=6)  # the warm-start (sft.steps=6), exporter none
    assert Checkpointer(tmp_path).latest_meta()["sync"]["exporter"] == "none"
    summary = run_train(_cfg(tmp_path, "sync.exporter=bf16:stochastic"), stop_after=8)
    assert summary["steps"] == 8
    assert Checkpointer(tmp_path).latest_meta()["sync"]["exporter"] == "bf16:stochastic"
    with pytest.raises(ValueError, match=r"has done GRPO steps with "
                                         r"sync.exporter=bf16:stochastic.*--set sync.exporter="):
        run_train(_cfg(tmp_path, "sync.exporter=bf16:nearest"))


def test_nonfinite_steps_are_skipped_and_stop_the_run(tmp_path, monkeypatch):
    # A learning rate of inf makes every update non-finite from the first GRPO step. The
    # config refuses grpo.lr=inf, so the GRPO optimizer is patched to use it.
    import importlib

    import optax

    from jaxrl_lp.train.optimizers import make_optimizers

    validate = importlib.import_module("jaxrl_lp.train.validate")  # the module, not the function
    monkeypatch.setattr(validate, "make_optimizers", lambda cfg: (
        make_optimizers(cfg)[0], optax.chain(optax.clip_by_global_norm(1.0),
                                             optax.adam(float("inf")))))
    cfg = _cfg(tmp_path, "sft.steps=0", "grpo.max_nonfinite_in_row=2")
    with pytest.raises(NonFiniteError, match="2 steps in a row"):
        run_train(cfg)
    step, params = _final_params(tmp_path)
    assert step == 2
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_checkpoint_from_a_different_model_is_refused(tmp_path):
    run_train(_cfg(tmp_path, "grpo.steps=0", "sft.steps=2"))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match="different model"):
        run_train(_cfg(tmp_path, "grpo.steps=0", "sft.steps=4", "model.hidden_size=48"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["grpo.group_size=1"], "group of 1 has no signal"),
        (["grpo.nonsense=3"], "unknown config key 'grpo.nonsense'"),
        (["grpo.logprobs=magic"], "allowed values"),
        (["sft.steps=many"], "sft.steps=many"),
        (["task.kind=gsm8k", "task.path=/nonexistent/gsm8k.jsonl", "init_from=/nonexistent"],
         "nonexistent"),
    ],
)
def test_bad_input_gives_a_clear_error_and_nonzero_exit(tmp_path, capsys, overrides, message):
    args = ["train"]
    for o in [f"run.out_dir={tmp_path / 'run'}", *overrides]:
        args += ["--set", o]
    assert cli_main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written


def test_empty_and_malformed_dataset_name_the_problem(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"\n')
    hf = tmp_path / "hf"
    hf.mkdir()
    for path, message in ((empty, "no examples"), (bad, "line 2")):
        args = ["train", "--set", f"run.out_dir={tmp_path / 'run'}", "--set", "task.kind=gsm8k",
                "--set", f"task.path={path}", "--set", f"init_from={hf}"]
        assert cli_main(args) == 2
        assert message in capsys.readouterr().err


def test_config_file_and_unknown_file(tmp_path, capsys):
    assert cli_main(["train", "--config", str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    root = Path(__file__).resolve().parents[1]
    from jaxrl_lp.train import load_config

    assert load_config(str(root / "configs" / "default.py")) == default_config()


def test_gsm8k_run_from_a_hugging_face_checkpoint(tmp_path):
    """task.kind=gsm8k trains end to end from an init_from directory with its tokenizer."""
    from jaxrl_lp.models import get_preset, init_params
    from jaxrl_lp.models.hf_io import save_hf_checkpoint
    from jaxrl_lp.models.tokenizer import CharTokenizer

    tok = CharTokenizer()
    ckpt = tmp_path / "hf"
    mcfg = get_preset("tiny-qwen3").replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                            eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    save_hf_checkpoint(ckpt, mcfg, init_params(mcfg, jax.random.PRNGKey(0)))
    tok.save(ckpt)
    rs = np.random.RandomState(0)
    data = tmp_path / "gsm8k.jsonl"
    with data.open("w") as f:
        for a, b in rs.randint(0, 50, (40, 2)):
            f.write(json.dumps({"question": f"What is {a} plus {b}?",
                                "answer": f"{a}+{b}={a + b}\n#### {a + b}"}) + "\n")
    cfg = apply_overrides(default_config(), [
        "task.kind=gsm8k", f"task.path={data}", f"init_from={ckpt}", "sft.steps=1",
        "sft.batch_size=4", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
        "grpo.max_new_tokens=6", "run.eval_size=2", "run.progress=false",
        "grpo.verify_every=1", f"run.out_dir={tmp_path / 'run'}"])
    summary = run_train(cfg)
    assert summary["steps"] == 3 and 0.0 <= summary["final_accuracy"] <= 1.0
    grpo = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in grpo if r["phase"] == "grpo"]
    assert len(grpo) == 2 and all(0.0 <= r["reward_mean"] <= 1.0 for r in grpo)
    # Matched, hybrid, every step verified: the replay is the sampler's bits.
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 and r["replay_verified"] == 1.0 for r in grpo)
