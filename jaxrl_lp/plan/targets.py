"""Accelerator peak figures for the roofline of `jaxrl-lp plan`, with their sources.

Each figure is per chip, from the vendor's public data sheet: dense (not
2:4-sparse) bf16 matmul throughput, HBM bandwidth and HBM capacity.

| target | dense bf16 | HBM bandwidth | HBM | source |
|---|---|---|---|---|
| `h100` | 989 TFLOP/s | 3.35 TB/s | 80 GB | NVIDIA H100 data sheet, SXM column |
| `h200` | 989 TFLOP/s | 4.8 TB/s | 141 GB | NVIDIA H200 data sheet, SXM column |
| `b200` | 2.25 PFLOP/s | 8 TB/s | 180 GB | NVIDIA DGX/HGX B200 data sheets, per GPU |
| `tpu-v5e` | 197 TFLOP/s | 0.819 TB/s | 16 GB | Google Cloud TPU v5e documentation |
| `tpu-v5p` | 459 TFLOP/s | 2.765 TB/s | 95 GB | Google Cloud TPU v5p documentation |
| `tpu-v6e` | 918 TFLOP/s | 1.64 TB/s | 32 GB | Google Cloud TPU v6e (Trillium) documentation |

NVIDIA's sheets give bf16 "with sparsity" (2:4): the dense figure is half of
it. The B200 figures are the 8-GPU system totals divided by 8.

The data sheets quote FP8 (and B200 FP4) throughput too; the plan does not
use them: our low-precision policies quantize matmul operands (fake quant with
straight-through gradients) and multiply in bf16, so bf16 is the peak they run
at. Memory sizes are decimal (GB = 1e9 bytes), as the data sheets give them.
Each target names the platform its programs are lowered for (`cuda`, `tpu`):
`jaxrl-lp plan` lowers every program for it too (`plan.planner`), with the
kernel tiles planned for that chip (`kernels.targets`, the same names).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["TARGETS", "Target", "get_target", "target_of_device"]


class Target(NamedTuple):
    """Peak figures of one accelerator chip."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float  # HBM capacity, bytes
    source: str
    platform: str = "cuda"  # the JAX lowering platform of its programs


# The accelerators `jaxrl-lp plan --target` knows, by name (peak FLOP/s, bandwidth, memory).
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("h100", 989e12, 3.35e12, 80e9,
           "NVIDIA H100 Tensor Core GPU data sheet (H100 SXM: BF16 1,979 TFLOPS with sparsity, "
           "half dense; 3.35 TB/s; 80 GB)"),
    Target("h200", 989e12, 4.8e12, 141e9,
           "NVIDIA H200 Tensor Core GPU data sheet (H200 SXM: BF16 1,979 TFLOPS with sparsity, "
           "half dense; 4.8 TB/s; 141 GB)"),
    Target("b200", 2.25e15, 8e12, 180e9,
           "NVIDIA DGX B200 / HGX B200 data sheets (per GPU: BF16 4.5 PFLOPS with sparsity, "
           "half dense; 8 TB/s; 1,440 GB / 8 GPUs)"),
    Target("tpu-v5e", 197e12, 0.819e12, 16e9,
           "Google Cloud TPU v5e documentation (per chip: 197 TFLOPS bf16; 819 GB/s; 16 GiB "
           "HBM2, taken as 16e9 bytes)", "tpu"),
    Target("tpu-v5p", 459e12, 2.765e12, 95e9,
           "Google Cloud TPU v5p documentation (per chip: 459 TFLOPS bf16; 2,765 GB/s; 95 GiB "
           "HBM2e, taken as 95e9 bytes)", "tpu"),
    Target("tpu-v6e", 918e12, 1.64e12, 32e9,
           "Google Cloud TPU v6e documentation (per chip: 918 TFLOPS bf16; 1,640 GB/s; 32 GB "
           "HBM)", "tpu"),
)}


def target_of_device(device_kind: str) -> Target | None:
    """The target whose name JAX's device kind contains (`NVIDIA H200` is `h200`), or None."""
    kind = device_kind.lower().replace("-", " ")
    return next((t for t in TARGETS.values() if t.name.replace("-", " ") in kind), None)


def get_target(name: str) -> Target:
    """The `Target` called `name`.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {sorted(TARGETS)}")
    return TARGETS[name]
