"""XLA's GPU flags as a run setting (`run.xla_gpu_flags`, `jaxrl_lp.xla_flags`).

A preset's flags reach `XLA_FLAGS` before JAX's backend starts, XLA knows every one
of them (an unknown flag aborts the process: the CPU backend reads the same flag
table as the GPU's), a bad value is one line naming the key, and a preset that
could no longer take effect (the backend started) is refused, not dropped.
"""

import os
import subprocess
import sys

import jax
import pytest

from jaxrl_lp.train import apply_overrides, default_config
from jaxrl_lp.xla_flags import PRESETS, apply, flags_for, parse


def test_presets_parse_and_combine():
    assert parse("none") == ("none",) and flags_for(parse("none")) == ()
    assert parse("decode_graphs, scheduler") == ("decode_graphs", "scheduler")
    assert flags_for(parse("decode_graphs")) == (
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        "--xla_gpu_command_buffer_unroll_loops=true")
    for bad, says in (("graphs", "unknown preset 'graphs'"), ("", "unknown preset ''"),
                      ("none,scheduler", "'none' adds no flag"),
                      ("scheduler,scheduler", "names a preset twice"), (3, "must be a string")):
        with pytest.raises(ValueError, match="run.xla_gpu_flags") as e:
            parse(bad)
        assert says in str(e.value) and "\n" not in str(e.value)


def test_apply_appends_once_and_refuses_a_conflict():
    env = {"XLA_FLAGS": "--xla_allow_excess_precision=false"}
    got = apply(parse("decode_graphs"), environ=env)
    assert got == env["XLA_FLAGS"] == ("--xla_allow_excess_precision=false "
                                       + " ".join(PRESETS["decode_graphs"]))
    assert apply(parse("decode_graphs"), environ=env) == got  # already there: unchanged
    env = {"XLA_FLAGS": "--xla_gpu_command_buffer_unroll_loops=false"}
    with pytest.raises(ValueError, match="already sets --xla_gpu_command_buffer_unroll_loops"
                                         "=false, the preset sets"):
        apply(parse("decode_graphs"), environ=env)
    assert apply(parse("none"), environ={}) == ""


def test_a_preset_after_the_backend_started_is_refused_in_one_line():
    jax.devices()  # this process's backend has started
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(ValueError) as e:
        apply(parse("scheduler"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("run.xla_gpu_flags=scheduler cannot apply")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in msg
    assert os.environ.get("XLA_FLAGS") == before
    apply(parse("none"))  # nothing to add: never refused


@pytest.mark.parametrize("presets", ["decode_graphs,scheduler"])
def test_the_flags_reach_xla_before_the_backend_and_xla_knows_them(presets):
    code = ("import os, jax, jax.numpy as jnp\n"
            "from jaxrl_lp.xla_flags import apply, parse\n"
            f"apply(parse({presets!r}))\n"
            "jnp.ones(3).sum().block_until_ready()\n"  # the backend starts, reading XLA_FLAGS
            "print(os.environ['XLA_FLAGS'])\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    flags = res.stdout.split()
    assert "--xla_allow_excess_precision=false" in flags  # the package's own, kept
    assert set(flags_for(parse(presets))) <= set(flags)
    # The plant: a flag XLA does not know aborts the process at the same point.
    bad = code.replace(f"apply(parse({presets!r}))",
                       "os.environ['XLA_FLAGS'] += ' --xla_gpu_enable_command_bufferz=+WHILE'")
    res = subprocess.run([sys.executable, "-c", bad], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0 and "Unknown flag" in res.stderr


def test_run_train_applies_the_key_before_anything_starts(monkeypatch, tmp_path):
    import jaxrl_lp.train.program as program

    seen = []

    class Stop(Exception):
        pass

    def initialize(_):
        raise Stop

    monkeypatch.setattr(program, "apply_xla_gpu_flags", lambda presets: seen.append(presets))
    monkeypatch.setattr(program, "initialize", initialize)
    cfg = apply_overrides(default_config(), [f"run.out_dir={tmp_path / 'run'}",
                                             "run.xla_gpu_flags=decode_graphs,scheduler"])
    with pytest.raises(Stop):
        program.run_train(cfg)
    assert seen == [("decode_graphs", "scheduler")]
    assert not (tmp_path / "run").exists()
