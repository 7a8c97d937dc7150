"""The public API: every subpackage's `__all__` is defined, documented and listed in docs/api.md."""

import importlib
import importlib.util
import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "tools" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_api = _gen_api()
SUBPACKAGES = gen_api.subpackages()


def test_every_area_is_a_subpackage_with_all():
    assert {"data", "models", "numerics", "rl", "rollout", "sync", "train"} <= {
        p.rsplit(".", 1)[1] for p in SUBPACKAGES}
    for package in SUBPACKAGES:
        mod = importlib.import_module(package)
        assert isinstance(getattr(mod, "__all__", None), list | tuple), f"{package}: no __all__"
        names = list(mod.__all__)
        assert len(names) == len(set(names)), f"{package}: __all__ lists a name twice"


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_public_names_exist_and_are_documented(package):
    mod = importlib.import_module(package)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{package}.{name} is in __all__ but not defined"
        assert not name.startswith("_") or name == "__version__", f"{package}.{name} is private"
        kind, module, summary = gen_api.describe(package, name)
        assert module.startswith("jaxrl_lp"), f"{package}.{name} comes from {module}"
        assert summary, f"{package}.{name} ({kind}) has no documentation"


class _NoDoc(NamedTuple):
    x: int


def test_generated_and_inherited_docstrings_do_not_count():
    assert gen_api.first_paragraph("One line.\n\n  More.") == "One line."
    assert gen_api.first_paragraph("A summary that\n    wraps.\n") == "A summary that wraps."
    assert _NoDoc.__doc__ == "_NoDoc(x,)"  # written by NamedTuple: not documentation
    assert gen_api._own_doc("_NoDoc", _NoDoc) is None

    class Child(gen_api.MissingDocError):
        pass

    assert gen_api._own_doc("Child", Child) is None  # inherited from its base


def test_api_doc_lists_every_public_name():
    text = (ROOT / "docs" / "api.md").read_text()
    sections = re.split(r"^## `(jaxrl_lp\.\w+)`$", text, flags=re.M)
    by_package = dict(zip(sections[1::2], sections[2::2], strict=True))
    assert set(by_package) == set(SUBPACKAGES)
    for package in SUBPACKAGES:
        for name in importlib.import_module(package).__all__:
            assert f"| `{name}` |" in by_package[package], f"docs/api.md lacks {package}.{name}"


def test_api_doc_is_up_to_date():
    assert gen_api.problems() == []
    assert (ROOT / "docs" / "api.md").read_text() == gen_api.render(), \
        "docs/api.md is out of date: run python tools/gen_api.py"
