"""The on-chip memory one kernel program may use on each accelerator, and the target a trace is for.

A tile plan is checked against its target's limit before its kernel is traced
(`budget_misfit`): under `kernels=auto` a plan that does not fit is replaced by
one that does, or the reference runs; under `kernels=on` it is an error naming
the tile, the need and the limit (`kernels.dispatch`).

| target | platform | limit per kernel program |
|---|---|---|
| `h100`, `h200` | cuda | 227 KiB of shared memory per thread block (1) |
| `b200` | cuda | 227 KiB of shared memory per thread block (1) |
| `tpu-v5e`, `tpu-v5p` | tpu | 16 MiB of VMEM, the default scoped limit (2) |
| `tpu-v6e` | tpu | 32 MiB of VMEM, the default scoped limit (2) |

(1) CUDA C++ Programming Guide, technical specifications per compute
capability: 227 KB per thread block (opt-in) for 9.0 (Hopper) and 10.0
(Blackwell); JAX's Mosaic GPU lowering refuses kernels over the same 232,448
bytes. (2) Pallas TPU documentation and XLA's error 1001 page: a kernel gets
the scoped VMEM limit (`--xla_tpu_scoped_vmem_limit_kib`, or a kernel's
`vmem_limit_bytes`), 16 MiB by default on v5 chips and 32 MiB on v6e, out of
128 MiB (v5e, v6e) or 64 MiB per core (v5p) physical
(`jax._src.pallas.mosaic.tpu_info`).

Our TPU plans stay within the default scoped limit, so no kernel raises it
(`vmem_limit_bytes` would also need the XLA flag). The target of a trace is,
in order: the one set by `for_target` (what `jaxrl-lp plan --target` and the
lowering checks set), the host's own accelerator when it is of the platform
being planned for, else the known target of that platform with the smallest
limit (a plan that fits it fits them all). Sampler and learner trace under
the same target and so pick the same tiles.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

__all__ = ["KERNEL_TARGETS", "KernelTarget", "budget_misfit", "current_target", "for_target",
           "format_bytes", "host_target"]

KIB, MIB = 1024, 1024 * 1024


class KernelTarget(NamedTuple):
    """One accelerator's limit on what a kernel program holds on chip."""

    name: str  # as `jaxrl-lp plan --target` spells it
    platform: str  # the JAX lowering platform: `cuda` or `tpu`
    device_kind: str  # JAX's `Device.device_kind` (matched by substring for GPUs)
    memory: str  # `shared memory` (per thread block) or `VMEM` (scoped, per kernel)
    limit_bytes: int
    source: str


_GPU_SOURCE = ("CUDA C++ Programming Guide, technical specifications per compute capability: "
               "227 KB of shared memory per thread block (opt-in) on {cc}")
_TPU_SOURCE = ("Pallas TPU docs and XLA error 1001: the default scoped VMEM limit, {scoped}, of "
               "{physical} physical (jax tpu_info)")

# The accelerators tile plans are checked against, by `jaxrl-lp plan --target` name.
KERNEL_TARGETS: dict[str, KernelTarget] = {t.name: t for t in (
    KernelTarget("h100", "cuda", "H100", "shared memory", 227 * KIB,
                 _GPU_SOURCE.format(cc="compute capability 9.0")),
    KernelTarget("h200", "cuda", "H200", "shared memory", 227 * KIB,
                 _GPU_SOURCE.format(cc="compute capability 9.0")),
    KernelTarget("b200", "cuda", "B200", "shared memory", 227 * KIB,
                 _GPU_SOURCE.format(cc="compute capability 10.0")),
    KernelTarget("tpu-v5e", "tpu", "TPU v5 lite", "VMEM", 16 * MIB,
                 _TPU_SOURCE.format(scoped="16 MiB", physical="128 MiB")),
    KernelTarget("tpu-v5p", "tpu", "TPU v5", "VMEM", 16 * MIB,
                 _TPU_SOURCE.format(scoped="16 MiB", physical="64 MiB per core")),
    KernelTarget("tpu-v6e", "tpu", "TPU v6 lite", "VMEM", 32 * MIB,
                 _TPU_SOURCE.format(scoped="32 MiB", physical="128 MiB")),
)}

_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxrl_lp_kernel_target",
                                                                     default=None)


@contextlib.contextmanager
def for_target(name: str):
    """Traces inside this context plan their kernels for target `name` (module docstring).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name not in KERNEL_TARGETS:
        raise ValueError(f"unknown kernel target {name!r}; choose one of {sorted(KERNEL_TARGETS)}")
    token = _CURRENT.set(name)
    try:
        yield KERNEL_TARGETS[name]
    finally:
        _CURRENT.reset(token)


def host_target(platform: str | None = None) -> KernelTarget | None:
    """The known target the host's first device is (of `platform`, when given), or None."""
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    plat = "cuda" if device.platform in ("gpu", "cuda") else device.platform
    if platform is not None and plat != platform:
        return None
    platform = plat
    kind = device.device_kind
    for t in KERNEL_TARGETS.values():
        if t.platform == platform and (kind == t.device_kind if platform == "tpu"
                                       else t.device_kind in kind):
            return t
    # A TPU spelled another way ("TPU v5p", "TPU v6e"): its generation's entry.
    for alias, name in (("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"), ("v6", "tpu-v6e"), ("v5", "tpu-v5p")):
        if platform == "tpu" and alias in kind:
            return KERNEL_TARGETS[name]
    return None


def current_target(platform: str) -> KernelTarget:
    """The target kernels lowered for `platform` are planned for (module docstring)."""
    name = _CURRENT.get()
    if name is not None and KERNEL_TARGETS[name].platform == platform:
        return KERNEL_TARGETS[name]
    host = host_target(platform)
    if host is not None:
        return host
    known = [t for t in KERNEL_TARGETS.values() if t.platform == platform]
    if not known:
        raise ValueError(f"no kernel target is known for platform {platform!r}")
    return min(known, key=lambda t: t.limit_bytes)


def format_bytes(n: int) -> str:
    """`n` bytes as KiB or MiB, one decimal."""
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / KIB:.1f} KiB"


def budget_misfit(platform: str, need_bytes: int, tile: str) -> str | None:
    """Why `tile` (a description of the tile plan) does not fit `platform`'s current target,
    or None when its `need_bytes` of on-chip memory are within the target's limit."""
    t = current_target(platform)
    if need_bytes <= t.limit_bytes:
        return None
    return (f"the tile {tile} needs {format_bytes(need_bytes)} of {t.memory} per kernel "
            f"program, over {t.name}'s limit of {format_bytes(t.limit_bytes)}")
