"""The run directory: one run at a time, damaged checkpoints skipped, one record per step,
a complete run left alone."""

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import FAIR_CAST, FINISHED, GRPO_MOVES, sets

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.logger import without_wall_clock
from jaxrl_lp.train.run_lock import RunLock

SHORT = FINISHED  # 8 steps, a checkpoint every 2: the session's shared `plain` run


def _cfg(run_dir, *extra):
    return apply_overrides(default_config(), [*SHORT, f"run.out_dir={run_dir}", *extra])


def _snapshot(run_dir: Path, lock: bool = True) -> dict:
    """Every file of the run directory with its size, mtime and content hash (the lock
    file, which each run rewrites with its pid, only with `lock`)."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        if p.is_file() and (lock or p.name != ".lock"):
            st = p.stat()
            out[str(p.relative_to(run_dir))] = (st.st_size, st.st_mtime_ns, hash(p.read_bytes()))
    return out


def _records(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [without_wall_clock(r) for r in recs]


def _params(run_dir: Path):
    ckpt = Checkpointer(run_dir, create=False)
    try:
        return ckpt.restore_params()[0]
    finally:
        ckpt.close()


def _checkpoint(run_dir: Path, step: int) -> dict:
    """Checkpoint `step` of a run, whole: `{"state", "meta"}`."""
    ckpt = Checkpointer(run_dir, create=False)
    try:
        return ckpt.manager.restore(step)
    finally:
        ckpt.close()


@pytest.fixture
def reference(finished_runs):
    """An uninterrupted run of SHORT."""
    return finished_runs["plain"][0]


def test_a_second_train_on_a_locked_run_exits_at_once_and_touches_nothing(tmp_path, capsys,
                                                                          reference):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    (tmp_path / "summary.json").unlink()  # a run still going
    with RunLock(tmp_path):  # ...held by its process
        before = _snapshot(tmp_path)
        code = cli_main(["train", *sets(*SHORT, f"run.out_dir={tmp_path}")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "in use by another jaxrl-lp process" in err[0] \
        and f"pid {os.getpid()}" in err[0], err
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_damaged_checkpoints_are_named_set_aside_and_the_run_continues(tmp_path, capsys,
                                                                       finished_runs):
    # The shared Fair Cast run (its GRPO moves the params, both optimizers and the exporter's
    # residual), checkpointed at every step: 5, 6 and 7 kept, of which 7 and 6 are damaged,
    # so the run resumes from step 5, inside GRPO.
    fair = finished_runs["fair"][0]
    cfg = _cfg(tmp_path, *FAIR_CAST, *GRPO_MOVES, "run.keep_checkpoints=3",
               "run.checkpoint_every=1")
    run_train(cfg, stop_after=7)
    ckpts = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [5, 6, 7]
    # Step 7: a truncated array file; step 6: its metadata file is gone.
    biggest = max((p for p in (ckpts / "7" / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    with biggest.open("r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    (ckpts / "6" / "meta" / "metadata").unlink()
    capsys.readouterr()
    summary = run_train(cfg)
    err = capsys.readouterr().err
    assert "checkpoint step 7" in err and "checkpoint step 6" in err and "damaged" in err, err
    assert (ckpts / "7.damaged").is_dir() and (ckpts / "6.damaged").is_dir()
    assert summary["steps"] == 8
    # It continued from step 5 exactly as the uninterrupted run did: the params, both
    # optimizers, the exporter's state and the iterators of its last checkpoint...
    end, ref_end = _checkpoint(tmp_path, 8), _checkpoint(fair, 8)
    assert end["meta"]["prompt_data"] == ref_end["meta"]["prompt_data"]
    for part in ("params", "opt_sft", "opt_grpo", "sync"):
        jax.tree.map(np.testing.assert_array_equal, end["state"][part], ref_end["state"][part])
    # ...and the records the lost steps had written were dropped and written again.
    recs = _records(tmp_path)
    assert len({(r["step"], r["phase"]) for r in recs}) == len(recs)
    assert recs == _records(fair)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_a_complete_run_is_left_unchanged_unless_refreshed(tmp_path, capsys, reference):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    before = _snapshot(tmp_path, lock=False)
    capsys.readouterr()
    again = run_train(_cfg(tmp_path))
    assert again["complete"] is True and again["final_accuracy"] == json.loads(
        (reference / "summary.json").read_text())["final_accuracy"]
    assert "is complete" in capsys.readouterr().err
    assert _snapshot(tmp_path, lock=False) == before  # no new summary, plot or event file
    refreshed = run_train(_cfg(tmp_path), refresh=True)
    assert "complete" not in refreshed and refreshed["final_accuracy"] == again["final_accuracy"]
    assert _snapshot(tmp_path)["summary.json"] != before["summary.json"]
    assert _records(tmp_path) == _records(reference)  # the final record redone, not doubled
    # Asking for fewer steps than a run has done is refused, naming both counts.
    with pytest.raises(ValueError, match="has done 8 steps, more than .* = 6"):
        run_train(_cfg(tmp_path, "grpo.steps=4"))
