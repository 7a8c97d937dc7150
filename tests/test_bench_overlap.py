"""`jaxrl-lp bench overlap`: synchronous against overlapped iterations, end to end at tiny size."""

import json

import pytest
from helpers import TINY_MODEL

from jaxrl_lp.cli.main import main


@pytest.mark.parametrize("argv,message", [
    (["--cells", "2+2"], "unknown cell '2+2'"),
    (["--steps", "3", "--warmup", "3"], "must exceed --warmup"),
])
def test_bad_options_are_refused(capsys, argv, message):
    assert main(["bench", "overlap", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_overlap_races_both_modes(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    tiny = [a for o in [*TINY_MODEL, "model.max_position_embeddings=96"] for a in ("--set", o)]
    assert main(["bench", "overlap", "--cells", "1+1/core", "--steps", "3", "--warmup", "1",
                 "--rounds", "1", "--out", str(out), *tiny]) == 0
    got = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == got
    cell = got["1+1/core"]
    assert cell["devices"] == 8 and "--xla_cpu_multi_thread_eigen=false" in cell["xla_flags"]
    assert cell["synchronous"]["rollout_staleness"] == 0.0
    assert cell["overlapped"]["rollout_staleness"] == 1.0
    for mode in ("synchronous", "overlapped"):
        phases = sum(cell[mode][p] for p in ("sample", "behaviour", "update", "export", "score",
                                              "sync"))
        assert 0 < cell[mode]["iteration_s"] and phases <= cell[mode]["iteration_s"] * 1.5
    assert cell["speedup"] == pytest.approx(cell["synchronous"]["iteration_s"]
                                            / cell["overlapped"]["iteration_s"], rel=1e-2)
