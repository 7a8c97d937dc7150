"""SIGTERM and SIGINT stop a run with a checkpoint; the resumed run ends bit-identical.

In process, the signal is sent by the run to itself at chosen moments (a
warm-start step, a checkpoint save, a GRPO step): each stop leaves a
checkpoint of the step it reached, and the run resumed after three stops
ends with the checkpoint and metric records of the uninterrupted shared run
(`finished_runs["fair"]`, the same config: Fair Cast, whose GRPO steps move
the params, both optimizers and the exporter's residual). In a subprocess, `jaxrl-lp
train` gets a real SIGTERM: exit status 75 in seconds and one line; two
signals: it exits at once, and the newest checkpoint still resumes.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import FAIR_CAST, FINISHED, GRPO_MOVES, latest_checkpoint, sets

from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.logger import MetricsLogger, without_wall_clock
from jaxrl_lp.train.preemption import EXIT_PREEMPTED, Preempted


def _cfg(out, *extra):
    return apply_overrides(default_config(), [*FINISHED, f"run.out_dir={out}", *extra])


def _checkpoint(run_dir, step):
    """Checkpoint `step` of a run, whole: `{"state", "meta"}`."""
    ckpt = Checkpointer(run_dir)
    try:
        return ckpt.manager.restore(step)
    finally:
        ckpt.close()


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [without_wall_clock(json.loads(x)) for x in lines]


def test_signals_at_three_moments_and_the_resume_is_bit_identical(tmp_path, monkeypatch,
                                                                    finished_runs):
    run = tmp_path / "run"
    moment = {}
    log, save = MetricsLogger.log, Checkpointer.save

    def log_then_signal(self, step, phase, metrics):
        log(self, step, phase, metrics)
        if (step, phase) == moment.get("log"):
            os.kill(os.getpid(), moment["signal"])

    def signal_inside_save(self, step, state, meta):
        if step == moment.get("save"):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint is written
        save(self, step, state, meta)

    monkeypatch.setattr(MetricsLogger, "log", log_then_signal)
    monkeypatch.setattr(Checkpointer, "save", signal_inside_save)
    # FINISHED: 2 warm-start steps, 6 GRPO steps, a checkpoint every 2 steps.
    for where, stop in (({"log": (1, "sft"), "signal": signal.SIGINT}, 1),  # warm-start
                        ({"save": 4}, 4),  # during the cadence save of step 4
                        ({"log": (5, "grpo"), "signal": signal.SIGTERM}, 5)):  # in GRPO
        moment.clear()
        moment.update(where)
        with pytest.raises(Preempted, match=f"after step {stop}; its checkpoint is in"):
            run_train(_cfg(run, *FAIR_CAST, *GRPO_MOVES))
        assert latest_checkpoint(run)[0][-1] == stop  # the step the signal reached, saved
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    moment.clear()
    summary = run_train(_cfg(run, *FAIR_CAST, *GRPO_MOVES))
    fair = finished_runs["fair"][0]
    assert summary["final_accuracy"] == json.loads((fair / "summary.json").read_text())[
        "final_accuracy"]
    assert _records(run) == _records(fair)
    (s1, p1), (s2, p2) = latest_checkpoint(run), latest_checkpoint(fair)
    assert s1[-1] == s2[-1] == 8
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    end, ref_end = (_checkpoint(d, 8) for d in (run, fair))
    assert end["meta"] == ref_end["meta"]
    jax.tree.map(np.testing.assert_array_equal, end["state"], ref_end["state"])


def test_save_on_signal_false_keeps_the_usual_effect(tmp_path, monkeypatch):
    def interrupt(self, step, phase, metrics):
        raise KeyboardInterrupt  # what SIGINT does without the guard

    monkeypatch.setattr(MetricsLogger, "log", interrupt)
    # What this process had (Python's default_int_handler; SIG_IGN where the tests were
    # started in the background of a non-interactive shell): untouched by the run.
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt):
        run_train(_cfg(tmp_path / "run", "run.save_on_signal=false", "sft.steps=1"))
    assert {s: signal.getsignal(s) for s in before} == before


def _start(run_dir, steps):
    cmd = [sys.executable, "-m", "jaxrl_lp.cli.main", "train",
           *sets(*FINISHED, f"sft.steps={steps}", "grpo.steps=0", "run.checkpoint_every=1000",
                 f"run.out_dir={run_dir}")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _wait_for_records(run_dir, n, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the run did not start")


@pytest.mark.slow
@pytest.mark.ci
def test_sigterm_to_the_command_saves_and_exits_75_and_two_exit_at_once(tmp_path):
    run = tmp_path / "one"
    proc = _start(run, 4000)
    _wait_for_records(run, 20, proc)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert time.time() - t0 < 30
    assert "stopped by SIGTERM after step" in err and "run the same command to resume" in err
    step = latest_checkpoint(run)[0][-1]
    assert 20 <= step < 4000
    # Two signals: out at once (128 + 15), writing nothing; the newest checkpoint resumes.
    proc = _start(run, 4000)
    _wait_for_records(run, step + 20, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # 128 + 15: by the second signal's handler ("exiting at once"), or, when the first one's
    # save had already ended, by SIGTERM's default once the handlers are restored.
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert latest_checkpoint(run)[0][-1] >= step
    cfg = apply_overrides(default_config(), [*FINISHED, "sft.steps=4000", "grpo.steps=0",
                                             f"run.out_dir={run}"])
    assert run_train(cfg, stop_after=latest_checkpoint(run)[0][-1] + 2)["interrupted"]
