"""The decode step as the GPU compiler sees it: the ops of the sampler's `while` body, and what
it does to the weights. Read from HLO text.

Two texts answer the same two questions at two depths:

- the program lowered for `cuda` (`lowered.compiler_ir("hlo")`, any host): every HLO op
  the decode loop's body holds before XLA optimizes it, by opcode;
- the program compiled for a GPU target without a GPU (`plan.cuda_aot`, XLA's
  deviceless compile through the CUDA PJRT plugin): the body's kernels as XLA:GPU
  schedules them (each fusion, custom call or copy is one launch on every step),
  by kind: `gemm` (a Triton or cuBLAS product), `triton` (another Triton
  fusion: norms, the reductions it tiles), `fusion` (XLA's own loop and reduction
  emitters), `copy`, and any other op by its name. The loop's condition is
  counted with it: it runs once a step too.

The weights: the body's loop-invariant operands (a `while` carries its constants
through its tuple unchanged) that are floating point and at least
`min_weight_elems` large. A step should read them as they are, inside its
products. `weight_ops` lists every op that instead makes a weight-sized array
out of one on each step: a `convert`, `slice`, `dynamic-slice`, `copy` or
`transpose` of it (the lowered text), or any fusion other than a product that
reads one and writes as many elements as `min_weight_elems` (the compiled text).
Such an op that reads quantized codes (an FP8 or FP4 weight: the decode's copy under a
low-bit format, `models.blocks.decode_weights`) is listed apart, in `code_rebuilds`: the
codes' values rebuilt for a product that cannot take codes (a block format's on Hopper),
which only a GEMM of the codes would remove, where `weight_ops` are work a step need not do.
A scan over stacked layers inside the loop shows as both: a nested loop whose
body slices each layer's weights (SkyRL's Qwen3 decode lost half its bandwidth
to that; XLA does not hoist it). An embedding lookup reads a weight and writes
B rows: not listed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

# The HLO text reader `plan.hlo_cost` uses (same package).
from jaxrl_lp.plan.hlo_cost import _called, _dims, _Instr, _parse, shape_bytes

__all__ = ["StepOps", "decode_step_ops", "kernel_kind", "program_ops"]

# Ops that launch nothing: tuple plumbing, views, constants.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "opt-barrier", "add-dependency", "partition-id", "replica-id"}
# Ops that, applied to a whole weight on every step, copy it.
_COPIES = {"convert", "slice", "dynamic-slice", "copy", "transpose"}
# Views: a weight seen through one is still the weight.
_VIEWS = {"bitcast", "reshape", "get-tuple-element"}
_FLOAT = re.compile(r"^(bf16|f16|f32|f64|f8\w*|f4\w*)\[")
# A weight of quantized codes (FP8, FP4).
_CODES = re.compile(r"^(f8\w*|f4\w*)\[")


@dataclasses.dataclass(frozen=True)
class StepOps:
    """One decode step's ops, read from a `while` body (module docstring).

    ops: {kind: count} per step, the body's and the condition's (`kernel_kind`; the body
      of a loop nested in the step counted once, not once per iteration).
    total: their sum: the launches of one step in a compiled text.
    products: the products among them (`dot` lowered; `gemm` compiled).
    weight_bytes: {dtype: bytes} of the weights the loop carries unchanged.
    weight_ops: one line per op that copies, slices or converts a weight each step.
    code_rebuilds: one line per such op whose weight is quantized codes (their values
      rebuilt each step for a product of the values).
    transposes_into_products: transposes of a weight read only by products (lowered: a
      tied head's `embed.T`); XLA:GPU folds them into the product's operand layout, which
      the compiled text shows (a copy there would be in `weight_ops`).
    nested_loops: `while` loops inside the step (a scan over layers, say).
    logits_passes: {"reads", "writes"} of a [B, V] array (`logits_elems`) by the step's
      ops: the sampling's passes over the logits (compiled: each is a pass through memory).
    """

    ops: dict[str, int]
    total: int
    products: int
    weight_bytes: dict[str, int]
    weight_ops: tuple[str, ...]
    code_rebuilds: tuple[str, ...]
    transposes_into_products: int
    nested_loops: int
    logits_passes: dict[str, int]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def kernel_kind(i: _Instr, compiled: bool) -> str:
    """What one top-level op of a loop body is: its opcode (lowered) or its launch kind."""
    if not compiled:
        return i.op
    if i.op == "fusion":
        backend = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', i.attrs)
        kind = backend.group(1) if backend else ""
        if "gemm" in kind or "cublas" in kind or "cudnn" in kind:
            return "gemm"
        return "triton" if "triton" in kind else "fusion"
    if i.op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', i.attrs)
        t = target.group(1) if target else ""
        return "gemm" if ("gemm" in t or "cublas" in t) else f"custom-call:{t}"
    return i.op


def _elems(shape: str) -> int:
    return math.prod(_dims(shape)) if _dims(shape) else 1


def _invariant(comps, body: str) -> dict[int, str]:
    """{tuple index: shape} of the body's tuple elements it passes on unchanged."""
    instrs = comps[body]
    by_name = {i.name: i for i in instrs}
    param = next(i.name for i in instrs if i.op == "parameter")
    root = next(i for i in instrs if i.root)
    out = {}
    if root.op != "tuple":
        return out
    for n, name in enumerate(root.operands):
        src = by_name.get(name)
        if (src is not None and src.op == "get-tuple-element" and src.operands == [param]
                and re.search(rf"\bindex={n}\b", src.attrs)):
            out[n] = src.shape
    return out


def _loops(comps, comp: str, seen=None):
    """Every `while` reachable from `comp` (through calls), as (instruction, computation)."""
    seen = set() if seen is None else seen
    for i in comps.get(comp, ()):
        if i.op == "while":
            yield i, comp
        for key in ("to_apply", "calls", "body", "branch_computations"):
            for c in _called(i.attrs, key):
                if c not in seen and i.op != "fusion":
                    seen.add(c)
                    yield from _loops(comps, c, seen)


def _products(comps, comp: str, compiled: bool) -> int:
    n = 0
    for i in comps.get(comp, ()):
        if i.op in ("dot", "convolution") or (compiled and kernel_kind(i, True) == "gemm"):
            n += 1
        elif i.op in ("call", "while", "conditional"):
            n += sum(_products(comps, c, compiled) for key in ("to_apply", "body",
                                                               "branch_computations")
                     for c in _called(i.attrs, key))
    return n


def decode_step_ops(text: str, min_weight_elems: int, compiled: bool,
                    logits_elems: int = 0) -> StepOps:
    """The ops of one step of the decode loop in the HLO module `text`.

    The decode loop is the `while` (reachable from the entry through calls)
    holding the most products. `compiled`: `text` is XLA's optimized module
    (`compiled.as_text()`), else the lowered one (`lowered.compiler_ir("hlo")`,
    printed with `get_hlo_module().to_string()`). `logits_elems`: B x V, the elements of
    one step's logits, whose passes `logits_passes` counts.
    """
    comps = _parse(text)
    entry = next((m.group(1) for line in text.splitlines()
                  if line.startswith("ENTRY") and (m := re.match(r"ENTRY %([^\s(]+)", line))),
                 None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    loops = list(_loops(comps, entry))
    if not loops:
        raise ValueError("no while loop in the module: not a decode program")
    loop = max(loops, key=lambda lc: _products(comps, _called(lc[0].attrs, "body")[0], compiled))[0]
    body, cond = _called(loop.attrs, "body")[0], _called(loop.attrs, "condition")[0]

    ops: Counter = Counter()
    weight_ops: list[str] = []
    code_rebuilds: list[str] = []
    weight_bytes: Counter = Counter()
    nested = [0]
    folded = [0]
    passes = Counter(reads=0, writes=0)
    shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in comps.items()}

    def big_float(shape: str) -> bool:
        return bool(_FLOAT.match(shape)) and _elems(shape) >= min_weight_elems

    def visit(comp: str, weights: set[str]) -> None:
        """Counts `comp`'s ops; `weights`: its values that are weights (names)."""
        users: dict[str, list[str]] = {}
        for i in comps.get(comp, ()):
            for o in i.operands:
                users.setdefault(o, []).append(i.op)
        for i in comps.get(comp, ()):
            reads = [o for o in i.operands if o in weights]
            if i.op in _VIEWS and reads:
                weights.add(i.name)
                continue
            if i.op == "while":
                nested[0] += 1
                inner = _called(i.attrs, "body")[0]
                visit(inner, _weights_of(inner))
                continue
            if i.op in ("call", "conditional"):
                for key in ("to_apply", "branch_computations"):
                    for c in _called(i.attrs, key):
                        params = {p.name for p in comps.get(c, ()) if p.op == "parameter"
                                  and int(p.args) < len(i.operands)
                                  and i.operands[int(p.args)] in weights}
                        visit(c, params)
                continue
            if i.op in _FREE:
                continue
            kind = kernel_kind(i, compiled)
            ops[kind] += 1
            if logits_elems:
                big = [o for o in i.operands if _elems(shapes[comp].get(o, "")) == logits_elems
                       and shapes[comp].get(o, "(")[0] != "("]
                passes["reads"] += len(big)
                passes["writes"] += sum(_elems(a) == logits_elems
                                        for a in re.findall(r"[a-z0-9]+\[[0-9,]*\]", i.shape))
            if not reads or _elems(i.shape) < min_weight_elems:
                continue
            if i.op == "transpose" and set(users.get(i.name, ())) == {"dot"}:
                folded[0] += 1  # a layout the product takes as it is (the compiled text says)
                continue
            if (i.op in _COPIES) or (compiled and i.op == "fusion" and kind != "gemm"):
                src = next(o for o in i.operands if o in weights)
                codes = _CODES.match(shapes[comp].get(src, ""))
                (code_rebuilds if codes else weight_ops).append(
                    f"{comp}: {i.name} = {i.op}[{kind}] {_strip(i.shape)} of a weight ({src}"
                    + (f", {codes.group(1)} codes)" if codes else ")"))

    def _weights_of(comp: str) -> set[str]:
        """The loop-invariant weights of a `while` body, as its get-tuple-element names."""
        inv = {n for n, shape in _invariant(comps, comp).items() if big_float(shape)}
        param = next(i.name for i in comps[comp] if i.op == "parameter")
        return {i.name for i in comps[comp] if i.op == "get-tuple-element"
                and i.operands == [param]
                and int(re.search(r"\bindex=(\d+)", i.attrs).group(1)) in inv}

    for shape in _invariant(comps, body).values():
        if (m := _FLOAT.match(shape)) and not shape.startswith("("):
            weight_bytes[m.group(1)] += int(shape_bytes(shape))
    visit(body, _weights_of(body))
    visit(cond, set())
    return StepOps(dict(sorted(ops.items(), key=lambda kv: -kv[1])), sum(ops.values()),
                   _products(comps, body, compiled), dict(weight_bytes), tuple(weight_ops),
                   tuple(code_rebuilds), folded[0], nested[0], dict(passes))


def program_ops(text: str, logits_elems: int) -> dict:
    """The kernels of a compiled module's entry (a program without a loop: one sampling draw,
    say), by kind, and its passes over [B, V] arrays (`logits_elems` elements; reads and
    writes, as `StepOps.logits_passes`)."""
    comps = _parse(text)
    entry = next(m.group(1) for line in text.splitlines()
                 if line.startswith("ENTRY") and (m := re.match(r"ENTRY %([^\s(]+)", line)))
    shapes = {i.name: i.shape for i in comps[entry]}
    ops: Counter = Counter()
    passes = Counter(reads=0, writes=0)
    for i in comps[entry]:
        if i.op in _FREE:
            continue
        ops[kernel_kind(i, True)] += 1
        passes["reads"] += sum(_elems(shapes.get(o, "")) == logits_elems
                               and not shapes.get(o, "(").startswith("(") for o in i.operands)
        passes["writes"] += sum(_elems(a) == logits_elems
                                for a in re.findall(r"[a-z0-9]+\[[0-9,]*\]", i.shape))
    return {"kernels": sum(ops.values()), "ops": dict(ops), "logits_passes": dict(passes)}


def _strip(shape: str) -> str:
    return re.sub(r"\{[^}]*\}", "", shape)
