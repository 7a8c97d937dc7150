"""Pallas kernels for the hot paths, each beside its plain-jnp reference, dispatched by the
platform a program is lowered for (`dispatch`), with tile budgets per target (`targets`)."""

from jaxrl_lp.kernels.dispatch import KERNEL_PLATFORMS, KernelUnavailableError, Version, by_platform

__all__ = ["KERNEL_PLATFORMS", "KernelUnavailableError", "Version", "by_platform"]
