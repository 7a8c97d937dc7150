"""A checkpoint save that fails (a full disk, a file-size limit): one line naming the path,
the free space and the newest intact checkpoint; no temporary directory left; the next run
resumes from that checkpoint and ends bit-identical to a run that never failed, whole
state and records, in a configuration whose GRPO state moves (Fair Cast, a KL term).

The fault is real and needs no privileges: the failing run is a subprocess whose file
size limit (`RLIMIT_FSIZE`, SIGXFSZ ignored) is below a checkpoint's data file, so the
write fails in tensorstore with EFBIG, as a full disk fails with ENOSPC.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import (
    FAIR_CAST,
    FINISHED,
    GRPO_MOVES,
    assert_bit_equal,
    bits_equal,
    checkpoints,
    latest_checkpoint,
    sets,
)

from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.logger import without_wall_clock

LIMITED = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
from jaxrl_lp.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_failed_save_is_one_line_leaves_nothing_and_the_run_resumes(tmp_path, finished_runs):
    run = tmp_path / "run"
    # The `fair` finished run's configuration: Fair Cast's exporter residual and a KL term
    # that moves the GRPO state, so the state the resume must restore has moved.
    over = [*FINISHED, *FAIR_CAST, *GRPO_MOVES, f"run.out_dir={run}"]
    cfg = apply_overrides(default_config(), over)
    run_train(cfg, stop_after=4)  # checkpoints 2 and 4
    at_4 = checkpoints(run)[4]
    # Without the persistent compilation cache: its entries would hit the limit first.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", LIMITED, "train", *sets(*over)],
                         capture_output=True, text=True, timeout=300,
                         env={**env, "JAX_ENABLE_COMPILATION_CACHE": "false"})
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("jaxrl-lp train: error: could not write checkpoint step 6 to ")
    assert "(file too large, errno 27)" in lines[0] and "MiB free there" in lines[0]
    assert f"the newest intact checkpoint is step 4 ({run / 'checkpoints' / '4'})" in lines[0]
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if "tmp" in p.name]
    assert leftovers == []
    assert latest_checkpoint(run)[0] == [2, 4]
    run_train(cfg)  # resumes from step 4
    fair = finished_runs["fair"][0]
    got, want = checkpoints(run), checkpoints(fair)
    assert sorted(got) == sorted(want) == [6, 8]
    # Every kept checkpoint, whole (params, both optimizer states, the exporter's residual and
    # count, the sync diagnostics, the data iterators; meta), is the uninterrupted run's.
    for step in want:
        assert_bit_equal(got[step]["state"], want[step]["state"])
        assert got[step]["meta"] == want[step]["meta"]
    # ...and it moved in GRPO after the step the resume restored.
    for part in ("params", "opt_grpo"):
        assert not bits_equal(got[8]["state"][part], at_4["state"][part]), part
    records = lambda d: [without_wall_clock(json.loads(x))
                         for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert records(run) == records(fair)
