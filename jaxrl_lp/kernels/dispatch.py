"""Which implementation of a hot path runs, resolved for the platform a program is lowered for.

A kernel module hands `by_platform` its plain-jnp reference and one `Version`
per platform it has a Pallas kernel for (`cuda`: Triton, `tpu`: Mosaic TPU).
What runs is decided by the policy's `kernels` field and, under `auto` and
`on`, by the platform the jitted program is lowered for: one traced program
carries every alternative in a `jax.lax.platform_dependent`, and lowering for
`cpu`, `cuda` or `tpu` keeps only that platform's (JAX drops the other
branches before they are lowered). The host's default backend plays no part,
so a CPU machine can lower, and CI can check, the exact program a GPU or a
TPU compiles.

| `Policy.kernels` | lowered for `cpu` | `cuda` | `tpu` |
|---|---|---|---|
| `auto` | reference | reference (3) | Mosaic TPU kernel (1) |
| `on` | error | error (3) | Mosaic TPU kernel (2) |
| `off` | reference | reference | reference |
| `interpret` | GPU version, interpreted | same | same |
| `interpret-tpu` | TPU version, interpreted | same | same |

(1) or the reference where the kernel's tile does not fit; (2) an error where
it does not fit. (3) The GPU versions (Pallas on its Triton backend) are
retired from compiled use (`RETIRED`): the backend is deprecated in JAX 0.11,
and compiled on an H200 the quantize kernels wrote wrong codes (NVFP4 at
production shapes, every MX format at a ragged shape), so a GPU program takes
the reference: XLA's own fusions, cuBLAS and cuDNN. The GPU versions stay
for `interpret` (their maths checked on CPU) until a Mosaic GPU port replaces
them (docs/design/kernels.md, "Kernels on GPU and TPU"). Inside `unretired()` a program
traced for a retired platform compiles our versions as `on` would: how the retired
kernels are measured against XLA's path on a GPU (`jaxrl-lp bench kernels --kernels
retired`), never how a run computes.
(`rocm` and any other platform take the reference under `auto` and are an
error under `on`: no version of ours is tested there.) The errors of `on` are
raised when the program is lowered for that platform (or at once, when the
call runs eagerly there), never while it is traced, so the same traced
program still lowers for the platforms that have the kernel. Interpreted
versions take any shape (Pallas interpret mode checks the maths, not the
tile rules), and run wherever the program is lowered: what the CPU tests
check.

The sampler and the learner hold equal policies when matched and trace the
same functions at the same shapes, so on each platform they take the same
implementation and the replay stays bit-equal to the sampler.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxrl_lp.numerics.policy import KERNEL_MODES, Policy, require

__all__ = ["KERNEL_PLATFORMS", "RETIRED", "KernelUnavailableError", "Version", "by_platform",
           "interpreting", "kernel_backend", "once_per_shape", "per_shard", "pow2_misfit",
           "refuse", "shard_count", "unretired"]

T = TypeVar("T")

# The platforms a kernel of ours has a compiled version for, and the Pallas backend of each.
KERNEL_PLATFORMS: dict[str, str] = {"tpu": "mosaic_tpu"}
# Platforms whose versions are not compiled any more (module table, (3)), and why.
RETIRED: dict[str, str] = {
    "cuda": "our GPU kernels are retired from compiled use (the Pallas Triton backend is "
            "deprecated in JAX 0.11, and compiled on an H200 the quantize kernels wrote wrong "
            "codes); a GPU program runs XLA's fusions, cuBLAS and cuDNN",
}


# Whether programs traced now compile the retired platforms' versions (`unretired`).
_UNRETIRED = contextvars.ContextVar("jaxrl_lp_unretired", default=False)


@contextlib.contextmanager
def unretired() -> Iterator[None]:
    """Within it, programs traced for a platform in `RETIRED` compile our versions there as
    they did before the retirement (`kernels=on`: the kernel where its tile fits, else the
    one-line error; `auto`: the kernel where it fits, else the reference).

    For measuring the retired kernels against XLA's path on the device itself (`jaxrl-lp
    bench kernels --kernels retired`): the decision is taken when a program is traced, so a
    program traced inside keeps it when it is compiled and called outside. No run and no
    library call enters it (a test lowers inside it, to check what the benchmark compiles).
    """
    token = _UNRETIRED.set(True)
    try:
        yield
    finally:
        _UNRETIRED.reset(token)


class KernelUnavailableError(ValueError):
    """`kernels=on` where the kernel has no version, or its tile does not fit the target."""


class Version(NamedTuple):
    """A kernel's version for one platform.

    `run(interpret)` traces it (`interpret`: Pallas interpret mode, for CPU
    checks). `misfit` says why the compiled kernel cannot take these shapes on
    the platform's target (a tile over its shared memory or VMEM, a block shape
    its compiler refuses), None when it can; an interpreted version runs anyway.
    """

    run: Callable[[bool], Any]
    misfit: str | None = None


# ----------------------------------------------------------------- the refusal: an error at lowering
_refusal_p = Primitive("jaxrl_lp_kernel_refusal")
_refusal_p.multiple_results = True


def _refusal_raise(*_, message: str, **__):
    raise KernelUnavailableError(message)


_refusal_p.def_impl(_refusal_raise)
_refusal_p.def_abstract_eval(lambda *avals, message: list(avals))
mlir.register_lowering(_refusal_p, _refusal_raise)
batching.primitive_batchers[_refusal_p] = (
    lambda args, dims, *, message: (_refusal_p.bind(*args, message=message), dims))


# Linear (an identity): its tangents and cotangents pass through it too, so a gradient
# that never reads the primal value still meets the refusal when it is lowered.
def _refusal_jvp(primals, tangents, *, message):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return _refusal_p.bind(*primals, message=message), _refusal_p.bind(*tangents, message=message)


def _refusal_transpose(cts, *args, message):
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    return _refusal_p.bind(*cts, message=message)


ad.primitive_jvps[_refusal_p] = _refusal_jvp
ad.primitive_transposes[_refusal_p] = _refusal_transpose


def refuse(message: str, value: T) -> T:
    """`value` unchanged, through an identity that raises `KernelUnavailableError(message)`
    when the program holding it is lowered (or when it runs eagerly).

    The branch of a platform a kernel cannot serve under `kernels=on` computes
    the reference and passes it through here: tracing succeeds (the other
    platforms' branches stay lowerable), lowering for this platform fails with
    one message naming the kernel, the platform and why.
    """
    leaves, tree = jax.tree.flatten(value)
    return jax.tree.unflatten(tree, _refusal_p.bind(*leaves, message=message))


def kernel_backend() -> str | None:
    """This host's own Pallas backend whose kernels are compiled (`tpu`), or None (CPU, and a
    GPU, whose versions are `RETIRED`).

    For benchmarks and tests that *run* compiled kernels on this machine (and
    so must know whether it can); never for choosing an implementation inside
    a program, which `by_platform` resolves for the platform lowered for.
    """
    return "tpu" if jax.default_backend() == "tpu" else None


# ----------------------------------------------------------------- the dispatch
def interpreting(policy: Policy | str) -> str | None:
    """The platform whose version `policy` (or a kernels mode, `KERNEL_MODES`) interprets
    (`cuda` for `interpret`, `tpu` for `interpret-tpu`), or None when it interprets none."""
    mode = policy if isinstance(policy, str) and policy in KERNEL_MODES \
        else require(policy, "interpreting").kernels
    return {"interpret": "cuda", "interpret-tpu": "tpu"}.get(mode)


def by_platform(name: str, policy: Policy, reference: Callable[[], T], *,
                cuda: Version | None = None, tpu: Version | None = None) -> T:
    """The value of kernel `name` under `policy` (module table), traced for every platform.

    Not jitted itself: called while a program is traced. Every branch is
    traced (so each must trace on any shapes it is given); lowering keeps one.

    Args:
      name: the kernel's name, for errors.
      policy: its `kernels` field picks the row of the module table.
      reference: the plain-jnp computation (no arguments: a closure).
      cuda: the kernel's `Version` for that platform, or None where it
        has none.
      tpu: as `cuda`, for TPU.

    Returns:
      What the chosen implementation returns (every branch returns the same
      pytree of shapes and dtypes).

    Raises:
      KernelUnavailableError: `interpret` / `interpret-tpu` of a kernel with no
        version to interpret (at once); `kernels=on` lowered for a platform
        with no version or with a misfit (at lowering, naming both).
    """
    mode = require(policy, f"kernel {name}").kernels
    versions = {"cuda": cuda, "tpu": tpu}
    if mode == "off":
        return reference()
    interpreted = interpreting(mode)
    if interpreted is not None:
        version = versions[interpreted]
        if version is None:
            raise KernelUnavailableError(
                f"kernel {name!r}: kernels={mode} interprets its {interpreted} version, and it "
                f"has none; use kernels=off or interpret the other platform's")
        return version.run(True)

    retired = {} if _UNRETIRED.get() else RETIRED

    def branch(platform: str):
        version = versions.get(platform)
        if version is not None and version.misfit is None and platform not in retired:
            return lambda: version.run(False)
        if mode == "auto":
            return reference
        if platform in retired:
            why = (f"kernel {name!r} (kernels=on) has no compiled version for {platform}: "
                   f"{RETIRED[platform]}; use kernels=auto (the same reference, by name), or "
                   "kernels=interpret to check our GPU version's maths on CPU")
        elif version is None:
            why = (f"kernel {name!r} (kernels=on) has no version for {platform}: ours compile "
                   f"for {' and '.join(p for p, v in versions.items() if v is not None) or 'no platform'}"
                   " (Pallas on CPU only interprets); use kernels=auto to run the jnp reference "
                   "there, or kernels=interpret to check the kernel on CPU")
        else:
            why = (f"kernel {name!r} (kernels=on) does not fit {platform}: {version.misfit}; use "
                   "kernels=auto to run the jnp reference for these shapes, or smaller tiles")
        return lambda: refuse(why, reference())

    return jax.lax.platform_dependent(cpu=branch("cpu"), cuda=branch("cuda"), tpu=branch("tpu"),
                                      default=branch("rocm or another platform"))


def per_shard(fn: Callable, in_axes: tuple, out_axes: Any) -> Callable:
    """`fn` run on each device's shard of its operands under the active mesh, else `fn`.

    A Pallas kernel is one custom call that XLA's SPMD partitioner cannot split:
    on TPU a kernel in a sharded program must sit in a `shard_map` (Mosaic
    refuses automatic partitioning), and on GPU the partitioner would gather
    every operand onto every device and run the whole kernel there. Under
    `parallel.context.use_mesh` each kernel version is therefore wrapped in
    `jax.shard_map` with the specs its operands' logical axes give
    (`parallel.rules.spec_for`; None: whole on every device). Gradients of a
    replicated operand are summed over the devices by `shard_map`'s transpose,
    so a kernel's custom VJP stays per shard.

    Args:
      fn: the kernel version, a function of the operands.
      in_axes: per operand, a tuple of logical axis names (or None entries), or
        None for an operand whole on every device.
      out_axes: the same for the outputs (a pytree of tuples, like `fn`'s).
    """
    from jaxrl_lp.parallel.context import current_mesh
    from jaxrl_lp.parallel.rules import spec_for

    active = current_mesh()
    if active is None:
        return fn
    mesh, rules = active
    whole = jax.sharding.PartitionSpec()
    spec = lambda axes: whole if axes is None else spec_for(axes, rules, mesh)
    is_axes = lambda x: x is None or (isinstance(x, tuple) and all(
        a is None or isinstance(a, str) for a in x))
    ins = tuple(spec(a) for a in in_axes)
    outs = jax.tree.map(spec, out_axes, is_leaf=is_axes)

    def split(*args):
        # A dimension its mesh axes do not divide (a micro-batch of fewer rows than shards)
        # cannot be split by `shard_map`: then every device runs the whole kernel.
        if all(_divides(mesh, p, jnp.shape(x)) for p, x in zip(ins, args, strict=True)):
            return jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs,
                                 check_vma=False)(*args)
        return jax.shard_map(fn, mesh=mesh, in_specs=(whole,) * len(args),
                             out_specs=jax.tree.map(lambda _: whole, outs), check_vma=False)(*args)

    return split


def _divides(mesh, spec, shape) -> bool:
    """Whether every sharded dimension of `shape` divides by its mesh axes under `spec`."""
    for dim, axes in zip(shape, tuple(spec), strict=False):
        names = () if axes is None else (axes,) if isinstance(axes, str) else axes
        size = 1
        for name in names:
            size *= mesh.shape[name]
        if dim % size:
            return False
    return True


def _trace_context() -> tuple:
    """What a kernel's trace reads besides its arguments: the active mesh and rules
    (`per_shard`), the kernel targets its tiles are planned for (`kernels.targets`) and
    whether the retired versions compile (`unretired`). How low precision is stored is the
    policy's, a static argument (`numerics.policy`)."""
    from jaxrl_lp.kernels.targets import current_target
    from jaxrl_lp.parallel.context import current_mesh

    return (current_mesh(), current_target("cuda").name, current_target("tpu").name,
            _UNRETIRED.get())


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _traced_once(fn, static: tuple, context: tuple, *arrays):
    del context  # a cache key only: read again by `fn` while it is traced
    return fn(*arrays, **dict(static))


def once_per_shape(fn: Callable, *arrays, **static):
    """`fn(*arrays, **static)` as a nested `jax.jit`, cached by `fn`, the static arguments,
    the arrays' shapes and dtypes, and the trace context (mesh, kernel targets, `unretired`).

    A kernel called once per layer (a quantized matmul, a decode step's attention) is
    then traced once per distinct shape and lowered once per platform (JAX lowers a
    repeated nested jit once and calls it), instead of once per call site with every
    platform's version each time: what kept a 28-layer decode step's MXFP8 lowering at
    tens of seconds. `fn` is module-level and the static values hashable. XLA inlines
    the call, so the compiled program is the same.
    """
    return _traced_once(fn, tuple(sorted(static.items())), _trace_context(), *arrays)


def shard_count(logical: str) -> int:
    """How many shards the active mesh splits logical axis `logical` into (1 without a mesh):
    a kernel under `per_shard` plans its tiles for its own shard's size."""
    from jaxrl_lp.parallel.context import current_mesh

    active = current_mesh()
    if active is None:
        return 1
    mesh, rules = active
    n = 1
    for axis in rules.mesh_axes(logical):
        n *= mesh.shape[axis]
    return n


def pow2_misfit(minimum: int = 16, **dims: int) -> str | None:
    """The first of `dims` that a Triton block cannot take, or None.

    Triton blocks are powers of two, and a `dot` needs every operand dimension
    >= 16 (the default `minimum`); a compiled GPU kernel's block shapes are
    checked with this.
    """
    for dim_name, n in dims.items():
        if n < minimum or n & (n - 1):
            return f"{dim_name}={n} is not a power of two >= {minimum}"
    return None
