"""Two processes on this machine (jax.distributed over localhost, 4 CPU devices each).

They run the same `jaxrl-lp train` on an `fsdp=8` mesh that spans both, and end
with the parameters of one process with 8 devices; a SIGKILL of one process and
a restart of both resumes bit-identically; a SIGTERM to either process stops both
after the same step with a checkpoint, and the resumed run ends bit-identical.
They compile the run's programs in two more processes (minutes on 2 cores) and
run in the slow tier (`-m slow`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import FAIR_CAST, GRPO_MOVES, assert_bit_equal, bits_equal, checkpoints, sets, short_run

from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.checkpoint import Checkpointer

# 2 warm-start and 3 GRPO steps; 8 prompts and 16 warm-start rows split over 8 data shards;
# Fair Cast (the loss on a bf16 error-feedback served copy) and a KL term to the GRPO start,
# so the GRPO steps move the state (their rewards are 0 after 2 warm-start steps: without it
# the parameters at step 5 were step 2's bit for bit).
RUN = [*short_run(sft_steps=2, grpo_steps=3), *FAIR_CAST, *GRPO_MOVES, "grpo.verify_every=1",
       "grpo.prompts_per_step=8", "sft.batch_size=16", "run.mesh=fsdp=8",
       "run.checkpoint_every=1", "run.keep_checkpoints=5"]
STEPS = 5
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


# 4 CPU devices a process. A collective whose participants have not all arrived says so in
# the log after 120 s and fails after 480 s (the gloo exchange across the processes too),
# naming itself, within `_wait`'s 600 s: a hang in a collective ends the run with its name.
_XLA_FLAGS = ("--xla_force_host_platform_device_count=4 "
              "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120 "
              "--xla_cpu_collective_call_terminate_timeout_seconds=480 "
              "--xla_cpu_collective_timeout_seconds=480")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(run_dir: Path, port: int, log_dir: Path, *extra: str,
           signal_at: str | None = None) -> list[subprocess.Popen]:
    """Both processes of the run; with `signal_at` one of them sends itself SIGTERM at that
    moment (`_SIGNAL_AT`), the plain command line otherwise."""
    env = dict(os.environ, XLA_FLAGS=_XLA_FLAGS, JAX_PLATFORMS="cpu")
    entry = ["-c", _PLAIN] if signal_at is None else ["-c", _SIGNAL_AT, signal_at]
    procs = []
    for i in range(2):
        args = [sys.executable, *entry, "train",
                *sets(*RUN, f"run.out_dir={run_dir}", f"distributed.coordinator=127.0.0.1:{port}",
                      "distributed.num_processes=2", f"distributed.process_id={i}",
                      "distributed.timeout_s=120", *extra)]
        log = (log_dir / f"process{i}.log").open("a")
        procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


# `python -c _PLAIN train ...` is `jaxrl-lp train ...` that prints every thread's stack on
# SIGUSR1, which `_wait` sends before it kills a process that outlived its timeout.
_STACKS_ON_SIGUSR1 = """
import faulthandler, signal
faulthandler.register(signal.SIGUSR1)
"""
_PLAIN = _STACKS_ON_SIGUSR1 + """
import sys
from jaxrl_lp.cli.main import main
sys.exit(main(sys.argv[1:]))
"""

# `python -c _SIGNAL_AT MOMENT train ...` is `jaxrl-lp train ...` in which, at MOMENT, one
# process sends itself SIGTERM (as tests/test_preemption.py does in one process):
# `log:S`, process 0 once it has logged step S's record; `save:S`, process 1 as its
# checkpoint save of step S begins.
_SIGNAL_AT = _STACKS_ON_SIGUSR1 + """
import os, signal, sys
import jax
from jaxrl_lp.cli.main import main
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.logger import MetricsLogger
where, at = sys.argv.pop(1).split(":")
at, log, save = int(at), MetricsLogger.log, Checkpointer.save
def log_then_signal(self, step, phase, metrics):
    log(self, step, phase, metrics)
    if where == "log" and step == at and phase != "eval" and jax.process_index() == 0:
        os.kill(os.getpid(), signal.SIGTERM)
def signal_inside_save(self, step, state, meta):
    if where == "save" and step == at and jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    save(self, step, state, meta)
MetricsLogger.log, Checkpointer.save = log_then_signal, signal_inside_save
sys.exit(main(sys.argv[1:]))
"""


def _wait(procs, log_dir: Path, timeout: float = 600) -> list[int]:
    """The processes' exit codes; a process still running after `timeout` seconds fails the
    test with the logs, which end with every thread's stack at that moment."""
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(5)
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"the processes did not exit within {timeout:.0f} s (exit codes "
                    f"{[p.returncode for p in procs]}); their logs:\n{_logs(log_dir)}\n"
                    f"{_main_stacks(log_dir)}")
    return [p.returncode for p in procs]


def _main_stacks(log_dir: Path, frames: int = 12) -> str:
    """Each process's main-thread stack (the thread whose outermost frame is the module's) at
    its last faulthandler dump, innermost frames first, at most `frames` of them: the end of
    a failure message, which a CI excerpt that elides the middle of long output still shows."""
    out = ["== main-thread stacks at the timeout (innermost first)"]
    for log in sorted(log_dir.glob("*.log")):
        stacks, stack = [], None
        for x in log.read_text().splitlines():
            if x.startswith(("Current thread 0x", "Thread 0x")):
                stack = []
                stacks.append(stack)
            elif stack is not None and x.startswith("  File "):
                stack.append(x.strip())
            else:
                stack = None
        main = [st for st in stacks if st and st[-1].endswith("in <module>")]
        out.append(f"{log.name}:" if main else f"{log.name}: no faulthandler dump")
        out.extend(f"  {x}" for x in (main[-1][:frames] if main else []))
    return "\n".join(out)


def _params(run_dir: Path, step: int = STEPS):
    ckpt = Checkpointer(run_dir, create=False)
    try:
        return ckpt.restore_params(step)[0]
    finally:
        ckpt.close()


def _assert_ends_as(run: Path, whole: Path):
    """The run's last checkpoint, whole (state and meta), is `whole`'s, bit for bit."""
    got, want = checkpoints(run)[STEPS], checkpoints(whole)[STEPS]
    assert_bit_equal(got["state"], want["state"])
    assert got["meta"] == want["meta"]


def _logs(log_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-8000:]}" for p in sorted(log_dir.glob("*.log")))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same run in this (8-device) process."""
    run = tmp_path_factory.mktemp("one_process")
    summary = run_train(apply_overrides(default_config(), [*RUN, f"run.out_dir={run}"]))
    assert summary["steps"] == STEPS
    return run


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The run by two processes of 4 devices each, uninterrupted."""
    root = tmp_path_factory.mktemp("two_processes")
    run, logs = root / "run", root / "logs"
    logs.mkdir()
    assert _wait(_start(run, _port(), logs), logs) == [0, 0], _logs(logs)
    return run


# Each process compiles every program of the run (about 2 minutes on 2 cores): `-m slow`.
@pytest.mark.slow
def test_two_processes_equal_one_process_with_eight_devices(two_processes, one_process):
    # The same programs on the same mesh; the reductions that cross the two processes go
    # through gloo and may round in another order, and a 1-ulp difference in the master can
    # flip the served copy's bf16 rounding: equal to 2e-5 absolute on weights of about 0.02
    # (measured: 4.6e-6 after the GRPO steps; 1.2e-6 after the warm-start alone).
    for a, b in zip(jax.tree.leaves(_params(two_processes)), jax.tree.leaves(_params(one_process)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)
    # The GRPO steps moved the parameters and the GRPO optimizer state, in both runs.
    for run in (two_processes, one_process):
        first, last = (checkpoints(run)[s]["state"] for s in (STEPS - 2, STEPS))
        for part in ("params", "opt_grpo"):
            assert not bits_equal(first[part], last[part]), (run, part)
    # Process 0 alone wrote the run's files: one record per step and phase.
    recs = [json.loads(x) for x in (two_processes / "metrics.jsonl").read_text().splitlines()]
    assert len({(r["step"], r["phase"]) for r in recs}) == len(recs)
    assert [r["step"] for r in recs if r["phase"] == "grpo"] == [3, 4, 5]
    # Every GRPO step verified (`grpo.verify_every=1`): the replay equals the sampler.
    assert all(r["mismatch_max_abs_dlogp"] == 0.0 and r["replay_verified"] == 1.0
               for r in recs if r["phase"] == "grpo")


# By hand (`-m slow`), as the SIGTERM test below; tests/test_train.py resumes a SIGKILLed
# process at several moments (one of them in CI's slow tier).
@pytest.mark.slow
def test_sigkill_of_one_process_and_a_restart_of_both_resumes_bit_identically(tmp_path,
                                                                            two_processes):
    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    procs = _start(run, _port(), logs)
    ckpts = run / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and all(p.poll() is None for p in procs):
        done = [int(p.name) for p in ckpts.glob("*") if p.name.isdigit()] if ckpts.exists() else []
        if done and max(done) >= 3:
            break
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)  # one process dies...
    time.sleep(2)
    procs[0].send_signal(signal.SIGKILL)  # ...and the run is restarted as a whole
    _wait(procs, logs)
    killed_at = max(int(p.name) for p in ckpts.glob("*") if p.name.isdigit())
    assert killed_at < STEPS, "the kill should land mid-run"
    assert _wait(_start(run, _port(), logs), logs) == [0, 0], _logs(logs)
    _assert_ends_as(run, two_processes)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_sigterm_to_either_process_at_two_moments_stops_both_and_the_resume_is_bit_identical(
        tmp_path, two_processes):
    """A SIGTERM to one process of two, at two moments: inside process 1's checkpoint save
    of step 2 (the warm-start's last) and after GRPO step 4 (to process 0). Each time both
    processes stop after that step with 75 and its checkpoint (no cadence checkpoint
    besides the one being written: `run.checkpoint_every=100`, 1 for the save), no
    temporary directory is left, and the run resumed twice ends with the uninterrupted
    run's parameters and metric records, bit for bit. (A SIGTERM after a warm-start step
    in one process: tests/test_preemption.py.)"""
    from jaxrl_lp.train.logger import without_wall_clock
    from jaxrl_lp.train.preemption import EXIT_PREEMPTED

    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    ckpts = run / "checkpoints"
    for moment, step in (("save:2", 2), ("log:4", 4)):
        cadence = "run.checkpoint_every=" + ("1" if moment.startswith("save") else "100")
        procs = _start(run, _port(), logs, cadence, signal_at=moment)
        assert _wait(procs, logs) == [EXIT_PREEMPTED] * 2, _logs(logs)
        done = sorted(int(p.name) for p in ckpts.glob("*") if p.name.isdigit())
        assert done[-1] == step, (moment, done)
        assert not [p for p in ckpts.iterdir() if "tmp" in p.name]
        assert [r["step"] for r in _records(run)][-1] == step
    assert _wait(_start(run, _port(), logs, "run.checkpoint_every=100"), logs) == [0, 0], _logs(logs)
    _assert_ends_as(run, two_processes)
    assert [without_wall_clock(r) for r in _records(run)] == \
        [without_wall_clock(r) for r in _records(two_processes)]


def test_an_unreachable_coordinator_is_one_line_within_the_timeout(tmp_path):
    """Process 1 of a run whose coordinator (process 0) never starts."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "jaxrl_lp.cli.main", "train",
            *sets(*RUN, f"run.out_dir={tmp_path / 'run'}",
                  f"distributed.coordinator=127.0.0.1:{_port()}", "distributed.num_processes=2",
                  "distributed.process_id=1", "distributed.timeout_s=5")]
    t0 = time.time()
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.time() - t0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("jaxrl-lp")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "could not join within 5 s" in lines[0], proc.stderr[-2000:]
    assert elapsed < 60, elapsed
    assert not (tmp_path / "run").exists()
