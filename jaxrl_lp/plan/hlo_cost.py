"""Loop-aware FLOPs and bytes of a compiled (per-device) HLO module, read from its text.

XLA's `compiled.cost_analysis()` counts the body of a `while` loop once, so a
program that scans over its layers, loop steps or micro-batches is undercounted
by those trip counts. This walk counts it the way it runs: the body of a
`while` loop times its trip count (XLA records it as `known_trip_count` in the
loop's backend config; a loop without one, e.g. an early-stopping loop, is
counted once and reported in `unknown_trip_loops`).

- FLOPs: 2 x (output elements) x (contracted elements) for every `dot`,
  inside fusions too. Element-wise work is left out (it is not what the
  matmul peak measures).
- Bytes: for every instruction of a non-fused computation, its output plus
  its operands (what it reads and writes from memory), with the two cases
  XLA's own analysis also special-cases: an operand a fusion only slices
  (`dynamic-slice`, `slice`, `gather`: a layer of stacked weights) counts as
  the slice, and an in-place `dynamic-update-slice` (a KV-cache write) counts
  as its update. Tuples, parameters, bitcasts and loop plumbing are free.
- Collective bytes: the operands of all-gather, all-reduce, reduce-scatter,
  all-to-all and collective-permute (what crosses the interconnect), per
  device; these also count in bytes.

The figures are per device: the text is the SPMD-partitioned module.
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

__all__ = ["HloCost", "hlo_cost", "shape_bytes"]

_ITEMSIZE = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([^\s(]+) \(")
_INSTR = re.compile(r"^\s*(ROOT )?%([^\s=]+) = ")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency"}
_SLICES = {"dynamic-slice", "slice", "gather"}
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


class HloCost(NamedTuple):
    """Per-device cost of one execution of a module."""

    flops: float  # dot FLOPs, loop bodies times their trip counts
    bytes: float  # bytes read and written (module docstring)
    collective_bytes: float  # bytes sent through collectives
    unknown_trip_loops: int  # while loops without a known trip count (counted once)


def _itemsize(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4"):
        return 1.0 if dtype.startswith("f8") else 0.5
    return _ITEMSIZE.get(dtype, 0)


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string (`f32[8,256]{1,0}`, or a tuple of them)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _itemsize(t)
               for t, dims in _ARRAY.findall(shape))


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _split_paren(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


class _Instr(NamedTuple):
    root: bool
    name: str
    shape: str
    op: str
    args: str  # the text between the opcode's parentheses
    operands: list[str]
    attrs: str


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    end = _split_paren(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = rest[:rest.index("(")]
    close = _split_paren(rest, len(op))
    args = rest[len(op) + 1:close - 1]
    operands = re.findall(r"%([^\s,()]+)", args)
    return _Instr(bool(m.group(1)), m.group(2), shape, op, args, operands, rest[close:])


def _parse(text: str) -> dict[str, list[_Instr]]:
    comps: dict[str, list[_Instr]] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = comps.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (ins := _parse_instr(line)) is not None:
            current.append(ins)
    return comps


def _called(attrs: str, key: str) -> list[str]:
    """The computations an instruction names with `key=%c` or `key={%a, %b}`."""
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[^\s,]+)", attrs)
    return re.findall(r"%([^\s,{}]+)", m.group(1)) if m else []


def _through(by_name: dict, name: str) -> _Instr | None:
    """The instruction `name`, looking through conversions, bitcasts and copies (the CPU
    compiler converts a bf16 buffer to f32 and back around an update of it)."""
    i = by_name.get(name)
    while i is not None and i.op in ("convert", "bitcast", "copy") and len(i.operands) == 1:
        i = by_name.get(i.operands[0])
    return i


def _users(inner: list[_Instr], name: str) -> list[_Instr]:
    """The instructions that use `name` as their first operand, looking through conversions,
    bitcasts and copies; [] if any other use reads it."""
    out = []
    for u in inner:
        if name not in u.operands:
            continue
        if u.operands[0] != name or name in u.operands[1:]:
            return []
        if u.op in ("convert", "bitcast", "copy"):
            more = _users(inner, u.name)
            if not more:
                return []
            out += more
        else:
            out.append(u)
    return out


def _trip_count(attrs: str) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
    return int(m.group(1)) if m else None


def hlo_cost(text: str) -> HloCost:
    """The loop-aware cost of the module printed in `text` (`compiled.as_text()`)."""
    comps = _parse(text)
    shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in comps.items()}
    unknown = [0]

    def dot_flops(comp: str, i: _Instr) -> float:
        lhs = _dims(shapes[comp].get(i.operands[0], ""))
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", i.attrs)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
        return 2.0 * math.prod(_dims(i.shape)) * k

    @functools.cache
    def fused_flops(comp: str) -> float:
        return sum(dot_flops(comp, i) if i.op == "dot" else
                   sum(fused_flops(c) for c in _called(i.attrs, "calls"))
                   for i in comps.get(comp, ()))

    def fusion_bytes(comp: str, i: _Instr) -> float:
        """What a fusion reads and writes (module docstring: slices, in-place updates)."""
        callee = _called(i.attrs, "calls")[0]
        inner = comps.get(callee, [])
        by_name = {u.name: u for u in inner}
        params = {int(p.args): p.name for p in inner if p.op == "parameter"}
        out, in_place = shape_bytes(i.shape), None
        dus = _through(by_name, next((u.name for u in inner if u.root), ""))
        if dus is not None and dus.op == "dynamic-update-slice":
            target = _through(by_name, dus.operands[0])
            if target is not None and target.op == "parameter":
                in_place, out = target.name, shape_bytes(shapes[callee].get(dus.operands[1], ""))
        total = out
        for n, name in enumerate(i.operands):
            p = params.get(n)
            if p is not None and p == in_place:
                continue  # updated in place: only the update (counted as the output) moves
            full = shape_bytes(shapes[comp].get(name, ""))
            users = _users(inner, p) if p else []
            if users and all(u.op in _SLICES for u in users):
                # Read: the slices, at the operand's own dtype.
                elems = math.prod(_dims(shapes[comp].get(name, ""))) or 1
                full *= min(1.0, sum(math.prod(_dims(u.shape)) for u in users) / elems)
            total += full
        return total

    @functools.cache
    def walk(comp: str) -> tuple[float, float, float]:
        flops = mem = coll = 0.0
        for i in comps.get(comp, ()):
            if i.op in _FREE:
                continue
            if i.op == "while":
                n = _trip_count(i.attrs)
                if n is None:
                    unknown[0] += 1
                f, b, c = walk(_called(i.attrs, "body")[0])
                flops, mem, coll = flops + (n or 1) * f, mem + (n or 1) * b, coll + (n or 1) * c
                continue
            if i.op in ("call", "conditional", "async-start"):
                branches = [walk(c) for key in ("to_apply", "calls", "branch_computations",
                                                "true_computation", "false_computation")
                            for c in _called(i.attrs, key)]
                if branches:
                    f, b, c = max(branches)
                    flops, mem, coll = flops + f, mem + b, coll + c
                continue
            out = shape_bytes(i.shape)
            if i.op == "fusion":
                flops += fused_flops(_called(i.attrs, "calls")[0])
                mem += fusion_bytes(comp, i)
                continue
            ins = sum(shape_bytes(shapes[comp].get(o, "")) for o in i.operands)
            if i.op == "dot":
                flops += dot_flops(comp, i)
            if i.op.startswith(_COLLECTIVES) and not i.op.endswith("-done"):
                coll += ins
            if i.op == "dynamic-update-slice":
                out = ins = 2 * shape_bytes(shapes[comp].get(i.operands[1], ""))
            elif i.op in _SLICES:
                ins = out
            mem += out + ins
        return flops, mem, coll

    entry = next((m.group(1) for line in text.splitlines()
                  if line.startswith("ENTRY") and (m := _HEADER.match(line))), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    flops, mem, coll = walk(entry)
    return HloCost(flops, mem, coll, unknown[0])
