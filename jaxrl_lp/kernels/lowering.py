"""Lowering a program for a platform this host does not have, and reading its kernels back.

JAX lowers for any platform from any host: `jit(f).trace(*args)` traces once
(the kernel dispatch keeps every platform's alternative, `kernels.dispatch`),
and `.lower(lowering_platforms=(p,))` emits the StableHLO a `p` compiler gets,
Pallas kernels included (Triton IR for `cuda`, Mosaic for `tpu`). Nothing is
allocated or run, so abstract inputs (`jax.ShapeDtypeStruct`) of any size do.
What this proves: the program and its kernels pass every check JAX makes while
lowering (block shapes, dtypes, Mosaic's TPU rules), Triton's own dialect
verifier on every GPU kernel (`_verified_triton`: JAX does not run it), and
through `kernels.targets` our shared-memory and VMEM budgets; what it cannot:
the device compilers' own passes (Triton's PTX generation and its real
shared-memory count, Mosaic's layout passes on a TPU), which only a device runs.

Mosaic TPU asks for the chip while lowering (its lane and sublane counts):
`lower_for` answers with the target's (`_tpu_device`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

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
    """Mosaic TPU asks for the chip's info (lanes, sublanes, generation) while lowering, of the
    device the program is for: from a CPU host, and inside a `shard_map` over CPU devices,
    that device is a CPU. JAX's TPU info registry (`tpu_info.registry`, keyed by device
    kind) is its hook for kinds it does not know: within the block, "cpu" answers as the
    target chip. (A private JAX module: the JAX versions this is tested with are the ones
    `pyproject.toml` admits.)"""
    from jax._src.pallas.mosaic import tpu_info

    chip = tpu_info.chip_version_from_device_kind(kind)
    if chip is None:
        raise ValueError(f"JAX knows no TPU chip of device kind {kind!r}")
    before = tpu_info.registry.get("cpu")
    tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(chip, 1)
    tpu_info.get_tpu_info.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del tpu_info.registry["cpu"]
        else:
            tpu_info.registry["cpu"] = before
        tpu_info.get_tpu_info.cache_clear()


@contextlib.contextmanager
def _verified_triton():
    """Runs Triton's dialect verifier on every kernel lowered for cuda in the block.

    JAX emits the Triton IR without verifying it, so a type Triton has no
    tensors of (float4, E8M0) or a malformed op lowers from a CPU and fails
    only in a GPU's compiler; the verifier (in jaxlib's Triton bindings)
    catches those here. (JAX's private Pallas Triton module: the JAX versions
    `pyproject.toml` admits.)"""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lowering = registration.lowering
    lower = lowering.lower_jaxpr_to_triton_module

    def verified(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises on what Triton's compiler would refuse
        return result

    lowering.lower_jaxpr_to_triton_module = verified
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = lower


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
        if platform == "cuda":
            stack.enter_context(_verified_triton())
        return traced.lower(lowering_platforms=(platform,)).as_text()


def kernel_calls(text: str, platform: str) -> list[str]:
    """Names of the Pallas kernels in a module lowered for `platform`: one per kernel call in its
    text (a kernel under `dispatch.once_per_shape` is lowered once per shape and called from
    every site, so it counts once)."""
    pattern = _KERNEL_NAME.get(platform)
    if pattern is None:
        return []
    return [m.group(1) for line in text.splitlines() for m in [pattern.search(line)] if m]
