"""Lowering a program for a platform this host does not have, and reading its kernels back.

JAX lowers for any platform from any host: `jit(f).trace(*args)` traces once
(the kernel dispatch keeps every platform's alternative, `kernels.dispatch`),
and `.lower(lowering_platforms=(p,))` emits the StableHLO a `p` compiler gets,
Pallas kernels included (Triton IR for `cuda`, Mosaic for `tpu`). Nothing is
allocated or run, so abstract inputs (`jax.ShapeDtypeStruct`) of any size do.
What this proves: the program and its kernels pass every check JAX makes while
lowering (block shapes, dtypes, Mosaic's TPU rules, and through
`kernels.targets` our own shared-memory and VMEM budgets); what it cannot: the
device compiler's own passes (Triton's PTX generation, Mosaic's layout passes
on a TPU), which only a device runs.

Mosaic TPU asks for the chip while lowering (its lane and sublane counts):
`lower_for` gives it the target's device kind through an abstract mesh.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from jaxrl_lp.kernels.targets import KERNEL_TARGETS, current_target, for_target

__all__ = ["LOWERING_PLATFORMS", "kernel_calls", "lower_for", "trace_for"]

LOWERING_PLATFORMS = ("cpu", "cuda", "tpu")
# A Pallas kernel's name in the lowered module: Triton's backend config carries `name`,
# Mosaic TPU's custom call `kernel_name`.
_KERNEL_NAME = {
    "cuda": re.compile(r'@__gpu\$xla\.gpu\.triton\(.*?\bname = "([^"]*)"'),
    "tpu": re.compile(r'@tpu_custom_call\(.*?\bkernel_name = "([^"]*)"'),
}


@contextlib.contextmanager
def _tpu_device(kind: str):
    """Mosaic TPU reads the chip from the abstract mesh's device while lowering."""
    device = AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("_chip",), (AxisType.Auto,),
                                        abstract_device=device)):
        yield


@contextlib.contextmanager
def _targets(targets: Iterable[str]):
    with contextlib.ExitStack() as stack:
        for name in targets:
            stack.enter_context(for_target(name))
        yield


def trace_for(fn: Callable, args: Sequence[Any], targets: Iterable[str] = ()):
    """`jax.jit(fn).trace(*args)` with kernel tiles planned for `targets` (one per platform).

    `fn` may already be jitted (its static arguments bound); the trace is what
    `lower_for` lowers, once per platform.
    """
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    with _targets(targets):
        return jitted.trace(*args)


def lower_for(traced, platform: str, target: str | None = None) -> str:
    """The StableHLO text of a `trace_for` result (or a function and its args) lowered for
    `platform` (`cpu`, `cuda`, `tpu`); for `tpu` Mosaic is told `target`'s chip (default
    the smallest-VMEM TPU target, `kernels.targets.current_target`).

    Raises:
      ValueError (or `KernelUnavailableError`): whatever lowering for `platform`
        raises: a kernel under `kernels=on` with no version or a tile over the
        target's limit there, a block shape Mosaic refuses, a dtype Triton
        cannot take.
    """
    if platform not in LOWERING_PLATFORMS:
        raise ValueError(f"platform {platform!r}: choose one of {list(LOWERING_PLATFORMS)}")
    if isinstance(traced, tuple):  # (fn, args)
        traced = trace_for(*traced, targets=[target] if target else [])
    with contextlib.ExitStack() as stack:
        if platform == "tpu":
            t = KERNEL_TARGETS[target] if target else current_target("tpu")
            stack.enter_context(_tpu_device(t.device_kind))
        return traced.lower(lowering_platforms=(platform,)).as_text()


def kernel_calls(text: str, platform: str) -> list[str]:
    """Names of the Pallas kernels a module lowered for `platform` calls, one per call site."""
    pattern = _KERNEL_NAME.get(platform)
    if pattern is None:
        return []
    return [m.group(1) for line in text.splitlines() for m in [pattern.search(line)] if m]
