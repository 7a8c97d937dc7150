"""`jaxrl-lp bench replay`, `bench exactness` and `bench speculative` end to end, at tiny sizes
(`bench speculative` compiles two drafters' programs: the slow tier)."""

import json

import pytest

from jaxrl_lp.cli.main import main


def test_bench_replay_finds_every_cell_exact_and_times_the_forcing(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert main(["bench", "replay", "--presets", "tiny-qwen3,tiny-ouro", "--policies", "fp32",
                 "--prompts", "4", "--prompt-len", "12", "--new-tokens", "8", "--cost",
                 "--traced", "--repeats", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["replay_equals_sampler"] is True
    cell = got["results"]["tiny-qwen3"]["fp32"]
    assert cell["whole"]["tokens"] > 0 and cell["slices_4"]["differ"] == 0
    assert cell["other_weights_max_abs_diff"] > 0  # a replay under other weights differs
    assert set(cell["cost"]) >= {"sample_s_with_forcing", "sample_s_without_forcing",
                                 "replay_s_sampler_program", "replay_s_traced"}
    assert "cost" not in got["results"]["tiny-ouro"]["fp32"]  # the first cell only
    assert got["results"]["tiny-ouro"]["fp32"]["exit_step_counts"][0] > 0
    assert main(["bench", "replay", "--presets", "tiny-qwen3", "--prompts", "3",
                 "--samples", "1"]) == 2
    assert "must divide by 4" in capsys.readouterr().err


def test_bench_exactness_replay_and_hybrid_are_the_samplers_bits(tmp_path):
    out = tmp_path / "exactness.json"
    assert main(["bench", "exactness", "--policies", "fp32", "--kinds", "dense,looped_deferred",
                 "--max-new-tokens", "8", "--repeats", "1", "--jobs", "1",
                 "--out", str(out)]) == 0
    for kind, r in json.loads(out.read_text())["results"]["fp32"].items():
        assert r["max_abs_diff_replay"] == 0.0 and r["max_abs_diff_hybrid"] == 0.0, kind
        assert r["max_abs_diff_dense"] > 0.0, kind  # the dense forward rounds otherwise


@pytest.mark.slow
def test_bench_speculative_runs_both_drafters(tmp_path):
    """`jaxrl-lp bench speculative` end to end (it once stopped at a missing argument): both
    drafters race plain decoding and commit at least one token per target forward."""
    out = tmp_path / "speculative.json"
    assert main(["bench", "speculative", "--sft-steps", "2", "--prompts", "1",
                 "--new-tokens", "6", "--past-eos", "--repeats", "1", "--min-time", "0",
                 "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    for drafter in ("self", "dense"):
        r = got[drafter]
        assert 0.0 <= r["acceptance_rate"] <= 1.0, drafter
        assert r["target_forwards"] > 0 and r["tokens_per_target_forward"] >= 1.0, (drafter, r)
        assert r["speculative_s"] > 0 and r["plain_s"] > 0, drafter
