"""A checkpoint save that fails (a full disk, a file-size limit): one line naming the path,
the free space and the newest intact checkpoint; no temporary directory left; the next run
resumes from that checkpoint and ends bit-identical to a run that never failed.

The fault is real and needs no privileges: the failing run is a subprocess whose file
size limit (`RLIMIT_FSIZE`, SIGXFSZ ignored) is below a checkpoint's data file, so the
write fails in tensorstore with EFBIG, as a full disk fails with ENOSPC.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import FINISHED, latest_checkpoint, sets

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
@pytest.mark.ci
def test_a_failed_save_is_one_line_leaves_nothing_and_the_run_resumes(tmp_path, finished_runs):
    run = tmp_path / "run"
    cfg = apply_overrides(default_config(), [*FINISHED, f"run.out_dir={run}"])
    run_train(cfg, stop_after=4)  # checkpoints 2 and 4
    # Without the persistent compilation cache: its entries would hit the limit first.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", LIMITED, "train",
                          *sets(*FINISHED, f"run.out_dir={run}")],
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
    plain = finished_runs["plain"][0]
    steps, params = latest_checkpoint(run)
    assert steps[-1] == 8
    jax.tree.map(np.testing.assert_array_equal, params, latest_checkpoint(plain)[1])
    records = lambda d: [without_wall_clock(json.loads(x))
                         for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert records(run) == records(plain)
