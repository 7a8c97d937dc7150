"""`jaxrl-lp eval` on finished runs with and without an exporter, on warm-starts, and bad input.

The finished runs are the session's shared ones (`finished_runs`, conftest.py):
8 steps, checkpoints 6 and 8 kept, `fair` with a bf16 error-feedback exporter.
"""

import json

import pytest
from helpers import FINISHED, FINISHED_STEPS, sets, short_run

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.train import apply_overrides, default_config, run_train

SHORT = short_run(sft_steps=2, grpo_steps=2)


@pytest.fixture
def runs(finished_runs):
    return finished_runs


def _eval(capsys, *args):
    capsys.readouterr()
    assert cli_main(["eval", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


def test_finished_run_without_exporter(runs, capsys):
    run, summary = runs["plain"]
    # The run's own config.json, or the config on the command line, as `train` took it.
    out = _eval(capsys, "--run", run)
    assert out == {"step": FINISHED_STEPS, "accuracy": summary["final_accuracy"]}
    assert _eval(capsys, *sets(*FINISHED, f"run.out_dir={run}")) == out


def test_finished_run_with_exporter_and_its_served_copy(runs, capsys):
    run, summary = runs["fair"]
    out = _eval(capsys, "--run", run, "--served")
    # The served copy is exported with the exporter state of the checkpoint, as the
    # training program scored it at the end of the run.
    assert out == {"step": FINISHED_STEPS, "accuracy": summary["final_accuracy"],
                   "accuracy_served": summary["final_accuracy_served"],
                   "exporter": "bf16:error_feedback"}


def test_earlier_step_size_and_another_exporter(runs, capsys):
    run, _ = runs["fair"]
    out = _eval(capsys, "--run", run, "--step", 6, "--size", 4, "--served")
    assert out["step"] == 6 and 0.0 <= out["accuracy"] <= 1.0
    assert 0.0 <= out["accuracy_served"] <= 1.0
    out = _eval(capsys, "--run", runs["plain"][0], "--exporter", "fmt:nvfp4")
    assert out["exporter"] == "fmt:nvfp4" and 0.0 <= out["accuracy_served"] <= 1.0


def test_warm_start_only_run(tmp_path, capsys):
    cfg = apply_overrides(default_config(), [*SHORT, f"run.out_dir={tmp_path}",
                                             "sync.exporter=fmt:mxfp8"])
    assert run_train(cfg, stop_after=2) == {"steps": 2, "interrupted": True}
    out = _eval(capsys, "--run", tmp_path, "--served")
    assert out["step"] == 2 and out["exporter"] == "fmt:mxfp8"


def _fails(capsys, args, *words):
    capsys.readouterr()
    assert cli_main(["eval", *map(str, args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxrl-lp eval: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    run, _ = runs["plain"]
    missing = tmp_path / "missing"
    _fails(capsys, ["--run", missing], "does not exist")
    _fails(capsys, sets(*SHORT, f"run.out_dir={missing}"), "does not exist")
    assert not missing.exists()  # eval writes nothing
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(capsys, ["--run", empty], "no config.json")
    _fails(capsys, sets(*SHORT, f"run.out_dir={empty}"), "has no checkpoints")
    assert list(empty.iterdir()) == []
    _fails(capsys, ["--run", run, "--step", 3], "no checkpoint at step 3", "[6, 8]")
    _fails(capsys, ["--run", run, "--served"], "no exporter", "--exporter")
    _fails(capsys, ["--run", run, "--exporter", "fmt:nope"], "nope")
    _fails(capsys, ["--run", run, "--set", "model.hidden_size=64"], "different model")
