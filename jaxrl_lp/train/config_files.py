"""Configs from files and the command line: Python config files, a run's `config.json`, `--set a.b=c`.

The dataclasses themselves are `train.config`; everything here builds one of
them through its constructor, so every value read is validated where it is
defined, and an error names the key as the user wrote it (`grpo.lr`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Literal

from jaxrl_lp.fields import user_key
from jaxrl_lp.train.config import TrainConfig

__all__ = ["apply_overrides", "config_from_dict", "load_config", "load_run_file"]


def _convert(value: str, current: Any, hint: Any, key: str) -> Any:
    """Parses an override string to the type of the field it replaces."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ValueError(f"--set {key}={value}: allowed values are {list(allowed)}")
        return value
    args = typing.get_args(hint)
    if value in ("None", "none", "null") and (type(None) in args or current is None):
        return None
    kinds = [a for a in args if a is not type(None)] if origin in (typing.Union, types.UnionType) \
        else [hint]
    kind = kinds[0] if kinds else type(current)
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError("expected true or false")
            return value.lower() in ("true", "1")
        if kind in (int, float, str):
            try:
                return kind(value)
            except ValueError:
                raise ValueError("expected an integer" if kind is int else "expected a number") \
                    from None
    except ValueError as e:
        raise ValueError(f"--set {key}={value}: {e}") from None
    raise ValueError(f"--set {key}: cannot override a field of type {kind}")


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Applies `a.b=c` overrides to nested frozen dataclasses; unknown keys are errors.

    All overrides of a section are applied together, so fields that are
    validated against each other (e.g. `task.kind` and `task.path`) can be set
    in any order.
    """
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. grpo.lr=1e-3)")
        key, value = (x.strip() for x in item.split("=", 1))
        node = tree
        *parents, leaf = key.split(".")
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"config key {key!r} conflicts with another override")
        node[leaf] = (key, value)
    return _apply(cfg, tree)


def _apply(obj: Any, tree: dict, prefix: str = "") -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    changes = {}
    for name, sub in tree.items():
        if name not in fields:
            key = sub[0] if isinstance(sub, tuple) else name
            raise ValueError(f"unknown config key {key!r}: {type(obj).__name__} has no field "
                             f"{name!r}; valid: {sorted(fields)}")
        current = getattr(obj, name)
        if isinstance(sub, dict):
            if not dataclasses.is_dataclass(current):
                raise ValueError(f"unknown config key: {name!r} is not a section")
            changes[name] = _apply(current, sub, f"{prefix}{name}.")
        else:
            key, value = sub
            if dataclasses.is_dataclass(current):
                raise ValueError(f"config key {key!r} is a section; set one of its fields")
            changes[name] = _convert(value, current, hints[name], key)
    return _build(dataclasses.replace, obj, prefix, **changes)


def _build(make, what: Any, prefix: str, **kwargs) -> Any:
    """`make(what, **kwargs)`, with a library config's `ClassName.field` errors named `prefix.field`."""
    try:
        return make(what, **kwargs)
    except ValueError as e:
        cls = what if isinstance(what, type) else type(what)
        raise ValueError(user_key(str(e), cls.__name__, prefix.rstrip("."))) from None


def config_from_dict(data: dict, cls: type = None, where: str = "") -> Any:
    """Rebuilds a config dataclass (default `TrainConfig`) from `dataclasses.asdict` output.

    This reads the `config.json` a run directory records. Keys the dataclass
    does not have are errors (a config written by another version); missing
    keys take their defaults.
    """
    cls = cls or TrainConfig
    if not isinstance(data, dict):
        raise ValueError(f"config {where or '<root>'}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"config {where or '<root>'}: unknown keys {unknown}; "
                         f"{cls.__name__} has {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = config_from_dict(value, hint, f"{where}{name}.")
        else:
            kwargs[name] = value
    return _build(lambda c, **kw: c(**kw), cls, where, **kwargs)


def load_config(path: str | None) -> TrainConfig:
    """Loads a config: a Python file defining `CONFIG` (see `configs/`), a run's
    `config.json`, or (no path) the embedded default. A Python file that defines only a
    `TASK` gets the embedded default config (`load_run_file` returns the task too)."""
    return load_run_file(path)[0]


def load_run_file(path: str | None) -> tuple[TrainConfig, Any]:
    """The config and the task object of a config file: `(CONFIG, TASK)`.

    A Python file may define `CONFIG = TrainConfig(...)`, `TASK = <a tasks.Task>` or both
    (`jaxrl-lp train --config my_task.py` trains its `TASK` with its `CONFIG`, or the
    embedded default config); a JSON file or no path has no task (None).

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file does not parse, raises, or defines neither name (one line).
    """
    if not path:
        from jaxrl_lp.train.defaults import default_config

        return default_config(), None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist")
    if p.suffix == ".json":
        import json

        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path!r} is not valid JSON ({e})") from None
        return config_from_dict(data), None
    spec = importlib.util.spec_from_file_location(f"jaxrl_lp_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(f"config file {path!r} line {e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - whatever the user's file raises is reported in one line
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if Path(f.filename).resolve() == p.resolve()]
        where = f" line {frames[-1].lineno}" if frames else ""
        text = " ".join(str(e).split())
        raise ValueError(f"config file {path!r}{where}: {type(e).__name__}: {text}") from None
    cfg, task = getattr(module, "CONFIG", None), getattr(module, "TASK", None)
    if cfg is None and task is not None:
        from jaxrl_lp.train.defaults import default_config

        cfg = default_config()
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"config file {path!r} must define CONFIG = TrainConfig(...) and/or "
                         "TASK = <your task object>")
    return cfg, task
