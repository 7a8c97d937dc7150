"""docs/results.md is current, and docs/bench keeps one current JSON per target and machine kind.

`tools/results.py` writes docs/results.md from docs/bench/*.json and classifies each file by
the program that wrote it and the machine kind its name says; git keeps the earlier runs.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "results.py"


def _results():
    spec = importlib.util.spec_from_file_location("tools_results", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


results = _results()


def test_results_doc_is_current():
    proc = subprocess.run([sys.executable, str(TOOL), "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_one_json_per_target_and_machine_kind():
    several = {key: names for key, names in results.groups().items() if len(names) > 1}
    assert not several, ("docs/bench keeps one current JSON per (target, machine kind); "
                         f"git keeps the others: {several}")


def test_every_json_is_named_in_the_doc():
    text = (ROOT / "docs" / "results.md").read_text()
    names = [p.name for p in sorted((ROOT / "docs" / "bench").glob("*.json"))]
    assert names
    missing = [n for n in names if f"[{n}](bench/{n})" not in text]
    assert not missing, missing


def test_classification():
    assert results.machine_kind("iteration-fingerprint-mb1-run2-2core-zen5.json") == "2core-cpu"
    assert results.machine_kind("profile-update-1core-norm-grad-zen5.json") == "2core-cpu"
    assert results.machine_kind("iteration-roofline-2core-cpu-before-argmax.json") == "2core-cpu"
    assert results.machine_kind("sampler-draw-2core-epyc.json") == "2core-cpu"
    assert results.machine_kind("replay-h200.json") == "h200"
    assert results.machine_kind("hotpath-cuda.json") == "cuda"
    target = results.target_of
    assert target("x-2core-cpu.json", {"target": "iteration"}) == "jaxrl-lp bench iteration"
    assert target("x.json", {"target": "iteration A/B (benchmarks/iteration_ab.py)"}) == \
        "benchmarks/iteration_ab.py"
    assert target("x.json", {"target": "learner", "preset": "small-qwen3-looped-r4"}) == \
        "jaxrl-lp bench learner --looped"
    assert target("x.json", {"command": "python benchmarks/run_packing.py --run <jaxrl-lp train dir>"}) \
        == "benchmarks/run_packing.py"
    assert target("train-h200.json", {"command": "jaxrl-lp train (the default), benchmarks/gpu.sh"}) \
        == "jaxrl-lp train"
    assert target("sampler-draw-before-noise-2core-cpu.json", {}) == "benchmarks/sampler_draw.py"
    assert target("gpu-h200.json", {}) == "benchmarks/gpu.sh"
    # A script that has left the tree is still the target of the JSONs it wrote.
    assert not (ROOT / "benchmarks" / "norm_grad.py").exists()
    assert target("norm-grad-2core-zen5.json", {}) == "benchmarks/norm_grad.py"
    assert target("replay-h200.json", {}) == "jaxrl-lp bench replay"


def test_headline_falls_back_to_top_level_scalars():
    data = {"preset": "p", "jax": "0.1", "seconds": 1.5, "nested": {"a": 2}, "rows": [1, 2]}
    lines = results.headline("benchmarks/unknown_script.py", data)
    text = "\n".join(lines)
    assert "`preset` | p" in text and "`seconds` | 1.5" in text and "`nested.a` | 2" in text
    assert "`jax`" not in text  # shown in the section's header
