"""Which implementation of a hot path runs: the Pallas kernel, the kernel interpreted, or the
plain-jnp reference, decided by the policy's `kernels` field and the backend.

| `Policy.kernels` | GPU / TPU | CPU |
|---|---|---|
| `auto` | kernel | reference |
| `on` | kernel | error (Pallas compiles for GPU and TPU only) |
| `off` | reference | reference |
| `interpret` | kernel, interpreted | kernel, interpreted (what the CPU tests check) |

Every kernel module exposes one entry point that takes the policy and calls
`choose(policy, name)`; the sampler and the learner hold equal policies when
matched, so they take the same implementation and stay bit-equal.
"""

from __future__ import annotations

from typing import Literal

import jax

from jaxrl_lp.numerics.policy import Policy

__all__ = ["Choice", "KernelUnavailableError", "choose", "kernel_backend", "pow2_misfit",
           "within_limits"]

Choice = Literal["kernel", "interpret", "reference"]


class KernelUnavailableError(ValueError):
    """`kernels=on` on a backend that cannot compile the Pallas kernel."""


def kernel_backend() -> str | None:
    """The backend Pallas compiles for here (`gpu`, `tpu`), or None."""
    backend = jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "tpu" if backend == "tpu" else None


def choose(policy: Policy | str, name: str) -> Choice:
    """The implementation of kernel `name` under `policy` on this backend (module table).

    Raises:
      KernelUnavailableError: `kernels=on` where no Pallas backend is.
    """
    mode = Policy.parse(policy).kernels
    if mode == "off":
        return "reference"
    if mode == "interpret":
        return "interpret"
    if kernel_backend() is not None:
        return "kernel"
    if mode == "on":
        raise KernelUnavailableError(
            f"kernel {name!r}: the policy asks for it (kernels=on) but the {jax.default_backend()} "
            "backend cannot compile Pallas kernels (GPU and TPU can); use kernels=auto to run "
            "the jnp reference here, or kernels=interpret to check the kernel on CPU")
    return "reference"


def pow2_misfit(minimum: int = 16, **dims: int) -> str | None:
    """The first of `dims` that the GPU (Triton) lowering cannot take, or None.

    Triton blocks are powers of two, and a `dot` needs every operand dimension
    >= 16 (the default `minimum`); a compiled kernel's block shapes are
    checked with this.
    """
    for dim_name, n in dims.items():
        if n < minimum or n & (n - 1):
            return f"{dim_name}={n} is not a power of two >= {minimum}"
    return None


def within_limits(choice: Choice, policy: Policy | str, name: str, misfit: str | None) -> Choice:
    """`choice`, or the reference where a compiled kernel cannot take these shapes.

    `misfit` is why the compiled kernel does not fit (e.g. `pow2_misfit`'s
    answer), None when it does. Under `kernels=auto` a misfit runs the
    reference (the same maths; sampler and learner see the same shapes and so
    make the same choice); under `kernels=on` it is an error naming the shape.
    Interpreted kernels take any shape.
    """
    if choice != "kernel" or misfit is None:
        return choice
    if Policy.parse(policy).kernels == "on":
        raise KernelUnavailableError(
            f"kernel {name!r} (kernels=on) cannot compile for these shapes: {misfit}; use "
            "kernels=auto to run the jnp reference for them")
    return "reference"
