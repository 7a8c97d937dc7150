"""The benchmark scripts that back a figure in the docs, run end to end at their smallest size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> dict:
    """`python benchmarks/<script> <args>`, from the checkout: the JSON it prints."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.ci
def test_update_token_axis_ab_runs_and_finds_the_same_bits():
    # Both forms of the update on the tiny preset: the JSON it prints, the same parameters
    # after the first update and the same dense gradient bits (a dense preset).
    res = _run("update_token_axis_ab.py", "--size", "tiny", "--rounds", "2")
    assert res["preset"] == "tiny-qwen3" and res["rounds"] == 2
    assert set(res["seconds"]) == {"one_token_axis", "leading_axes"}
    assert all(v["min"] > 0 for v in res["seconds"].values())
    assert res["same_bits"] is True and res["same_gradient"] is True


@pytest.mark.slow
@pytest.mark.ci
def test_profile_sampler_names_the_rollouts_ops_and_its_weight_matmuls():
    # The tiny preset's rollout under the profiler: ops named from XLA's HLO dump (removed
    # after), the weight matmuls found among them, and their share of the op time.
    res = _run("profile_sampler.py", "--size", "tiny", "--new-tokens", "8", "--repeats", "1",
               "--calls", "1", "--top", "5")
    assert res["preset"] == "tiny-qwen3" and res["new_tokens"] == 8 and len(res["top"]) == 5
    assert res["ops_s"] > 0 and 0 < res["weight_matmul_s"] <= res["ops_s"]
    assert 0 < res["weight_matmul_share"] <= 1 and res["other_dot_s"] >= 0
    assert all(r["op_name"].startswith("jit(") for r in res["top"])


@pytest.mark.slow
@pytest.mark.ci
def test_profile_update_names_the_updates_ops():
    # Every op (a large --top): at the tiny preset the matmuls need not be among the largest.
    res = _run("profile_update.py", "--size", "tiny", "--steps", "1", "--top", "100000")
    assert res["preset"] == "tiny-qwen3" and res["steps"] == 1 and len(res["top"]) > 10
    assert res["ops_s"] > 0 and all(r["calls"] >= 1 for r in res["top"])
    assert any(r["op_name"].endswith("dot_general") for r in res["top"])
    assert sum(r["s"] for r in res["top"]) == pytest.approx(res["ops_s"], abs=1e-3 * len(res["top"]))


def test_fingerprint_benchmark_runs_and_finds_the_same_bits():
    # The tiny preset's weights (a few seconds; every leaf under one chunk, so the forms'
    # temporaries are alike there): both forms give one [2] fingerprint (the script asserts
    # it) and report their temporaries, page faults and seconds.
    res = _run("fingerprint.py", "--size", "tiny", "--repeats", "1")
    assert res["preset"] == "tiny-qwen3" and len(res["fingerprint"]) == 2
    for form in ("one_reduction", "chunked_cpu"):
        assert res[form]["seconds"] > 0 and res[form]["temp_bytes"] >= 0
        assert res[form]["page_faults"] >= 0


@pytest.mark.slow
@pytest.mark.ci
def test_unstacked_update_ab_runs_and_the_storage_form_needs_less_memory():
    # The tiny preset, one round: three forms, each timed; the per-layer storage compiles
    # to fewer temporaries than the scanned stack (no weight slices, no stacked gradients).
    res = _run("unstacked_update_ab.py", "--size", "tiny", "--rounds", "1")
    forms = ("stacked", "unstacked_in_step", "unstacked_storage")
    assert res["preset"] == "tiny-qwen3" and all(res[f]["min_s"] > 0 for f in forms)
    assert res["stacked"]["same_bits_as_stacked"] is True
    assert res["unstacked_storage"]["temp_bytes"] < res["stacked"]["temp_bytes"]


@pytest.mark.slow
@pytest.mark.ci
def test_norm_grad_benchmark_times_both_forms():
    # The tiny preset: both forms of the weight gradient at its shapes and of its update,
    # the update's parameters after them differing only by the norm weights' summation order.
    res = _run("norm_grad.py", "--size", "tiny", "--rounds", "1")
    assert res["preset"] == "tiny-qwen3" and res["rounds"] == 1
    assert set(res["weight_grad_ms"]) == {"1x1024x64", "1x1024x4x16"}
    assert all(v["reduce"] > 0 and v["product"] > 0 for v in res["weight_grad_ms"].values())
    for form in ("reduce", "product"):
        assert res["update"][form]["min_s"] > 0 and res["update"][form]["temp_bytes"] > 0
    assert isinstance(res["update"]["same_bits"], bool)


@pytest.mark.slow
@pytest.mark.ci
def test_decode_matmuls_times_every_form_and_they_agree():
    # The tiny preset's decode matmuls in each form, the transposed layout's being
    # `layers.dot` itself: the same sums to f32 rounding, every form timed.
    res = _run("decode_matmuls.py", "--preset", "tiny-qwen3", "--steps", "2", "--repeats", "1")
    forms = {"dot_in_out", "dot_out_in", "dot_out_in_weights_major", "dot_in_out_weights_major",
             "multiply_reduce_out_in", "multiply_reduce_transposed_in_loop"}
    assert forms <= set(res) and res["preset"] == "tiny-qwen3"
    for f in forms:
        assert res[f]["ms_per_step"] > 0 and res[f]["result_rel_diff"] < 1e-4, f
    assert res["dot_in_out"]["result_rel_diff"] == 0.0
