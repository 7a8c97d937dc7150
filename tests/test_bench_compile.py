"""`jaxrl-lp bench compile`: compile seconds of the sampler's and the learner's programs by depth."""

import json

import pytest

from jaxrl_lp.bench.compile import report
from jaxrl_lp.cli.main import main as cli_main


def test_the_command_prints_each_phase_at_each_depth_and_the_line_through_them(capsys):
    assert cli_main(["bench", "compile", "--presets", "tiny-qwen3", "--depths", "1,2",
                     "--programs", "sampler_generate,sampler_decode", "--prompt-len", "8",
                     "--new-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["depths"] == [1, 2] and out["shapes"]["prompt_len"] == 8
    row = out["presets"]["tiny-qwen3"]
    prog = row["programs"]["sampler_decode"]
    for d in ("1", "2"):
        cell = prog["by_depth"][d]
        parts = cell["build_s"] + cell["trace_s"] + cell["lower_s"] + cell["compile_s"]
        assert cell["compile_s"] > 0 and cell["total_s"] == pytest.approx(parts, abs=0.01)
    # Two depths: the line passes through both totals.
    t1, t2 = prog["by_depth"]["1"]["total_s"], prog["by_depth"]["2"]["total_s"]
    assert prog["s_per_layer"] == pytest.approx(t2 - t1, abs=0.01)
    assert prog["intercept_s"] == pytest.approx(2 * t1 - t2, abs=0.01)
    assert prog["at_preset_depth"] == ("measured" if row["preset_depth"] in (1, 2)
                                       else "extrapolated")


@pytest.mark.parametrize("depths, programs, message", [
    ((4,), ("sampler_decode",), "at least two layer counts"),
    ((0, 2), ("sampler_decode",), "at least two layer counts"),
    ((1, 2), ("decode",), "unknown program 'decode'"),
])
def test_bad_depths_and_programs_are_refused(depths, programs, message):
    with pytest.raises(ValueError, match=message):
        report(["tiny-qwen3"], depths=depths, programs=programs)
