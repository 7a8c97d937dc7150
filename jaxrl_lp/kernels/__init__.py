"""Pallas kernels for the hot paths, each beside its plain-jnp reference, resolved for the
platform a program is lowered for (`dispatch`), with tile budgets per accelerator (`targets`)
and lowering for GPU and TPU from any host (`lowering`)."""

from jaxrl_lp.kernels.dispatch import (
    KERNEL_PLATFORMS,
    KernelUnavailableError,
    Version,
    by_platform,
    kernel_backend,
    per_shard,
)
from jaxrl_lp.kernels.lowering import kernel_calls, lower_for, trace_for
from jaxrl_lp.kernels.targets import KERNEL_TARGETS, KernelTarget, for_target

__all__ = ["KERNEL_PLATFORMS", "KERNEL_TARGETS", "KernelTarget", "KernelUnavailableError", "Version",
           "by_platform", "for_target", "kernel_backend", "kernel_calls", "lower_for", "per_shard",
           "trace_for"]
