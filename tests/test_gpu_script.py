"""`benchmarks/gpu.sh` dry-run on CPU (`QUICK=1 ALLOW_CPU=1`), every suite (the slow tier; the
exactness suite in CI's).

A session lent a GPU has 15 minutes of device time and runs one prepared suite: a script
that stopped working since (a renamed option, a moved file) would spend them on a
traceback. Each suite runs here at tiny sizes, the way the GPU runs it (steps under their
own limits, JSON per target named by device); every step must exit 0 and leave its JSON.
The exactness suite's tier of tests is collected, not run: they run on CPU in the slow tier.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_lp.numerics.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# suite -> the target JSONs it writes beside gpu[-suite]-cpu-dry-run.json
SUITES = {
    "exactness": ("gpu", ["replay", "train"]),
    "speed": ("gpu-speed", ["sampler", "learner"]),
    "iteration": ("gpu-iteration", ["iteration"]),
    "profile": ("gpu-profile", ["profile-sampler", "profile-update"]),
    "graphs": ("gpu-graphs", ["sampler-flags-none", "sampler-flags-decode_graphs",
                              "decode-flags", "replay-flags-decode_graphs"]),
    "invariant": ("gpu-invariant", ["fixed-tile", "fixed-tile-model"]),
    "kernels": ("gpu-kernels", ["kernels-retired-fp32", "kernels-retired-logprob",
                                "kernels-retired-memory"]),
    "fp8": ("gpu-fp8", ["sampler-fp8", "sampler-bf16", "learner-fp8", "learner-fp8-fresh",
                        "learner-bf16"]),
}


# The exactness suite, a session's first job on a GPU, in CI's slow tier; the others by hand.
@pytest.mark.parametrize("suite", [pytest.param(s, marks=pytest.mark.ci) if s == "exactness"
                                   else s for s in sorted(SUITES)])
def test_the_gpu_script_runs_each_suite_on_cpu(tmp_path, suite):
    tag, targets = SUITES[suite]
    env = dict(os.environ, SUITE=suite, QUICK="1", ALLOW_CPU="1", PYTHON=sys.executable)
    res = subprocess.run(["bash", "benchmarks/gpu.sh", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = json.loads((tmp_path / f"{tag}-cpu-dry-run.json").read_text())["steps"]
    assert steps and all(s["exit"] == 0 for s in steps.values()), (
        steps, (tmp_path / f"{tag}-cpu-dry-run.log").read_text()[-3000:])
    out = {t: json.loads((tmp_path / f"{t}-cpu-dry-run.json").read_text()) for t in targets}
    if suite == "exactness":  # every GRPO verification of the default run passed
        assert out["train"]["replay_verified_steps"] >= 1
        tier = steps["tier"]["last_line"]  # the dry run collects the tier (`-m slow` runs it)
        assert " collected" in tier and "error" not in tier, tier
    elif suite == "iteration":  # the mechanism's A/B is raced
        assert {"hybrid_mb4", "traced_mb4"} <= set(out["iteration"]["tiny-qwen3"])
    elif suite == "profile":  # the ops were found in the trace
        assert out["profile-sampler"]["trace"]["lines"] and out["profile-update"]["top"]
    elif suite == "graphs":  # both presets ran, in their own processes, flags set
        assert out["sampler-flags-decode_graphs"]["xla_gpu_flags"]["flags"]
        assert "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" in (
            out["sampler-flags-decode_graphs"]["xla_gpu_flags"]["XLA_FLAGS"])
        for cell in out["decode-flags"]["cells"].values():
            assert cell["decode_graphs"]["speedup_vs_none"] > 0
        assert out["decode-flags"]["replay_equals_sampler"] == {"decode_graphs": True}
    elif suite == "invariant":  # both products compared, the kernel interpreted off a GPU
        cell = out["fixed-tile"]["cells"]["128x128"]
        assert out["fixed-tile"]["kernel"] == "gpu" and cell["rows_compared"] == 4 * 3
        assert cell["fixed_tile"]["max_rel_diff_vs_f32"] < 1e-5 and "ms_decode" in cell["xla"]
        model = out["fixed-tile-model"]["model"]  # both pairs compared over the same tokens
        assert model["form"]["tiles"] == "interpret-gpu" and not out["fixed-tile-model"]["cells"]
        assert model["fixed_tiles"]["tokens"] == model["plain"]["tokens"] == 2 * 2 * 8
    elif suite == "fp8":  # each policy's sampler and update, the fp8 loop reading codes
        for policy in ("fp8", "bf16"):
            assert out[f"sampler-{policy}"]["policy"] == policy
            assert out[f"learner-{policy}"]["policy"] == str(Policy.parse(policy))
        assert out["learner-fp8-fresh"]["policy"] == str(Policy.parse("fp8,bwd=fresh"))
        step = lambda p: out[f"sampler-{p}"]["dense"]["tiny-qwen3_batch_2"]
        assert step("fp8")["weight_bytes_per_step"] < step("bf16")["weight_bytes_per_step"] / 2
    elif suite == "kernels":  # every case ran against the reference and XLA's read-out
        logprob, memory = {"logprob_fwd_bwd", "logprob_fwd"}, {"quantize_nvfp4",
                                                               "decode_attention"}
        for target, policy, cases in (("kernels-retired-fp32", "fp32", logprob | memory),
                                      ("kernels-retired-logprob", "bf16,s=native", logprob),
                                      ("kernels-retired-memory", "bf16,s=native", memory)):
            res = out[target]
            assert res["policy"] == str(Policy.parse(f"{policy},k=interpret")), res["policy"]
            cells = {k: v for k, v in res["tiny"].items() if k not in ("shapes", "timed")}
            assert set(cells) == cases, (target, set(cells))
            assert all("error" not in c and c["kernel"]["time_s"] > 0 for c in cells.values())
            assert all(cells[c]["kernel_speedup_vs_tiled"] > 0 for c in cases & logprob)
