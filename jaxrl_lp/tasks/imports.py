"""Objects named by import path in a config: `pkg.mod:attr` or `path/to/file.py:attr`.

A config names a user's reward function or environment factory as a string; `load_object`
turns it into the object once, where the config is read, and every way it can fail is one
line naming the config key, the path and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any

__all__ = ["load_object"]


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _import_file(path: str, key: str, spec: str) -> Any:
    """The module of a Python file, imported once (cached in `sys.modules`)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ValueError(f"{key}: {spec!r}: no file {full}; give an existing .py file or a "
                         "module on sys.path (pkg.mod:attr)")
    stem = os.path.splitext(os.path.basename(full))[0]
    # A name of its own per file: two files called `rewards.py` do not replace each other.
    name = f"_jaxrl_lp_user_{stem}_{hashlib.blake2b(full.encode(), digest_size=4).hexdigest()}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{key}: {spec!r}: {path} is not a Python file; give a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickle look the module up
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - anything the user's module raises is reported
        del sys.modules[name]
        raise ValueError(f"{key}: importing {path} (from {spec!r}) raised {type(e).__name__}: "
                         f"{_one_line(e)}") from None
    return module


def _import_module(name: str, key: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # Missing itself (or a parent package), or one of the modules it imports?
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ValueError(f"{key}: {spec!r}: no module named {e.name!r} on sys.path; add its "
                             "directory to PYTHONPATH, or give a file (path/to/file.py:attr)") from None
        raise ValueError(f"{key}: importing {name!r} (from {spec!r}) raised ModuleNotFoundError: "
                         f"{_one_line(e)}; install it or fix the import") from None
    except BaseException as e:  # noqa: BLE001 - anything the user's module raises is reported
        raise ValueError(f"{key}: importing {name!r} (from {spec!r}) raised {type(e).__name__}: "
                         f"{_one_line(e)}") from None


def load_object(spec: str, key: str) -> Any:
    """The object an import path names.

    `pkg.mod:attr` imports `pkg.mod` with `sys.path` as it is (`PYTHONPATH` names a user's
    directory); `path/to/file.py:attr` imports that file (relative to the working
    directory). `attr` may be dotted (`mod:Class.method`).

    Args:
      spec: the import path.
      key: the config key the path came from, named by every error.

    Returns:
      The object.

    Raises:
      ValueError: one line naming `key`, `spec` and the fix: no colon, no such module or
        file, an attribute the module lacks, or the import raised.

    Examples:
      >>> load_object("os.path:join", "task.rewards")("a", "b")
      'a/b'
    """
    module_name, colon, attr = spec.strip().rpartition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"{key}: {spec!r} is not an import path; write module:attribute "
                         "(mymod:reward_fn) or path/to/file.py:attribute")
    is_file = module_name.endswith(".py") or "/" in module_name or os.sep in module_name
    if is_file:
        module = _import_file(module_name, key, spec)
    else:
        module = _import_module(module_name, key, spec)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
            raise ValueError(f"{key}: {spec!r}: {module_name} has no attribute {attr!r} "
                             f"(it defines {', '.join(public) or 'nothing public'})")
        obj = getattr(obj, part)
    return obj
