"""Generates docs/api.md, the public API: every subpackage's `__all__`, one line per name.

Each subpackage of `jaxrl_lp` lists its public names in `__all__`; the doc
gives, per subpackage, each name's kind, the module that defines it and the
first paragraph of its docstring. Names that are not functions or classes
(constants, tables) have no docstring of their own: their doc is the comment
block directly above their assignment, or a string literal directly after it.
A typing alias (`Literal[...]`) is described by its value.

    python tools/gen_api.py            # writes docs/api.md
    python tools/gen_api.py --check    # exit 1 (and say why) when docs/api.md is stale

`tests/test_api.py` runs `problems()` and `render()`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import pkgutil
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "jaxrl_lp"
OUT = ROOT / "docs" / "api.md"
# Comment lines that are directives to tools, not documentation.
_PRAGMAS = ("fmt:", "noqa", "type:", "pragma", "pylint", "ruff:")


class MissingDocError(ValueError):
    """A public name without documentation."""


def subpackages() -> list[str]:
    """The dotted names of `jaxrl_lp`'s subpackages, sorted."""
    pkg = importlib.import_module(PACKAGE)
    return sorted(f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg)


def first_paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line ('' when there is none)."""
    if not doc:
        return ""
    para = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines()).strip()


def _own_doc(name: str, obj: object) -> str | None:
    """The docstring written for `obj` itself: not inherited, not generated."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        # NamedTuple and dataclass write `Name(field, ...)` when the class has no docstring.
        if doc and doc.startswith(f"{obj.__name__}("):
            return None
        return doc
    return getattr(obj, "__doc__", None)


def _defining_module(package: str, name: str) -> str:
    """The module whose source assigns `name`: the one the package imports it from (or,
    for a package that loads its names on first use, the module its `_WHERE` names)."""
    lazy = getattr(importlib.import_module(package), "_WHERE", {})
    if name in lazy:
        return f"{package}.{lazy[name]}"
    init = Path(importlib.import_module(package).__file__)
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if any((a.asname or a.name) == name for a in node.names):
                return node.module
    return package


def _assignment_doc(module: str, name: str) -> str | None:
    """The comment block above `name = ...` in `module`'s source, or the string after it."""
    path = Path(importlib.import_module(module).__file__)
    source = path.read_text()
    lines = source.splitlines()
    body = ast.parse(source).body
    for i, node in enumerate(body):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            return nxt.value.value
        comments = []
        j = node.lineno - 2  # the line above, 0-based
        while j >= 0 and lines[j].lstrip().startswith("#"):
            text = lines[j].lstrip()[1:].lstrip(":").strip()
            if not text.startswith(_PRAGMAS):
                comments.append(text)
            j -= 1
        return " ".join(reversed(comments)) or None
    return None


def describe(package: str, name: str) -> tuple[str, str, str]:
    """`(kind, module, summary)` of a public name; MissingDocError when it is undocumented."""
    obj = getattr(importlib.import_module(package), name)
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        return kind, obj.__module__, first_paragraph(_own_doc(name, obj))
    if typing.get_origin(obj) is not None:  # a typing alias such as Literal[...]
        module = _defining_module(package, name)
        doc = first_paragraph(_assignment_doc(module, name))
        value = repr(obj).replace("typing.", "")
        return "type", module, f"{doc} `{value}`" if doc else f"`{value}`"
    if callable(obj):
        module = getattr(obj, "__module__", None) or _defining_module(package, name)
        return "function", module, first_paragraph(_own_doc(name, obj))
    module = _defining_module(package, name)
    return "constant", module, first_paragraph(_assignment_doc(module, name))


def problems() -> list[str]:
    """Everything that keeps the public API from being documented, one line each."""
    out = []
    for package in subpackages():
        mod = importlib.import_module(package)
        names = getattr(mod, "__all__", None)
        if names is None:
            out.append(f"{package}: no __all__")
            continue
        if not first_paragraph(mod.__doc__):
            out.append(f"{package}: no module docstring")
        for name in names:
            if not hasattr(mod, name):
                out.append(f"{package}.{name}: listed in __all__ but not defined")
                continue
            kind, _, summary = describe(package, name)
            if not summary:
                what = "a docstring" if kind in ("class", "exception", "function") else \
                    "a comment above its assignment (or a string after it)"
                out.append(f"{package}.{name} ({kind}): needs {what}")
    return out


def render() -> str:
    """The text of docs/api.md."""
    found = problems()
    if found:
        raise MissingDocError("the public API is not fully documented:\n  " + "\n  ".join(found))
    parts = [
        "# jaxrl_lp public API",
        "",
        "<!-- Generated by `python tools/gen_api.py` from the docstrings; do not edit by hand. "
        "tests/test_api.py checks that it is up to date. -->",
        "",
        "Each subpackage's `__all__` is its public surface: the names below are what",
        "`from jaxrl_lp.<subpackage> import ...` offers and what we keep stable. Anything",
        "else (a module's own helpers, names starting with `_`) may change without notice.",
        "Each entry gives the first paragraph of the name's docstring; `help(name)` has the",
        "rest (arguments, maths, examples). The command line is documented by",
        "`jaxrl-lp --help` and `jaxrl-lp COMMAND --help`.",
        "",
    ]
    for package in subpackages():
        parts.append(f"- [`{package}`](#{package.replace('.', '')})")
    parts.append("")
    for package in subpackages():
        mod = importlib.import_module(package)
        parts += [f"## `{package}`", "", first_paragraph(mod.__doc__), ""]
        names = list(mod.__all__)
        if not names:
            parts += ["No public Python names.", ""]
            continue
        parts += ["| name | kind | defined in | summary |", "|---|---|---|---|"]
        for name in names:
            kind, module, summary = describe(package, name)
            summary = summary.replace("|", "\\|")
            parts.append(f"| `{name}` | {kind} | `{module}` | {summary} |")
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Writes docs/api.md, or with `--check` reports whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when docs/api.md differs from the docstrings")
    args = parser.parse_args(argv)
    try:
        text = render()
    except MissingDocError as e:
        print(f"gen_api: {e}", file=sys.stderr)
        return 1
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"gen_api: {OUT.relative_to(ROOT)} is out of date; run python tools/gen_api.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
