"""`jaxrl-lp bench learner` end to end on the tiny preset (timing figures are not asserted)."""

import json

import pytest

from jaxrl_lp.cli.main import main


@pytest.mark.slow
def test_bench_learner_prints_one_json_object_with_both_methods(capsys):
    assert main(["bench", "learner", "--size", "tiny", "--batch", "4", "--group", "2",
                 "--seq-len", "24", "--prompt-len", "8", "--repeats", "1", "--min-time", "0",
                 "--no-tunix"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["target"] == "learner" and res["tunix"] == {"available": False,
                                                           "reason": "--no-tunix"}
    for m in ("dense", "hybrid", "hybrid-recorded"):
        assert res[m]["tokens_per_s"] > 0 and res[m]["mfu"] > 0
        assert res[m]["compiled_flops"] > 0 and res[m]["compiled_temp_bytes"] > 0
    # The same update: hybrid's gradient is the dense forward's (only its value is the replay's).
    assert abs(res["hybrid"]["grad_norm_first"] - res["dense"]["grad_norm_first"]) < 1e-5
    assert "hybrid_over_dense_time<=1.5" in res["targets_met"]
    # Given the recorded values, the hybrid's program is the dense one's plus nothing that
    # multiplies: the same dot FLOPs (the replay's are gone), and the same update (a replay
    # traced for a gradient rounds its value about 1 ulp off the forward-only one).
    rec = res["hybrid-recorded"]
    assert rec["compiled_flops"] == res["dense"]["compiled_flops"] < res["hybrid"]["compiled_flops"]
    assert abs(rec["grad_norm_first"] - res["hybrid"]["grad_norm_first"]) < 1e-5
    assert abs(rec["loss_first"] - res["hybrid"]["loss_first"]) < 1e-5
    assert "hybrid_recorded_over_dense_time<=1.05" in res["targets_met"]
    # Our step skipped padding: fewer packed rows than the grid's B x T and B x N slots.
    body, head = res["packed_rows"]
    assert res["pack_buckets"] == 16 and body < 4 * 24 and head < 4 * 16
    assert body >= res["completion_tokens"] + 4 * 8 and head >= res["completion_tokens"]


def test_bench_learner_takes_a_preset_by_name(capsys):
    """`--size` names a model preset (`benchmarks/gpu.sh`: qwen3-0.6b); a looped one needs
    `--looped`."""
    assert main(["bench", "learner", "--size", "tiny-qwen3", "--batch", "2", "--group", "2",
                 "--seq-len", "12", "--prompt-len", "4", "--repeats", "1", "--min-time", "0",
                 "--methods", "dense", "--no-tunix", "--policy", "bf16"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["preset"] == "tiny-qwen3" and res["dense"]["step_s"] > 0
    assert main(["bench", "learner", "--size", "tiny-ouro", "--no-tunix"]) == 2
    assert "'tiny-ouro' is a looped preset; add --looped" in capsys.readouterr().err


def test_bench_learner_refuses_bad_packing_and_methods(capsys):
    assert main(["bench", "learner", "--size", "tiny", "--pack-buckets", "-1", "--no-tunix"]) == 2
    assert "--pack-buckets must be >= 0 (0: no packing); got -1" in capsys.readouterr().err
    assert main(["bench", "learner", "--size", "tiny", "--methods", "dense,sparse",
                 "--no-tunix"]) == 2
    allowed = ("allowed: dense, hybrid, hybrid-recorded, dense-unpacked, hybrid-unpacked, "
               "hybrid-recorded-unpacked")
    assert allowed in capsys.readouterr().err


@pytest.mark.slow
def test_bench_learner_looped_races_the_packed_step_against_every_slot(capsys):
    """`--looped`: the preset's shapes as a looped model (ours only); the packed step computes
    fewer FLOPs than the one on every slot, for the same update."""
    assert main(["bench", "learner", "--size", "tiny", "--looped", "--batch", "4", "--group", "2",
                 "--seq-len", "24", "--prompt-len", "8", "--repeats", "1", "--min-time", "0",
                 "--methods", "dense,dense-unpacked"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["preset"] == "tiny-qwen3-looped-r4"
    assert res["tunix"] == {"available": False, "reason": "--looped: Tunix has no looped model"}
    body, head = res["packed_rows"]
    assert body < 4 * 24 and head < 4 * 16
    packed, every = res["dense"], res["dense-unpacked"]
    assert packed["compiled_flops"] < every["compiled_flops"]
    assert abs(packed["grad_norm_first"] - every["grad_norm_first"]) < 1e-5 * every["grad_norm_first"]
    assert res["dense_packing_speedup"] > 0
