"""Generates docs/results.md, the measured figures: one section per JSON in docs/bench/.

docs/bench/ keeps at most one current JSON per benchmark target and machine kind (git keeps
the earlier ones); docs/results.md is where their figures are read. Per file it gives the
file (a link), the machine or device, the jax version and the date as the JSON records them
(a JSON without a date gets the date of the last commit that touched it), and a short table
of its headline figures: the key paths `HEADLINES` names for its target, or else its
top-level scalar fields.

A file's target is the `jaxrl-lp bench TARGET` or the `benchmarks/` script that wrote it:
its own `target` key, else the command its `command` key records, else the longest start
of its name that names a `benchmarks/` script or a `jaxrl_lp/bench/` module. Its machine
kind comes from its name: every 1- and 2-core development CPU (`2core-cpu`, `2core-zen5`,
`1core-...`) is one kind, `2core-cpu`; otherwise the machine word itself (`h200`, `cuda`).

    python tools/results.py            # writes docs/results.md
    python tools/results.py --check    # exit 1 (and say why) when docs/results.md is stale

`tests/test_results_doc.py` runs `--check` and `groups()`.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
OUT = ROOT / "docs" / "results.md"

# The machine word in a file name: `-2core-zen5`, `-1core-before-...`, `-h200`, `-cuda`.
_MACHINE = re.compile(r"-(\d+core(?:-[a-z0-9]+)?|[abh]\d{3}|tpu(?:-?[a-z0-9]+)?|cuda)(?=-|$)")
# A recorded command's program, the first one it names.
_COMMAND = re.compile(r"jaxrl-lp bench ([\w-]+)|(benchmarks/[\w-]+\.(?:py|sh))|jaxrl-lp ([\w-]+)")
# Keys shown in a section's header, not again in its fallback table.
_META = ("target", "jax", "date", "platform", "device", "machine", "backend", "traced_on")
_MAX_FIGURES = 12
_MAX_ROWS = 40
_MAX_TEXT = 100


def machine_kind(name: str) -> str:
    """The machine kind a docs/bench file name says: `2core-cpu` for every 1- and 2-core
    development CPU, else the machine word (`h200`, `cuda`); `unknown` without one."""
    m = _MACHINE.search(Path(name).stem)
    if not m:
        return "unknown"
    word = m.group(1)
    return "2core-cpu" if re.match(r"[12]core", word) else word


def _name_target(stem: str) -> str:
    """The target the start of a file name names: a `benchmarks/` script (in the tree, or one
    `HEADLINES` names that has left it) or a bench module."""
    m = _MACHINE.search(stem)
    words = (stem[: m.start()] if m else stem).split("-")
    for n in range(len(words), 0, -1):
        base = "_".join(words[:n])
        for ext in ("py", "sh"):
            script = f"benchmarks/{base}.{ext}"
            if (ROOT / script).is_file() or script in HEADLINES:  # HEADLINES keeps removed ones
                return script
        if (ROOT / "jaxrl_lp" / "bench" / f"{base}.py").is_file():
            return f"jaxrl-lp bench {base}"
    return "-".join(words)


def target_of(name: str, data: object) -> str:
    """The program that wrote a docs/bench JSON: `jaxrl-lp bench TARGET` (with `--looped`
    for the learner's looped mode, a measurement of its own) or `benchmarks/SCRIPT`."""
    data = data if isinstance(data, dict) else {}
    target = data.get("target")
    if isinstance(target, str) and target.strip():
        script = re.search(r"benchmarks/[\w-]+\.(?:py|sh)", target)
        if script:
            return script.group(0)
        word = target.split()[0]
        if word == "learner" and "looped" in str(data.get("preset", "")):
            return "jaxrl-lp bench learner --looped"
        return f"jaxrl-lp bench {word}"
    command = data.get("command")
    if isinstance(command, str):
        m = _COMMAND.search(command)
        if m:
            bench, script, other = m.groups()
            return f"jaxrl-lp bench {bench}" if bench else script or f"jaxrl-lp {other}"
    return _name_target(Path(name).stem)


def _load(path: Path) -> object:
    return json.loads(path.read_text())


def bench_files() -> list[Path]:
    """docs/bench's JSON files, sorted by name."""
    return sorted(BENCH.glob("*.json"))


def groups() -> dict[tuple[str, str], list[str]]:
    """`{(target, machine kind): [file names]}` over docs/bench's JSON files, sorted."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in bench_files():
        key = (target_of(path.name, _load(path)), machine_kind(path.name))
        out.setdefault(key, []).append(path.name)
    return dict(sorted(out.items()))


# --- what each target's table shows ----------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """Every scalar a key path reaches, one row each. A path is a tuple of keys; a key may
    be an `fnmatch` pattern (`*` any key or list index, `*_vs_tunix`)."""

    path: tuple


@dataclass(frozen=True)
class Grid:
    """A table: one row per dict `rows` reaches that holds at least one of `cols` (paths
    under the row; a column reaching several scalars shows them as `key: value, ...`), the
    first `limit` of them."""

    rows: tuple
    cols: tuple
    limit: int = _MAX_ROWS


_ITERATION = Grid(("*", "*"), ("iteration_s", "sample", "behaviour", "update", "tokens_per_s",
                               "vs_tunix", ("fraction_of_bound", "iteration")))
_LEARNER = Grid(("*",), ("step_s", "tokens_per_s", "mfu", "compiled_flops", "compiled_temp_bytes"))

# Per target, the headline figures: what its bench or script reports as its result.
HEADLINES: dict[str, list] = {
    "jaxrl-lp bench iteration": [
        Figures(("targets_met", "*")), Figures(("machine", "weight_stream_gb_per_s")),
        Figures(("machine", "matmul_gflop_per_s")), _ITERATION],
    "jaxrl-lp bench sampler": [
        Figures(("targets_met", "*")), Figures(("ratio_vs_hf", "*")),
        Grid(("dense", "*"), ("ours_tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf",
                              "bound_tokens_per_s", "ours_fraction_of_bound")),
        Grid(("looped", "*", "batch_*"), ("dense_tokens_per_s", "deferred_tokens_per_s",
                                          "deferred_speedup", "ideal_speedup"))],
    "jaxrl-lp bench learner": [Figures(("targets_met", "*")), Figures(("*_vs_tunix",)), _LEARNER],
    "jaxrl-lp bench learner --looped": [
        Figures(("targets_met", "*")), Figures(("*_packing_speedup",)),
        Figures(("hybrid_recorded_over_dense_time",)), _LEARNER],
    "jaxrl-lp bench replay": [
        Figures(("replay_equals_sampler",)),
        Grid(("results", "*", "*"), (("whole", "differ"), ("whole", "tokens"), ("slices_2", "differ"),
                                     ("slices_4", "differ"), ("rows_shuffled", "differ"),
                                     ("stale_1", "differ"), ("traced", "differ"),
                                     ("cost", "sampled_tokens_per_s_with_forcing")))],
    "jaxrl-lp bench hotpath": [
        Figures(("ok",)),
        Grid(("cells", "*"), ("preset", "policy", ("sampler", "loop_weight_bytes", "*"),
                              ("sampler", "loop_weight_converts"),
                              ("grpo_step_hybrid", "mixed_flop_share"),
                              ("grpo_step_hybrid", "f32_operand_flop_share"), "problems"))],
    "benchmarks/mosaic_aot.py": [
        Figures(("ok",)),
        Grid(("targets", "*", "*"), ("compile_s", ("kernels", "*", "kernel"),
                                     ("kernels", "*", "registers"),
                                     ("kernels", "*", "spill_store_bytes"))),
    ],
    "jaxrl-lp bench decode": [
        Figures(("ok",)), Figures(("preset",)), Figures(("rows",)),
        Figures(("lowered", "total")), Figures(("lowered", "products")),
        Figures(("lowered", "weight_ops")), Figures(("lowered", "nested_loops")),
        Grid(("compiled", "*"), ("total", "products", ("ops", "*"), "weight_ops", "nested_loops",
                                 ("logits_passes", "reads"), ("logits_passes", "writes")))],
    "jaxrl-lp bench kernels": [
        Figures(("kernel_mode",)),
        Grid(("summary", "*"), (("kernel", "time_s"), ("reference", "time_s"), ("kernel", "max_rel_diff"),
                                ("kernel", "peak_bytes"), ("reference", "peak_bytes"),
                                ("plain", "peak_bytes")))],
    "jaxrl-lp bench compile": [
        Grid(("presets", "*", "programs", "*"), ("s_per_layer", "intercept_s", "at_preset_depth_s"))],
    "jaxrl-lp bench lowering": [Figures(("summary", "*"))],
    "jaxrl-lp bench multiturn": [
        Figures(("preset",)), Figures(("multiturn_vs_single_context_tokens_per_s",)),
        Figures(("multiturn", "*")), Figures(("single_turn", "*"))],
    "jaxrl-lp bench overlap": [
        Grid(("*",), (("synchronous", "iteration_s"), ("overlapped", "iteration_s"), "speedup",
                      ("overlapped", "sample"), ("overlapped", "behaviour"), ("overlapped", "update")))],
    "jaxrl-lp bench lora": [
        Figures(("margin",)),
        Grid(("arms", "*"), ("initial_accuracy", "final_accuracy", "accuracy_gain", "trained_fraction",
                             "within_margin"))],
    "benchmarks/gpu.sh": [
        Figures(("seconds",)), Grid(("steps", "*"), ("exit", "seconds", "timed_out", "last_line"))],
    "benchmarks/iteration_ab.py": [
        Grid(("runs", "*", "small-qwen3", "*"), ("iteration_s", "sample", "behaviour", "update",
                                                 "tokens_per_s"))],
    "benchmarks/decode_matmuls.py": [
        Figures(("batch",)), Figures(("weight_bytes",)),
        Grid(("*",), ("ms_per_step", "weight_gb_per_s", "result_rel_diff"))],
    "benchmarks/fingerprint.py": [
        Figures(("speedup",)), Grid(("*",), ("seconds", "temp_bytes", "page_faults"))],
    "benchmarks/nonfinite_skip.py": [],  # its top-level figures
    "benchmarks/norm_grad.py": [
        Grid(("weight_grad_ms", "*"), ("reduce", "product")),
        Grid(("update", "*"), ("min_s", "median_s", "temp_bytes")), Figures(("update", "same_bits"))],
    "benchmarks/sampler_draw.py": [
        Figures(("draw_ms", "*")), Figures(("noise_in_scan_ms", "*")), Figures(("sampler_s", "*"))],
    "benchmarks/unstacked_update_ab.py": [
        Grid(("*",), ("min_s", "median_s", "temp_bytes", "same_bits_as_stacked"))],
    "benchmarks/update_token_axis_ab.py": [
        Figures(("leading_axes_over_one_token_axis",)), Figures(("same_bits",)),
        Figures(("same_gradient",)), Grid(("seconds", "*"), ("min", "median"))],
    "benchmarks/replay_slices.py": [Grid(("cells", "*"), ("tokens", "differ", "max_abs_diff"))],
    "benchmarks/speculative_replay.py": [
        Figures(("*_s",)), Figures(("differing_tokens_by_slices", "*"))],
    "benchmarks/profile_update.py": [
        Figures(("step_s_under_profiler",)), Figures(("ops_s",)),
        Grid(("top", "*"), ("op", "s", "share"), limit=10)],
    "benchmarks/profile_sampler.py": [
        Figures(("rollout_s",)), Figures(("ops_s",)), Figures(("weight_matmul_s",)),
        Figures(("weight_matmul_share",)), Figures(("other_dot_s",))],
}


def _scalar(v: object) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _children(node: object) -> list[tuple[str, object]]:
    if isinstance(node, dict):
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, list):
        return [(str(i), v) for i, v in enumerate(node)]
    return []


def _reach(node: object, path: tuple, at: tuple = ()) -> list[tuple[tuple, object]]:
    """`(keys, value)` for everything `path` reaches from `node`, in the JSON's order."""
    if not path:
        return [(at, node)]
    key, rest = path[0], path[1:]
    if not any(c in key for c in "*?["):
        if isinstance(node, dict) and key in node:
            return _reach(node[key], rest, at + (key,))
        return []
    out = []
    for k, v in _children(node):
        if fnmatch.fnmatchcase(k, key):
            out += _reach(v, rest, at + (k,))
    return out


def _fmt(v: object) -> str:
    """One cell: numbers to 4-5 significant digits (whole from 10,000 up), long text cut,
    `|` escaped."""
    if isinstance(v, bool) or v is None:
        text = json.dumps(v)
    elif isinstance(v, int):
        text = f"{v:,}" if abs(v) >= 10_000 else str(v)
    elif isinstance(v, float) and 1e4 <= abs(v) < 1e9:
        text = f"{v:,.0f}"
    elif isinstance(v, float):
        text = f"{v:.5g}" if 1e3 <= abs(v) < 1e4 else f"{v:.4g}"
    elif isinstance(v, str):
        text = v if len(v) <= _MAX_TEXT else v[: _MAX_TEXT - 3] + "..."
    elif isinstance(v, list) and not v:
        text = "none"
    elif isinstance(v, list) and len(v) <= 6 and all(_scalar(x) for x in v):
        text = ", ".join(_fmt(x) for x in v)
    elif isinstance(v, (list, dict)):
        text = f"{len(v)} entries"
    else:
        text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _label(keys: tuple) -> str:
    return "`" + ".".join(keys) + "`"


def _figures_table(rows: list[tuple[tuple, object]]) -> list[str]:
    if not rows:
        return []
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {_label(keys)} | {_fmt(v)} |" for keys, v in rows[:_MAX_ROWS]]
    if len(rows) > _MAX_ROWS:
        lines.append(f"| ({len(rows) - _MAX_ROWS} more in the JSON) | |")
    return lines + [""]


def _grid_table(data: object, grid: Grid) -> list[str]:
    cols = [c if isinstance(c, tuple) else (c,) for c in grid.cols]
    body = []
    for keys, row in _reach(data, grid.rows):
        if not isinstance(row, dict):
            continue
        cells = []
        for col in cols:
            found = [(k, v) for k, v in _reach(row, col) if _scalar(v) or isinstance(v, list)]
            if not found:
                cells.append("")
            elif len(found) == 1 and not any(c in col[-1] for c in "*?["):
                cells.append(_fmt(found[0][1]))
            else:
                cells.append(", ".join(f"{k[-1]}: {_fmt(v)}" for k, v in found))
        if any(cells):
            body.append(f"| {_label(keys)} | " + " | ".join(cells) + " |")
    if not body:
        return []
    head = "| `" + ".".join(grid.rows) + "` | " + " | ".join(".".join(c) for c in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"] + body[: grid.limit]
    if len(body) > grid.limit:
        lines.append(f"| ({len(body) - grid.limit} more in the JSON) |" + " |" * len(cols))
    return lines + [""]


def _fallback(data: object) -> list[tuple[tuple, object]]:
    """The top-level scalar fields, then (up to the same count) those one level down."""
    rows = [((k,), v) for k, v in _children(data) if _scalar(v) and k not in _META]
    for k, v in _children(data):
        if isinstance(v, dict) and k not in _META:
            rows += [((k, k2), v2) for k2, v2 in _children(v) if _scalar(v2)]
    return rows[:_MAX_FIGURES]


def headline(target: str, data: object) -> list[str]:
    """The markdown tables of a JSON's headline figures (its scalars when the target has no
    entry in `HEADLINES`, or none of its paths reach anything)."""
    spec = HEADLINES.get(target, [])
    figures = [hit for f in spec if isinstance(f, Figures) for hit in _reach(data, f.path)
               if _scalar(hit[1]) or isinstance(hit[1], list)]
    lines = _figures_table(figures)
    for grid in (g for g in spec if isinstance(g, Grid)):
        lines += _grid_table(data, grid)
    return lines or _figures_table(_fallback(data))


# --- where and when ----------------------------------------------------------------------


def _find(data: object, key: str) -> object:
    """`data[key]` when it is a scalar, else the first such value one level down."""
    if isinstance(data, dict) and _scalar(data.get(key)) and data.get(key) is not None:
        return data[key]
    for _, v in _children(data):
        for _, item in [("", v)] + (_children(v) if isinstance(v, list) else []):
            if isinstance(item, dict) and _scalar(item.get(key)) and item.get(key) is not None:
                return item[key]
    return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def _previous_dates() -> dict[str, str]:
    """The git-derived dates the current docs/results.md gives, by file name."""
    if not OUT.is_file():
        return {}
    found, name = {}, None
    for line in OUT.read_text().splitlines():
        header = re.match(r"### \[([^\]]+)\]", line)
        name = header.group(1) if header else name
        date = re.match(r"- date: (\S+) \(last commit\)$", line)
        if date and name:
            found[name] = date.group(1)
    return found


def git_dates() -> dict[str, str]:
    """`{file name: date of the last commit that touched it}` for docs/bench's JSON files.

    A file that is new or changed and not committed gets today's date (the one its commit
    will carry). In a shallow clone, where git cannot tell, the date docs/results.md already
    gives stands.
    """
    rel = BENCH.relative_to(ROOT).as_posix()
    names = [p.name for p in bench_files()]
    if _git("rev-parse", "--is-shallow-repository").strip() != "false":
        previous = _previous_dates()
        return {n: previous.get(n, "not recorded") for n in names}
    dates: dict[str, str] = {}
    date = ""
    for line in _git("log", "--format=@%cs", "--name-only", "--", rel).splitlines():
        if line.startswith("@"):
            date = line[1:]
        elif line.strip() and Path(line).name not in dates:
            dates[Path(line).name] = date
    dirty = {Path(line[3:]).name for line in
             _git("status", "--porcelain", "--untracked-files=all", "--", rel).splitlines()}
    today = datetime.date.today().isoformat()
    return {n: today if n in dirty or n not in dates else dates[n] for n in names}


def _section(path: Path, data: object, kind: str, dates: dict[str, str]) -> list[str]:
    where: list[str] = []
    for key in ("machine", "device", "platform"):
        value = _find(data, key)
        if value is not None and not any(str(value) in w for w in where):
            where.append(str(value))
    traced = _find(data, "traced_on")
    if traced is not None:
        where.append(f"traced on {traced}")
    jax = _find(data, "jax")
    date = _find(data, "date")
    date_text = str(date) if date is not None else f"{dates.get(path.name, 'not recorded')} (last commit)"
    return [
        f"### [{path.name}](bench/{path.name})",
        "",
        f"- machine: {', '.join(where) or 'not recorded'} (kind `{kind}`)",
        f"- jax: {jax if jax is not None else 'not recorded'}",
        f"- date: {date_text}",
        "",
        *headline(target_of(path.name, data), data),
    ]


def render() -> str:
    """The text of docs/results.md."""
    dates = git_dates()
    by_target: dict[str, list[Path]] = {}
    for (target, _kind), names in groups().items():
        by_target.setdefault(target, []).extend(BENCH / n for n in names)
    parts = [
        "# Benchmark results",
        "",
        "<!-- Generated by `python tools/results.py` from docs/bench/*.json; do not edit by hand. "
        "tests/test_results_doc.py checks that it is up to date. -->",
        "",
        "The figures of the benchmark JSON files in `docs/bench/`: at most one current file per",
        "benchmark target and machine kind (every 1- and 2-core development CPU is one kind,",
        "`2core-cpu`); earlier runs are in git. Each section names its file, the machine and",
        "jax version and the date it records (or its last commit's date), and its headline",
        "figures. What each target measures, and the decisions the figures made, are in",
        "[bench/README.md](bench/README.md) and [the design notes](design/index.md).",
        "",
    ]
    for target in sorted(by_target):
        parts += [f"## `{target}`", ""]
        if target.startswith("benchmarks/") and not (ROOT / target).exists():
            parts += ["The script has left the tree; git history has it.", ""]
        for path in sorted(by_target[target]):
            parts += _section(path, _load(path), machine_kind(path.name), dates)
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Writes docs/results.md, or with `--check` reports whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when docs/results.md differs from docs/bench")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"results: {OUT.relative_to(ROOT)} is out of date; run python tools/results.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
