"""Smoke tests of the built-in studies (`jaxrl-lp study`) at a tiny size."""

import json

import pytest

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.studies.fair_cast import ARMS, arm_figures
from jaxrl_lp.sync.ternary import TERNARY_PATHS

ARM_KEYS = ("update_retention", "mean_staleness_steps", "served_progress", "lag_steps",
            "final_accuracy")


def _check_fair_cast(r, out, arms):
    assert set(r["arms"]) == set(arms)
    for arm, fig in r["arms"].items():
        for k in ARM_KEYS:
            assert k in fig, (arm, k)
        assert 0.0 <= fig["final_accuracy"] <= 1.0
    # The warm-started tiny model has reward variance, so the master moves, and
    # round-to-nearest serves fewer of its updates than stochastic rounding.
    assert r["arms"]["nearest"]["update_retention"] < r["arms"]["stochastic"]["update_retention"]
    on_disk = json.loads((out / "fair_cast.json").read_text())
    assert on_disk["arms"].keys() == r["arms"].keys()
    for name in ("served_progress.png", "retention.png", "fair_cast_series.json"):
        assert (out / name).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.ci
def test_fair_cast_quick(tmp_path, capsys):
    """`jaxrl-lp study fair-cast`: every arm (`ARMS`), 2 GRPO steps each; the `f32` arm's
    series are the master's by definition."""
    assert cli_main(["study", "fair-cast", "--quick", "--steps", "2",
                     "--set", "run.eval_size=8", "--out", str(tmp_path / "fc")]) == 0
    r = json.loads((tmp_path / "fc" / "fair_cast.json").read_text())
    _check_fair_cast(r, tmp_path / "fc", ARMS)
    f32 = r["arms"]["f32"]
    assert f32["by_definition"] and f32["served_progress"] == 1.0 and f32["lag_steps"] >= 1


@pytest.mark.slow
@pytest.mark.ci
def test_ternary_export_quick(tmp_path):
    """`jaxrl-lp study ternary-export --quick`."""
    assert cli_main(["study", "ternary-export", "--quick", "--out", str(tmp_path / "tern")]) == 0
    r = json.loads((tmp_path / "tern" / "ternary_export.json").read_text())
    assert set(r["paths"]) == set(TERNARY_PATHS)
    for path, e in r["paths"].items():
        assert 0.0 <= e["code_disagreement"] <= 1.0, path
        assert 0.0 <= e["accuracy"] <= 1.0, path
        assert e["per_tensor"], path
    assert r["paths"]["direct_codes"]["code_disagreement"] == 0.0
    assert r["paths"]["bf16_fixed_point"]["code_disagreement"] == 0.0
    assert r["paths"]["bf16_fixed_point"]["code_disagreement_training_consumer"] == 0.0
    # The training quantizer's own codes and scale serve the model it trained.
    assert r["paths"]["direct_codes"]["accuracy"] == r["reference_accuracy"]


def test_arm_figures_conventions():
    s = {"step": [1, 2, 3, 4], "retention": [0.0, 0.1, None, 0.3],
         "staleness": [2.0, 3.0, 4.0, 1.0], "progress": [0.1, 0.49, 0.5, 0.9]}
    f = arm_figures(s)
    assert f["lag_steps"] == 3 and f["served_progress"] == 0.9
    assert f["update_retention"] == pytest.approx(0.4 / 3)
    assert arm_figures(dict(s, progress=[0.0, 0.1, 0.2, 0.3]))["lag_steps"] is None
    assert arm_figures(dict(s, progress=[None, None, 1.0, 1.0]))["lag_steps"] == 3


def test_study_cli_errors(capsys):
    assert cli_main(["study", "ternary-export", "--steps", "3"]) == 2
    assert "--steps does not apply to ternary-export" in capsys.readouterr().err
    assert cli_main(["study", "alignment", "--lr", "1e-3"]) == 2
    assert "--lr applies to fair-cast only" in capsys.readouterr().err
    assert cli_main(["study", "fair-cast", "--arms", "nearest,bogus"]) == 2
    assert "choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["study", "no-such-study"])
