"""The public API: every subpackage's `__all__` is defined, documented and on the site's reference.

docs/reference.md renders each public name from its docstring (mkdocstrings; a constant's
comment block by `tools/griffe_comments.py`). The last tests build the site and look for
every name there.
"""

import importlib
import inspect
import os
import pkgutil
import re
from pathlib import Path
from typing import NamedTuple

import pytest

import jaxrl_lp

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = sorted(f"jaxrl_lp.{m.name}" for m in pkgutil.iter_modules(jaxrl_lp.__path__) if m.ispkg)


def _own_doc(obj: object) -> str | None:
    """The docstring written for `obj` itself: not inherited, not generated."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        # NamedTuple and dataclass write `Name(field, ...)` when the class has no docstring.
        return None if doc and doc.startswith(f"{obj.__name__}(") else doc
    return getattr(obj, "__doc__", None)


def test_every_area_is_a_subpackage_with_all():
    assert {"data", "models", "numerics", "rl", "rollout", "sync", "train"} <= {
        p.rsplit(".", 1)[1] for p in SUBPACKAGES}
    for package in SUBPACKAGES:
        mod = importlib.import_module(package)
        assert (mod.__doc__ or "").strip(), f"{package}: no module docstring"
        assert isinstance(getattr(mod, "__all__", None), list | tuple), f"{package}: no __all__"
        names = list(mod.__all__)
        assert len(names) == len(set(names)), f"{package}: __all__ lists a name twice"


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_public_names_exist_and_are_documented(package):
    # A function or class by its own docstring; a constant by the comment above it, which
    # the reference shows (a constant without one is not rendered: the test below).
    mod = importlib.import_module(package)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{package}.{name} is in __all__ but not defined"
        assert not name.startswith("_") or name == "__version__", f"{package}.{name} is private"
        obj = getattr(mod, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.startswith("jaxrl_lp"), f"{package}.{name} comes from {obj.__module__}"
            assert (_own_doc(obj) or "").strip(), f"{package}.{name} has no docstring of its own"


class _NoDoc(NamedTuple):
    x: int


def test_generated_and_inherited_docstrings_do_not_count():
    assert _NoDoc.__doc__ == "_NoDoc(x,)"  # written by NamedTuple: not documentation
    assert _own_doc(_NoDoc) is None

    class Child(ValueError):
        pass

    assert _own_doc(Child) is None  # inherited from its base


def _rendered(package: str, name: str, ids: set[str]) -> bool:
    """Whether the site has `package.name`: under the package, or under the module of the
    package that defines it (`jaxrl_lp.models.config.ModelConfig`), as the same object."""
    obj = getattr(importlib.import_module(package), name)
    if f"{package}.{name}" in ids:
        return True
    for anchor in ids:
        module, _, last = anchor.rpartition(".")
        if last == name and module.rpartition(".")[0] == package:
            if getattr(importlib.import_module(module), name, None) is obj:
                return True
    return False


@pytest.fixture(scope="module")
def reference_ids(tmp_path_factory):
    """The anchors of the built site's API reference (`mkdocs build`, the docs extra)."""
    try:
        import mkdocstrings_handlers.python  # noqa: F401 - the handler mkdocs.yml names
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
    except ImportError as e:  # the docs extra is part of dev: without it the install is broken
        pytest.fail(f"{e}: the docs extra is part of the dev install (pyproject.toml); "
                    "pip install -e '.[dev]'")

    site = tmp_path_factory.mktemp("site")
    cwd = os.getcwd()
    os.chdir(ROOT)  # mkdocs.yml names its griffe extension by a path from the checkout
    try:
        build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site), strict=False))
    finally:
        os.chdir(cwd)
    return set(re.findall(r'id="(jaxrl_lp\.[\w.]+)"', (site / "reference" / "index.html").read_text()))


def test_the_reference_renders_every_public_name(reference_ids):
    missing = [f"{package}.{name}" for package in SUBPACKAGES
               for name in importlib.import_module(package).__all__
               if not _rendered(package, name, reference_ids)]
    assert not missing, ("docs/reference.md does not render (add a `::: module` directive, or the "
                         f"name to one's `members`): {missing}")


def test_a_name_counts_where_it_is_defined_and_nowhere_else():
    assert _rendered("jaxrl_lp.models", "ModelConfig", {"jaxrl_lp.models.config.ModelConfig"})
    assert _rendered("jaxrl_lp.rollout", "generate", {"jaxrl_lp.rollout.generate.generate"})
    # `models.loop` sits below `models.model` (docs/design/parameters.md, "Floors"): it does
    # not import `CausalLM`; and a class's member of the same name is not the name.
    assert not _rendered("jaxrl_lp.models", "CausalLM", {"jaxrl_lp.models.loop.CausalLM"})
    assert not _rendered("jaxrl_lp.models", "ModelConfig", {"jaxrl_lp.models.config.Other.ModelConfig"})
    assert not _rendered("jaxrl_lp.models", "ModelConfig", set())
