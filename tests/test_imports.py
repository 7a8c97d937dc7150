"""Every module of the package imports first: an import cycle fails here, whatever the order.

A test suite whose files always import something else first hides a cycle (`from
jaxrl_lp.parallel import make_mesh` in a fresh interpreter once failed with "partially
initialized module"). One subprocess imports the third-party packages once, then for
each module of `jaxrl_lp` drops every `jaxrl_lp` module from `sys.modules` and imports
that module first: what a fresh interpreter does for the package, in seconds. One
module in a truly fresh interpreter checks the shortcut.
"""

import json
import subprocess
import sys

WALK = r"""
import importlib, json, pkgutil, sys, traceback
import jax, numpy, optax, orbax.checkpoint  # the third-party floor, once
import jaxrl_lp
names = sorted(m.name for m in pkgutil.walk_packages(jaxrl_lp.__path__, "jaxrl_lp."))
failed = {}
for name in names:
    for k in [k for k in sys.modules if k == "jaxrl_lp" or k.startswith("jaxrl_lp.")]:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - every failure is reported, by module
        failed[name] = traceback.format_exception_only(type(e), e)[-1].strip()
print(json.dumps({"names": names, "failed": failed}))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={"JAX_PLATFORMS": "cpu", **_env()})


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def test_every_module_imports_first():
    out = _run(WALK)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res["names"]) > 80  # the walk found the package
    assert {"jaxrl_lp.parallel.mesh", "jaxrl_lp.train.program", "jaxrl_lp.kernels.quantize",
            "jaxrl_lp.numerics.fingerprint"} <= set(res["names"])
    assert res["failed"] == {}, "\n".join(f"{k}: {v}" for k, v in res["failed"].items())


def test_a_module_in_a_fresh_interpreter():
    out = _run("from jaxrl_lp.parallel import make_mesh; import jaxrl_lp.parallel.distributed")
    assert out.returncode == 0, out.stderr[-2000:]


# The floors, lowest first (docs/design/parameters.md, "Floors"): a module imports, at its top level,
# only modules of its own floor or below, and so does every package __init__ on the way.
FLOORS = (
    ("fields",), ("numerics",), ("models.config", "models.loop", "models.hf_names"),
    ("parallel",), ("models.attention",), ("kernels",), ("models",), ("rollout",), ("sync",),
    ("rl",), ("optim",), ("lora",), ("data",), ("envs",), ("train",), ("plan",), ("bench",),
    ("studies",), ("cli",),
)


def _floor(module: str) -> int | None:
    name = module.removeprefix("jaxrl_lp.")
    hits = [(len(p), i) for i, f in enumerate(FLOORS) for p in f
            if name == p or name.startswith(p + ".")]
    return max(hits)[1] if hits else None


def _top_level_imports() -> dict[str, set[str]]:
    """Each module's top-level `jaxrl_lp` imports, and the package inits each one runs."""
    import ast
    from pathlib import Path

    import jaxrl_lp

    root = Path(jaxrl_lp.__file__).parent
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        targets = set()
        for node in ast.parse(path.read_text()).body:
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for t in names:
                if t.startswith("jaxrl_lp."):
                    parts = t.split(".")  # the target and the package inits above it
                    targets |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        out[module] = targets
    return out


def test_the_floors_are_one_way():
    graph = _top_level_imports()
    packages = {m for m in graph if any(k.startswith(m + ".") for k in graph)}

    memo: dict[str, int] = {}

    def reach(module):  # the highest floor importing `module` runs
        if module not in graph:
            return -1
        if module not in memo:
            memo[module] = -1  # a cycle adds nothing new
            own = -1 if module in packages else (_floor(module) or 0)  # a package: its imports
            memo[module] = max([own] + [reach(t) for t in graph[module]])
        return memo[module]

    up = []
    for module, targets in sorted(graph.items()):
        me = _floor(module)
        if me is None:
            continue
        for t in sorted(targets):
            if t != module and not module.startswith(t + ".") and reach(t) > me:
                up.append(f"{module} (floor {me}) imports {t}, which runs floor {reach(t)}")
    assert up == [], "\n".join(up)
    # The test can fail: a module of a floor above is found.
    assert reach("jaxrl_lp.kernels.quantize") > (_floor("jaxrl_lp.numerics.formats") or 0)


def _module_graph() -> dict[str, set[str]]:
    """Each module's `jaxrl_lp` imports anywhere in its file (function bodies included), as
    module names; a package's `__init__` is a hub of re-exports and is left out."""
    import ast
    from pathlib import Path

    import jaxrl_lp

    root = Path(jaxrl_lp.__file__).parent
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts): p
             for p in root.rglob("*.py") if p.name != "__init__.py"}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in files else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_files():
    """No two modules import each other, even inside a function (where the test above cannot
    see it): the log-prob kernels once took their tile maths from the dispatcher, which
    imported them back inside functions."""
    graph = _module_graph()
    assert "jaxrl_lp.kernels.logprob_gpu" in graph["jaxrl_lp.kernels.logprob"]
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
