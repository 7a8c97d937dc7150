"""Which Pallas kernels a program runs (imported by the kernel tests)."""

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr


def pallas_kernels(fn, *args, static_argnums=()) -> list[str]:
    """Names of the `pallas_call`s in the traced program of `fn(*args)`, nested programs included.

    A kernel inside a loop body or a custom derivative counts once per place it
    appears in the program, not per execution.
    """
    closed = jax.make_jaxpr(fn, static_argnums=static_argnums)(*args)
    names: list[str] = []
    _walk(closed.jaxpr, names)
    return names


def _walk(jaxpr: Jaxpr, names: list[str]) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(eqn.params["name"])
            continue  # the kernel body is not part of the host program
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, ClosedJaxpr):
                    _walk(sub.jaxpr, names)
                elif isinstance(sub, Jaxpr):
                    _walk(sub, names)
