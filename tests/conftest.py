"""Test-session setup: 8 simulated CPU devices, and a persistent XLA compilation cache.

The scale-out tests lay meshes over 8 CPU devices
(`--xla_force_host_platform_device_count=8`, set before jax is imported); every
other test runs on the first device, as a single-device program.

Many tests compile the same programs (the training tests run the same short
run three times: uninterrupted, killed, resumed); a compilation cache shared
by the session and its subprocesses turns the repeats into cache hits.
"""

import fcntl
import json
import os
import shutil
import tempfile

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402 - after XLA_FLAGS
import pytest  # noqa: E402

import jaxrl_lp  # noqa: E402, F401 - adds the rounding flag to XLA_FLAGS before jax starts

_CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxrl_lp_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops the in-memory compiled programs after each test file.

    A whole session keeps hundreds of executables loaded otherwise; late in such a
    session XLA CPU segfaulted deserializing a large program from the persistent
    cache. Programs a later file needs again come back from that cache.
    """
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory):
    """Two finished short runs that the tests reading runs share (read them, or copy them).

    `plain`: no exporter; `fair`: Fair Cast (`helpers.FAIR_CAST`) with a KL term
    whose gradient moves the GRPO state (`helpers.GRPO_MOVES`). Each is a
    `(run_dir, summary)` pair of `helpers.FINISHED` (8 steps).

    Under `pytest -n` (xdist) the workers share them: the first to ask trains
    them in the session's common temporary folder, under a file lock, and the
    others wait and read them (`summary.json`, what `run_train` returned).
    """
    from helpers import FAIR_CAST, FINISHED, GRPO_MOVES

    from jaxrl_lp.train import apply_overrides, default_config, run_train

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "finished_runs"
    root.mkdir(exist_ok=True)
    runs = {}
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        for name, extra in (("plain", []), ("fair", [*FAIR_CAST, *GRPO_MOVES])):
            run = root / name
            done = root / f"{name}.finished"
            if not done.exists():  # not trained, or cut off mid-way
                shutil.rmtree(run, ignore_errors=True)
                cfg = apply_overrides(default_config(),
                                      [*FINISHED, f"run.out_dir={run}", *extra])
                run_train(cfg)
                done.touch()
            runs[name] = (run, json.loads((run / "summary.json").read_text()))
    return runs


@pytest.fixture
def tpu_interpreter(monkeypatch):
    """Interprets a kernel's tpu version with Pallas's TPU interpreter, uninitialized memory NaN:
    what a ragged block's padding may hold on a TPU (the default interpreter pads otherwise)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    call = pl.pallas_call

    def tpu_interpreted(*args, **kwargs):
        if kwargs.get("interpret") is True and isinstance(kwargs.get("compiler_params"),
                                                          pltpu.CompilerParams):
            kwargs["interpret"] = pltpu.InterpretParams(uninitialized_memory="nan")
        return call(*args, **kwargs)

    monkeypatch.setattr(pl, "pallas_call", tpu_interpreted)
