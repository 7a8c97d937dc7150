"""Our Mosaic GPU kernels compiled deviceless for Hopper (`plan.cuda_aot.mosaic_kernels`,
`benchmarks/mosaic_aot.py`): ptxas's report read back, and, where a CUDA PJRT plugin is
installed (`$JAXRL_LP_CUDA_PLUGIN`), both kernels compiled for an H200 with no register
spilled. CI has no plugin: there the parser and the script's refusal run, the compile skips.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_lp.bench.mosaic_aot import CELLS
from jaxrl_lp.plan import cuda_aot
from jaxrl_lp.plan.cuda_aot import PLUGIN_ENV, mosaic_kernels, plugin_from_env

ROOT = Path(__file__).resolve().parents[1]
# What the child prints with MOSAIC_GPU_DUMP_PTXAS (two kernels; the HLO text after them).
PTXAS = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 151 by compiler
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fixed_tile_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for fixed_tile_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 58 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 49.574 ms
ptxas info    : Compiling entry function 'logprob_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for logprob_fwd_mosaic_gpu_kernel
    8 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers
HloModule jit_f, entry_computation_layout={(bf16[32,1024]{1,0})->f32[32,3072]{1,0}}
"""


def test_ptxas_reports_are_read_per_kernel(monkeypatch):
    monkeypatch.setattr(cuda_aot, "_run_child", lambda *a, **k: PTXAS)
    got = mosaic_kernels("m:build", {}, "h200", "/nowhere")
    assert got == [
        {"kernel": "fixed_tile", "arch": "sm_90a", "stack_bytes": 0, "spill_store_bytes": 0,
         "spill_load_bytes": 0, "registers": 58, "barriers": 2, "static_smem_bytes": 1},
        {"kernel": "logprob_fwd", "arch": "sm_90a", "stack_bytes": 8, "spill_store_bytes": 16,
         "spill_load_bytes": 12, "registers": 255, "barriers": 2, "static_smem_bytes": 0}]
    monkeypatch.setattr(cuda_aot, "_run_child", lambda *a, **k: "HloModule jit_f\n")
    assert mosaic_kernels("m:build", {}, "h200", "/nowhere") == []


def test_the_script_without_a_plugin_is_one_clear_line():
    env = {k: v for k, v in os.environ.items() if k != PLUGIN_ENV}
    res = subprocess.run([sys.executable, "benchmarks/mosaic_aot.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "mosaic_aot: no CUDA PJRT plugin: pass --cuda-plugin DIR or set $JAXRL_LP_CUDA_PLUGIN "
        "(module docstring: how to install one)"]


@pytest.mark.skipif(not os.environ.get(PLUGIN_ENV), reason=f"no CUDA PJRT plugin (${PLUGIN_ENV})")
@pytest.mark.parametrize("cell, kernel, count", [
    ("fixed_tile_1024x3072", "fixed_tile", 1), ("logprob_fwd_qwen3-0.6b", "logprob_fwd", 1),
    ("decode_step_fixed_tiles_qwen3-0.6b", "fixed_tile", 7)])
def test_each_mosaic_kernel_compiles_for_an_h200_without_spilling(cell, kernel, count):
    """The whole device compile, ptxas included, for sm_90a on this host: the cell's kernels
    (a decode step in fixed tiles: ptxas reports 7 compiles for the 19 kernel calls of its 2
    layers and head), each within Hopper's 255 registers a thread, nothing spilled."""
    got = mosaic_kernels("jaxrl_lp.bench.mosaic_aot:build", CELLS[cell], "h200",
                         plugin_from_env())
    assert [k["kernel"] for k in got] == [kernel] * count, got
    assert all(k["arch"] == "sm_90a" and k["registers"] <= 255 and k["spill_store_bytes"] == 0
               for k in got), got
