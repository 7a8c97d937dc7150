"""What a program hands a platform's compiler on its hot path, read from its jaxpr.

Two questions a profile on the device would answer late and this answers on
any host, at a model's real size, from the traced program (`jit(...).trace`
on abstract inputs, as `plan.programs` builds them):

- `loop_weight_reads`: inside the sampler's decode loop (its `while`), in
  which dtypes are the weights read, and does the loop convert a weight
  (an f32 master rounded to bf16 on every step would read 4 bytes a
  parameter and write 2 more, where the bound reads 2)?
- `dots`: every matrix product with its operand dtypes, precision and
  FLOPs; on the learner's bf16 path a product with an f32 operand is an f32
  GEMM on a GPU (no bf16 tensor cores), and `HIGHEST` on bf16 operands asks
  for more than they hold.

The jaxpr keeps every platform's alternative (`lax.platform_dependent`: a
`platform_index` choosing a `cond` branch); the walk takes the branch the
named platform runs, as lowering for it does. Pallas kernels' bodies are not
entered: their products are the kernel's own (`kernel` counts them).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["Dot", "LoopReads", "dot_summary", "dots", "loop_weight_reads", "walk"]

_KERNELS = ("pallas_call",)


def _subjaxprs(eqn) -> Iterator[Any]:
    for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
            j = getattr(sub, "jaxpr", sub)
            if hasattr(j, "eqns"):
                yield j


def _branch_for(platform: str, platforms) -> int:
    """The branch index `platform_index` gives for `platform` (the last one is the default)."""
    for i, names in enumerate(platforms):
        if names is not None and platform in names:
            return i
    return len(platforms) - 1


def _known(outer, inner, chosen: dict) -> dict:
    """`chosen`'s platform indices passed from `outer` operands to a sub-jaxpr's `inner`
    inputs (positionally): an index computed outside a scan or a call is read inside it."""
    out = {}
    for o, i in zip(outer, inner, strict=False):
        try:
            if o in chosen:
                out[i] = chosen[o]
        except TypeError:  # a literal operand: no index
            pass
    return out


def _inputs(eqn, sub) -> list:
    """The operands of `eqn` that `sub` (one of its sub-jaxprs) takes as its inputs."""
    ins = list(eqn.invars)
    if eqn.primitive.name == "while":
        nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        return ins[:nc] + ins[nc + nb:] if sub is eqn.params["cond_jaxpr"].jaxpr else ins[nc:]
    if eqn.primitive.name == "cond":
        return ins[1:]
    return ins if len(ins) == len(sub.invars) else []


def walk(jaxpr, platform: str, *, in_loop: bool = False, times: int = 1,
         chosen: dict | None = None) -> Iterator[tuple[Any, bool, int]]:
    """Every equation `platform` runs, with whether it is inside a `while` body and how many
    times it runs (the product of its enclosing `scan`s' lengths; a `while` body counts once,
    for one iteration).

    A `cond` on a `platform_index` (`lax.platform_dependent`) is entered at `platform`'s
    branch only, also where the index was computed outside the scan, loop or call that
    holds the `cond` (`chosen`: the indices known at entry). Kernels (`pallas_call`) are
    yielded, not entered.
    """
    chosen = dict(chosen or {})
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "platform_index":
            chosen[eqn.outvars[0]] = _branch_for(platform, eqn.params["platforms"])
        yield eqn, in_loop, times
        if name in _KERNELS:
            continue
        if name == "cond" and eqn.invars and eqn.invars[0] in chosen:
            branch = eqn.params["branches"][chosen[eqn.invars[0]]].jaxpr
            yield from walk(branch, platform, in_loop=in_loop, times=times,
                            chosen=_known(_inputs(eqn, branch), branch.invars, chosen))
            continue
        loop = in_loop or name == "while"
        inner = times * eqn.params["length"] if name == "scan" else times
        for sub in _subjaxprs(eqn):
            yield from walk(sub, platform, in_loop=loop, times=inner,
                            chosen=_known(_inputs(eqn, sub), sub.invars, chosen))


@dataclasses.dataclass(frozen=True)
class Dot:
    """One matrix product: operand dtypes, precision, output dtype, inside a `while` loop;
    `flops` as it runs (times its enclosing `scan`s' lengths: a layer scan's product counts
    once a layer; in a `while` body, once an iteration)."""

    lhs: str
    rhs: str
    precision: str
    out: str
    flops: int
    in_loop: bool

    @property
    def f32_operand(self) -> bool:
        return "float32" in (self.lhs, self.rhs)

    @property
    def mixed(self) -> bool:
        """An f32 operand with a low-precision one: an f32 product of low-precision data."""
        return self.f32_operand and self.lhs != self.rhs

    @property
    def highest(self) -> bool:
        return "HIGHEST" in self.precision


def _dot(eqn, in_loop: bool, times: int) -> Dot:
    a, b = (v.aval for v in eqn.invars[:2])
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    contracted = int(np.prod([a.shape[i] for i in lc], dtype=np.int64))
    out = eqn.outvars[0].aval
    prec = eqn.params.get("precision")
    return Dot(str(a.dtype), str(b.dtype), str(prec[0] if isinstance(prec, tuple) else prec),
               str(out.dtype), times * int(2 * contracted * np.prod(out.shape, dtype=np.int64)),
               in_loop)


def dots(jaxpr, platform: str) -> list[Dot]:
    """The products `platform` runs outside kernels, in program order."""
    return [_dot(e, loop, times) for e, loop, times in walk(jaxpr, platform)
            if e.primitive.name == "dot_general"]


def dot_summary(found: list[Dot]) -> dict:
    """FLOPs and counts by (operands, precision); the shares of FLOPs with an f32 operand and
    of mixed products; the count of `HIGHEST` products of low-precision operands."""
    flops, count = Counter(), Counter()
    for d in found:
        key = f"{d.lhs} x {d.rhs} {d.precision.replace('Precision.', '')}"
        flops[key] += d.flops
        count[key] += 1
    total = sum(flops.values()) or 1
    return {
        "products": {k: {"count": count[k], "flops": flops[k], "share": flops[k] / total}
                     for k in sorted(flops, key=flops.get, reverse=True)},
        "f32_operand_flop_share": sum(d.flops for d in found if d.f32_operand) / total,
        "mixed_flop_share": sum(d.flops for d in found if d.mixed) / total,
        "highest_on_low_precision": sum(1 for d in found if d.highest and not d.f32_operand),
    }


@dataclasses.dataclass(frozen=True)
class LoopReads:
    """The decode loop's weights: bytes read by dtype, and the weight converts it does.

    weight_bytes: {dtype: bytes} of the loop's loop-invariant inputs shaped as a weight.
    converts: `(from, to, shape)` of each conversion of a weight-shaped value in the loop.
    """

    weight_bytes: dict[str, int]
    converts: tuple[tuple[str, str, tuple[int, ...]], ...]


def loop_weight_reads(jaxpr, platform: str, weight_shapes: set[tuple[int, ...]]) -> LoopReads:
    """What the `while` loops read of the weights (`weight_shapes`: theirs and transposed).

    The loop-invariant inputs of a `while` body are its constants (`body_nconsts`): the
    weights a decode loop reads every step.
    """
    shapes = set(weight_shapes) | {tuple(reversed(s)) for s in weight_shapes}
    read: Counter = Counter()
    converts = []
    for eqn, in_loop, _ in walk(jaxpr, platform):
        if eqn.primitive.name == "while":
            for v in eqn.invars[eqn.params["cond_nconsts"]:][:eqn.params["body_nconsts"]]:
                a = v.aval
                if tuple(a.shape) in shapes:
                    read[str(a.dtype)] += int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        if in_loop and eqn.primitive.name == "convert_element_type":
            a = eqn.invars[0].aval
            if tuple(a.shape) in shapes:
                converts.append((str(a.dtype), str(eqn.outvars[0].aval.dtype), tuple(a.shape)))
    return LoopReads(dict(read), tuple(converts))
