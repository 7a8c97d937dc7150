"""The training program: exact resume after SIGKILL, non-finite steps, bad input, CLI errors."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    FAIR_CAST,
    FINISHED,
    FINISHED_STEPS,
    GRPO_MOVES,
    assert_bit_equal,
    checkpoints,
    sets,
    short_run,
)

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


# `jaxrl-lp train` in a subprocess that SIGKILLs itself at a named moment (argv: the moment,
# its step or update, then the command's arguments): the in-process patches of
# test_preemption.py, with a signal nothing can catch, at moments a signal from outside
# would hit only by chance.
#   after_save N:    checkpoint N is written (finalized), nothing after it has run.
#   before_update N: the N-th GRPO update is about to run: its export, rollout, behaviour
#                    log-probs and sync diagnostics are done (the exporter state has moved
#                    past the newest checkpoint), the optimizer update is not.
#   in_save N:       checkpoint N is written to its temporary directory, not yet renamed.
KILLED_AT = r"""
import os, signal, sys

moment, at = sys.argv[1], int(sys.argv[2])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if moment == "after_save":
    from jaxrl_lp.train.checkpoint import Checkpointer

    save = Checkpointer.save

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        if step == at and self.dir.name == "checkpoints":
            die()

    Checkpointer.save = save_then_die
elif moment == "before_update":
    import jaxrl_lp.train.program as program

    make = program.make_grpo_step

    def make_dying(*args, **kwargs):
        grpo_step, calls = make(*args, **kwargs), [0]

        def dying(*a):
            calls[0] += 1
            if calls[0] == at:
                die()
            return grpo_step(*a)

        return dying

    program.make_grpo_step = make_dying
elif moment == "in_save":
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def die_before_rename(self):
        if self.get_final().name == str(at) and self.get_final().parent.name == "checkpoints":
            die()
        await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = die_before_rename
else:
    raise SystemExit(f"unknown moment {moment!r}")
from jaxrl_lp.cli.main import main

sys.exit(main(sys.argv[3:]))
"""


def _kill_and_resume(cut_dir, overrides, moment, at):
    """Runs `overrides` into `cut_dir` killed at `moment` `at` (`KILLED_AT`), checks where the
    kill landed, resumes it in a fresh process (as a user would) and returns the newest
    checkpoint step the kill left."""
    args = ["train", *sets(*overrides, f"run.out_dir={cut_dir}")]
    out = subprocess.run([sys.executable, "-c", KILLED_AT, moment, str(at), *args],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    ckpt = Checkpointer(cut_dir)
    killed_at, meta = ckpt.latest_step(), ckpt.latest_meta()
    ckpt.close()
    sft_steps = FINISHED_STEPS - 6
    if moment == "after_save":
        assert killed_at == at
    elif moment == "before_update":  # the update of step sft + N; the one before it logged
        assert killed_at == sft_steps + at - 2 and killed_at % 2 == 0
        logged = (cut_dir / "metrics.jsonl").read_text().splitlines()
        assert len(logged) > meta["metrics_records"], "records past the checkpoint to drop"
        assert json.loads(logged[-1])["step"] == sft_steps + at - 1
    else:  # in_save: the step's temporary directory is there, the previous step is the newest
        assert killed_at == at - 2
        assert list((cut_dir / "checkpoints").glob(f"{at}.orbax-checkpoint-tmp*"))
    assert sft_steps <= killed_at < FINISHED_STEPS, "the kill should land inside GRPO"
    # In-process, late in a long test session, XLA CPU segfaulted (every time) deserializing
    # this run's programs from the persistent compilation cache; a fresh process reads the
    # same entries cleanly.
    subprocess.run([sys.executable, "-m", "jaxrl_lp.cli.main", *args], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    return killed_at


def _assert_resumed_exactly(cut_dir, ref_dir):
    """The resumed run's kept checkpoints (6 and 8) equal the uninterrupted run's, state and
    meta: params, both optimizer states, the exporter's state (residual, export count) and
    diagnostics, both data iterators, the metrics record count; and so do its records."""
    cut, ref = checkpoints(cut_dir), checkpoints(ref_dir)
    assert sorted(cut) == sorted(ref) == [FINISHED_STEPS - 2, FINISHED_STEPS]
    for step in ref:
        assert cut[step]["meta"] == ref[step]["meta"], step
        assert_bit_equal(cut[step]["state"], ref[step]["state"])
    # The state a resume restores had moved inside GRPO (else restoring the warm-start's
    # would pass): the params and both of Adam's moments between steps 6 and 8.
    moved = lambda a, b: any(np.asarray(x).tobytes() != np.asarray(y).tobytes()
                             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    six, eight = (ref[s]["state"] for s in sorted(ref))
    assert moved(six["params"], eight["params"])
    assert moved(six["opt_grpo"], eight["opt_grpo"])
    assert six["sync"]["exporter"]["count"] == 4 and eight["sync"]["exporter"]["count"] == 6
    # One record per step and phase across the kill: the records the killed run wrote past
    # its last checkpoint were dropped and redone, so the log equals the uninterrupted one's.
    assert _records(cut_dir) == _records(ref_dir)


@pytest.mark.slow
def test_sigkill_between_export_and_update_resumes_bit_identically(tmp_path, finished_runs):
    """Fair Cast (bf16 error feedback, the loss on the served copy), killed before the 4th
    GRPO update: its export has moved the residual past checkpoint 4, which must not count."""
    ref_dir, summary = finished_runs["fair"]
    cut_dir = tmp_path / "cut"
    assert summary["steps"] == FINISHED_STEPS
    killed_at = _kill_and_resume(cut_dir, [*FINISHED, *FAIR_CAST, *GRPO_MOVES],
                                 "before_update", 4)
    assert killed_at == 4
    resumed = json.loads((cut_dir / "summary.json").read_text())
    assert resumed["steps"] == FINISHED_STEPS
    assert resumed["final_accuracy"] == summary["final_accuracy"]
    _assert_resumed_exactly(cut_dir, ref_dir)
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
    assert all(r["grad_norm"] > 0 for r in grpo)  # GRPO_MOVES
    measured = [r for r in grpo if r["behaviour_recomputed"] == 1.0]
    assert measured == grpo[:1] and measured[0]["replay_verified"] == 1.0
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 for r in measured)
    checked = [r for r in grpo if "sync/probe_logprobs" in r]
    assert checked and all(r[k] == 1.0 for r in checked for k in r if k.startswith("sync/"))


STOCHASTIC = ["sync.exporter=bf16:stochastic", "sync.loss_on_served=true", "sync.check_every=2"]


@pytest.fixture(scope="module")
def stochastic_run(tmp_path_factory):
    """An uninterrupted run of FINISHED with a bf16 stochastic-rounding exporter (keys from
    its export count), the loss on the served copy."""
    run = tmp_path_factory.mktemp("stochastic") / "run"
    run_train(apply_overrides(default_config(), [*FINISHED, *STOCHASTIC, *GRPO_MOVES,
                                                 f"run.out_dir={run}"]))
    return run


@pytest.mark.slow
@pytest.mark.parametrize("exporter,moment,at", [
    pytest.param("error_feedback", "after_save", 6, marks=pytest.mark.ci),  # CI's one cell
    ("error_feedback", "in_save", 6),
    ("stochastic", "before_update", 4),
    ("stochastic", "after_save", 4),
    ("stochastic", "in_save", 6),
])
def test_sigkill_inside_grpo_resumes_bit_identically(tmp_path, exporter, moment, at,
                                                     request):
    if exporter == "error_feedback":
        ref_dir, sync = request.getfixturevalue("finished_runs")["fair"][0], FAIR_CAST
    else:
        ref_dir, sync = request.getfixturevalue("stochastic_run"), STOCHASTIC
    _kill_and_resume(tmp_path / "cut", [*FINISHED, *sync, *GRPO_MOVES], moment, at)
    _assert_resumed_exactly(tmp_path / "cut", ref_dir)


@pytest.mark.slow
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
