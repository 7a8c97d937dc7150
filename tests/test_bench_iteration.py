"""`jaxrl-lp bench iteration` end to end on the tiny preset (timing figures are not asserted)."""

import json

import pytest

from jaxrl_lp.cli.main import main


def test_bench_iteration_reports_phases_and_which_updates_replayed(capsys):
    assert main(["bench", "iteration", "--size", "tiny", "--looped-size", "", "--batch", "4",
                 "--group", "2", "--prompt-len", "4", "--new-tokens", "4",
                 "--minibatches", "1,2", "--methods", "hybrid", "--repeats", "1",
                 "--no-tunix"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["target"] == "iteration" and res["tunix"] == {"available": False,
                                                             "reason": "--no-tunix"}
    tiny = res["tiny-qwen3"]
    assert tiny["tokens_per_iteration"] == 4 * 4
    one, two = tiny["hybrid_mb1"], tiny["hybrid_mb2"]
    # At mu = 1 and one minibatch nothing is replayed: the behaviour log-probs and the
    # hybrid's value are the rollout's. With two minibatches exactly the second replays.
    assert (one["replayed_updates"], one["behaviour_recomputed"]) == (0, 0)
    assert (two["replayed_updates"], two["behaviour_recomputed"]) == (1, 0)
    for r in (one, two):
        phases = sum(r[p] for p in ("sample", "score", "behaviour", "update"))
        assert phases == pytest.approx(r["iteration_s"], rel=1e-3, abs=1e-3)
        assert r["tokens_per_s"] > 0 and r["verify_replay_s"] > 0
        assert "vs_tunix" not in r
    assert res["targets_met"] == {}


def test_bench_iteration_refuses_bad_arguments(capsys):
    assert main(["bench", "iteration", "--size", "tiny", "--minibatches", "3", "--no-tunix"]) == 2
    assert "--minibatches" in capsys.readouterr().err
    assert main(["bench", "iteration", "--size", "tiny", "--methods", "sparse",
                 "--no-tunix"]) == 2
    assert "--methods" in capsys.readouterr().err
