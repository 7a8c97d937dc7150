"""Weights & Biases mirroring of `MetricsLogger`, run offline and read back from W&B's own log.

W&B writes an offline run as `wandb/offline-run-*/run-ID.wandb`: a LevelDB-style log
(32 KiB blocks of records, each a 7-byte header: CRC-32C, length, fragment kind) of
`wandb.proto.wandb_internal_pb2.Record` messages after a 7-byte file header. The SDK
no longer ships a Python reader for it (its `DataStore` went with the Go core), so
`_read_wandb` below reads it: the run record (id, name, project, config) and the
history rows (step and values) are what `wandb sync` would upload.
"""

import json
import os
import struct
import sys
from pathlib import Path

import pytest

from jaxrl_lp.train.logger import MetricsLogger, WandbSettings

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402 - after the skip

_BLOCK, _HEADER = 32768, 7  # the log's block size and record header size
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _read_wandb(path):
    """The `Record` messages of a `.wandb` file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:_HEADER]
    pos, parts, out = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if n == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + _HEADER:pos + _HEADER + n], pos + _HEADER + n
        parts = chunk if kind in (_FULL, _FIRST) else parts + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def _segments(run_dir):
    """Each start's offline run, in start order: (run record, [(step, {key: value})])."""
    # `run.finish()` returns before W&B's service has flushed the run's file; its teardown
    # waits for every run of this process to be written.
    wandb.teardown()
    out = []
    for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        records = _read_wandb(path)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        # A key with "/" is stored as its parts (`nested_key`); W&B's own ones start with "_".
        rows = [(r.history.step.num, {k: json.loads(i.value_json) for i in r.history.item
                                      if not (k := i.key or "/".join(i.nested_key)).startswith("_")})
                for r in records if r.WhichOneof("record_type") == "history"]
        out.append((run.start_time.ToNanoseconds(), path.parent.name, run, rows))
    return [(run, rows) for _, _, run, rows in sorted(out, key=lambda s: s[:2])]


def _wandb_children():
    """Pids of this process's W&B service processes still running (from Linux's /proc)."""
    me, out = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...", and a process may end while being read
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == me and state != "Z" and b"wandb" in cmd:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline, silent, its folders under tmp_path, no credentials; its service ended after."""
    home = tmp_path / "home"
    home.mkdir()
    for var, sub in (("WANDB_DIR", "env_dir"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc: nothing can log in
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    wandb.teardown()
    assert _wandb_children() == []


def _settings(**kw):
    kw = {"project": "jaxrl-lp-test", "mode": "offline",
          "config": {"run": {"seed": 3}, "grpo": {"steps": 6, "lr": 1e-5}}} | kw
    return WandbSettings(**kw)


def _log_steps(logger, steps, tag=0.0):
    """One grpo record per step, an eval record on even steps (the trainer's pattern)."""
    for s in steps:
        logger.log(s, "grpo", {"reward_mean": s / 10 + tag, "timing_s/sample": 1.0 + tag})
        if s % 2 == 0:
            logger.log(s, "eval", {"accuracy": s / 100})


def test_offline_run_holds_config_metrics_and_steps(offline, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = MetricsLogger(run_dir, wandb=_settings(run_name="my-run"))
    logger.log(1, "sft", {"loss": 2.5})
    logger.log(2, "grpo", {"reward_mean": 0.25, "mismatch_k3": float("nan")})
    logger.log(2, "eval", {"accuracy": 0.5})
    wandb_run = logger.wandb_run
    logger.close()
    with pytest.raises(wandb.errors.UsageError, match="is finished"):  # close() finished it
        wandb_run.log({"late": 1.0})
    logger.close()  # twice: nothing more to do

    [(run, rows)] = _segments(run_dir)  # under the run directory, whatever WANDB_DIR says
    assert run.run_id == (run_dir / "wandb_id").read_text().strip()
    assert (run.display_name, run.project) == ("my-run", "jaxrl-lp-test")
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == {"run": {"seed": 3}, "grpo": {"steps": 6, "lr": 1e-5}}
    # One row per step; a step's phases share it; the non-finite value is left out, as in tb/.
    assert rows == [(1, {"sft/loss": 2.5}), (2, {"grpo/reward_mean": 0.25, "eval/accuracy": 0.5})]
    # metrics.jsonl and TensorBoard as before.
    assert [(r["step"], r["phase"]) for r in logger.records()] == [(1, "sft"), (2, "grpo"), (2, "eval")]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


def test_resume_keeps_one_point_per_step(offline, tmp_path):
    """Killed after step 5 with its checkpoint at step 3, then resumed twice: W&B holds each step
    once, in one run, and never a step at or below one it has (which online W&B would drop)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = MetricsLogger(run_dir, wandb=_settings())
    _log_steps(logger, range(1, 4))
    at_checkpoint = logger.lines
    _log_steps(logger, range(4, 6))  # past the checkpoint: redone by the resumed run
    logger.close()  # (a kill: W&B has what was logged)

    logger = MetricsLogger(run_dir, keep_records=at_checkpoint, wandb=_settings())
    _log_steps(logger, range(4, 8), tag=1000.0)  # 4 and 5 again (new wall-clock figures), then new
    logger.close()
    logger = MetricsLogger(run_dir, keep_records=logger.lines, wandb=_settings())
    _log_steps(logger, range(8, 9), tag=2000.0)
    logger.close()

    segments = _segments(run_dir)
    assert len(segments) == 3
    assert len({run.run_id for run, _ in segments}) == 1
    steps = [s for _, rows in segments for s, _ in rows]
    assert steps == list(range(1, 9))  # each once, increasing across the segments
    by_step = {s: row for _, rows in segments for s, row in rows}
    assert by_step[5] == {"grpo/reward_mean": 0.5, "grpo/timing_s/sample": 1.0}  # the first run's
    assert by_step[6] == {"grpo/reward_mean": 1000.6, "grpo/timing_s/sample": 1001.0,
                          "eval/accuracy": 0.06}
    assert [(s, sorted(r)) for s, r in by_step.items() if s in (7, 8)] == [
        (7, ["grpo/reward_mean", "grpo/timing_s/sample"]),
        (8, ["eval/accuracy", "grpo/reward_mean", "grpo/timing_s/sample"])]
    # metrics.jsonl: the redone records replace the cut ones, as without W&B.
    assert [(r["step"], r["phase"]) for r in logger.records()].count((5, "grpo")) == 1


def test_wandb_asked_for_on_resume_gets_the_kept_records(offline, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = MetricsLogger(run_dir)  # no W&B
    _log_steps(logger, range(1, 4))
    at_checkpoint = logger.lines
    _log_steps(logger, range(4, 6))
    logger.close()
    logger = MetricsLogger(run_dir, keep_records=at_checkpoint, wandb=_settings())
    _log_steps(logger, range(4, 6), tag=1000.0)
    logger.close()
    [(_, rows)] = _segments(run_dir)
    assert [s for s, _ in rows] == [1, 2, 3, 4, 5]
    assert rows[3][1]["grpo/reward_mean"] == 1000.4  # never sent before: the resumed run's


def test_other_processes_start_no_wandb_run(offline, tmp_path):
    logger = MetricsLogger(tmp_path, write=False, wandb=_settings())
    logger.log(1, "sft", {"loss": 1.0})
    logger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "config", "data", "env_dir", "home"]


def test_disabled_mode_logs_to_files_only(offline, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = MetricsLogger(run_dir, wandb=_settings(mode="disabled"))
    logger.log(1, "sft", {"loss": 1.0})
    logger.close()
    assert not (run_dir / "wandb").exists() and len(logger.records()) == 1


def test_missing_wandb_is_one_line_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'jaxrl-lp\[wandb\]'") as e:
        MetricsLogger(tmp_path, wandb=_settings())
    assert "\n" not in str(e.value) and "run.wandb" in str(e.value)
    assert list(tmp_path.iterdir()) == []
    MetricsLogger(tmp_path).close()  # without W&B, wandb is never imported


def test_wandb_is_imported_only_when_asked_for():
    """No module-level `import wandb` (an extra): the name is bound only inside a W&B start."""
    import jaxrl_lp.train.logger as logger_module

    assert not hasattr(logger_module, "wandb")


def test_online_without_login_is_one_line_and_writes_nothing(offline, monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ValueError, match="run.wandb_mode=offline") as e:
        MetricsLogger(run_dir, wandb=_settings(mode="online"))
    assert "\n" not in str(e.value) and "wandb login" in str(e.value)
    assert list(run_dir.iterdir()) == []


@pytest.mark.parametrize("kw, key", [({"mode": "cloud"}, "run.wandb_mode"),
                                     ({"project": "a/b"}, "run.wandb_project"),
                                     ({"project": ""}, "run.wandb_project")])
def test_bad_settings_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key) as e:
        _settings(**kw)
    assert "\n" not in str(e.value)


def test_a_training_run_logs_its_config_and_metrics_to_wandb(offline, tmp_path):
    """`jaxrl-lp train --set run.wandb=true --set run.wandb_mode=offline`: the run's config
    and every step's metrics in W&B, one point per step; no config.json before W&B starts."""
    from helpers import sets, short_run

    from jaxrl_lp.cli.main import main as cli_main

    run = tmp_path / "run"
    args = sets(*short_run(sft_steps=2, grpo_steps=2), "grpo.verify_every=1",
                "run.wandb=true", "run.wandb_mode=offline", "run.wandb_project=my-task",
                f"run.out_dir={run}")
    assert cli_main(["train", *args]) == 0
    (record, rows), = _segments(run)
    assert record.project == "my-task"
    config = {item.key: json.loads(item.value_json) for item in record.config.update}
    assert config["grpo"]["steps"] == 2 and config["run"]["wandb_mode"] == "offline"
    steps = [step for step, _ in rows]
    assert steps == sorted(set(steps)) and steps[-1] == 4
    grpo = [values for step, values in rows if "grpo/reward_mean" in values]
    assert len(grpo) == 2 and all("grpo/replay_verified" in v for v in grpo)


def test_run_wandb_without_the_package_is_refused_before_anything_is_written(monkeypatch,
                                                                               tmp_path, capsys):
    from helpers import sets, short_run

    from jaxrl_lp.cli.main import main as cli_main

    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    assert cli_main(["train", *sets(*short_run(), "run.wandb=true", f"run.out_dir={run}")]) == 2
    assert "pip install 'jaxrl-lp[wandb]'" in capsys.readouterr().err
    assert not run.exists()
