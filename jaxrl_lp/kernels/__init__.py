"""Pallas kernels for the hot paths, each beside its plain-jnp reference (`dispatch`)."""

from jaxrl_lp.kernels.dispatch import Choice, KernelUnavailableError, choose, kernel_backend

__all__ = ["Choice", "KernelUnavailableError", "choose", "kernel_backend"]
