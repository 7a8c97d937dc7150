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
def test_profile_sampler_names_the_rollouts_ops_and_its_weight_matmuls():
    # The tiny preset's rollout under the profiler: ops named from XLA's HLO dump (removed
    # after), the weight matmuls found among them, and their share of the op time.
    # A preset by name, bf16, 3 prompts (x 4 samples): the options `benchmarks/gpu.sh
    # SUITE=profile` sets at Qwen3-0.6B.
    res = _run("profile_sampler.py", "--size", "tiny-qwen3", "--policy", "bf16", "--prompts",
               "3", "--prompt-len", "8", "--new-tokens", "8", "--repeats", "1", "--calls", "1",
               "--top", "5")
    assert res["preset"] == "tiny-qwen3" and res["new_tokens"] == 8 and len(res["top"]) == 5
    assert "c=bf16" in res["policy"] and res["batch"] == 12
    assert res["trace"]["lines"] and "unmatched" not in res["trace"]  # the ops' lines named
    assert res["ops_s"] > 0 and 0 < res["weight_matmul_s"] <= res["ops_s"]
    assert 0 < res["weight_matmul_share"] <= 1 and res["other_dot_s"] >= 0
    assert all(r["op_name"].startswith("jit(") for r in res["top"])


@pytest.mark.slow
def test_profile_update_names_the_updates_ops():
    # Every op (a large --top): at the tiny preset the matmuls need not be among the largest.
    res = _run("profile_update.py", "--size", "tiny", "--steps", "1", "--top", "100000",
               "--batch", "4", "--prompt-len", "8", "--seq-len", "40", "--full")
    assert res["preset"] == "tiny-qwen3" and res["steps"] == 1 and len(res["top"]) > 10
    assert (res["batch"], res["seq_len"]) == (4, 40) and res["trace"]["lines"]
    assert res["ops_s"] > 0 and all(r["calls"] >= 1 for r in res["top"])
    assert any(r["op_name"].endswith("dot_general") for r in res["top"])
    assert sum(r["s"] for r in res["top"]) == pytest.approx(res["ops_s"], abs=1e-3 * len(res["top"]))


@pytest.mark.slow
def test_speculative_replay_is_exact_in_every_slice_and_timed():
    # `docs/bench/speculative-replay-2core-cpu.json`'s script, one timed round. The replay by the
    # sampler's program differs on no token of any slice; its negative control, the chunks
    # traced into a program at the slice's shape (`/traced`), differs on some in the sliced
    # batches (the JSON: 129 of 512 tokens in 2 slices, 158 in 4, on XLA:CPU). The whole
    # batch (`1/traced`) is not asserted: whether one program's fusions round apart is a
    # property of the compiler, not of the replay.
    res = _run("speculative_replay.py", "--repeats", "1")
    assert res["rows"] == 16 and res["tokens"] > 0
    slices = res["differing_tokens_by_slices"]
    assert set(slices) == {f"{k}/{name}" for k in (1, 2, 4) for name in ("exact", "traced")}
    assert {k: v for k, v in slices.items() if k.endswith("/exact")} == {
        "1/exact": 0, "2/exact": 0, "4/exact": 0}
    assert slices["2/traced"] > 0 and slices["4/traced"] > 0, slices
    for name in ("sampler_forcing_input_s", "sampler_without_s", "replay_program_s",
                 "traced_replay_s"):
        assert res[name] > 0, name


@pytest.mark.slow
def test_invariant_residuals_counts_both_programs_against_the_sampler():
    # `docs/bench/invariant-residuals-*.json`'s script, dense f32: the forward-only program
    # the invariant step runs gives the sampler's bits; the same forward with its backward's
    # residuals kept is counted beside it (docs/design/invariant.md, "The forms").
    res = _run("invariant_residuals.py", "--quick")["cases"]["dense fp32"]
    assert res["tokens"] > 0 and res["differing_forward_only"] == 0, res
    assert res["residual_arrays"] > 0 and 0 <= res["differing_with_residuals"] <= res["tokens"]


@pytest.mark.slow
def test_batch_invariance_ops_hold_the_invariant_forms_on_this_cpu():
    # `docs/bench/batch-invariance-*.json`'s script, its `ops` part at the smallest sizes: on
    # whichever CPU runs it, the forms are what makes a row's bits independent of its batch
    # (products of 2 to `row_chunk` rows give a row the bits it has among 32: 32 on the
    # AMD EPYC CPUs measured), where the plain forms are not.
    from jaxrl_lp.numerics.invariant import padded_rows, row_chunk

    res = _run("batch_invariance.py", "--parts", "ops", "--quick")["ops"]
    rows = res["x@W K=512 N=1408: rows' bits vs 8 rows / vs 32 rows / vs 1024 rows"]
    assert row_chunk() == 32 and all(rows[str(m)][1] == 0 for m in (2, 8, 16, 32)), rows
    attention = res["attention: values differing, one query vs all over the same cache"]
    assert [v for k, v in attention.items() if k.endswith("invariant")] == [0]
    assert all(v > 0 for k, v in attention.items() if "plain" in k), attention
    dots_only = res["reductions, dots only: row counts whose rows differ from 2560 rows'"]
    assert dots_only and not any(dots_only.values()), dots_only
    norm = res["norm of h + a product (hidden 32), one row vs 32: values differing"]
    assert norm["fixed tree (invariant.total)"] == 0, norm
    assert res["a*b + c*d: values differing from the separately rounded sum (FMA contraction)"] > 0
    tile = res["column_tile"]  # the weights-major form: rows padded to each residue
    assert (tile is None) == (res["column_residues"] == []), res
    for r in res["column_residues"]:
        whole = padded_rows(1000, tile, r)
        assert res[f"W@x.T K=512 N=1408, padded to {r} rows over whole column tiles ({tile}): "
                   f"row counts whose rows differ from {whole} rows'"] == [], res


@pytest.mark.slow
def test_fixed_tile_compares_a_decodes_rows_with_the_learners():
    # Off a GPU the kernel runs in Mosaic GPU's interpreter (bits, no times); XLA's product is
    # compiled and timed. 2 sequences of 6 tokens: steps 0, 3 and 5, 6 rows compared a product.
    res = _run("fixed_tile.py", "--batch", "2", "--tokens", "6", "--widths", "64x128,96x64",
               "--repeats", "1")
    assert res["target"] == "fixed-tile" and res["kernel"] == "gpu"
    assert "interpreter" in res["note"] and set(res["cells"]) == {"64x128", "96x64"}
    for cell in res["cells"].values():
        assert cell["decode_steps"] == [0, 3, 5] and cell["rows_compared"] == 6
        assert 0 <= cell["xla"]["rows_differ"] <= 6 and cell["xla"]["ms_learner"] > 0
        assert 0 <= cell["fixed_tile"]["rows_differ"] <= 6 and "ms_decode" not in cell["fixed_tile"]
        assert 0 < cell["fixed_tile"]["max_rel_diff_vs_f32"] < 1e-5
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fixed_tile.py"), "--widths",
                          "64by128"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--widths: '64by128' is not KxN" in bad.stderr
