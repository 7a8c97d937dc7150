"""Help text built from the code: every config key with its default and doc, option defaults.

The config listing of `jaxrl-lp train --help` is generated from the config
dataclasses (their fields, and the `Attributes:` sections of their
docstrings), so a new field shows up in the help, and a field without a doc
line fails `tests/test_config.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import textwrap
from typing import Any

__all__ = ["ConfigKeysFormatter", "add_config_keys_help", "config_help", "config_keys",
           "field_docs", "show_defaults"]

WIDTH = 100


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description, from the `Attributes:` section of `cls`'s docstring.

    An entry is `name: text` (continued on more-indented lines); `a / b: text`
    and `a, b: text` document several fields at once.
    """
    lines = (inspect.getdoc(cls) or "").splitlines()
    docs: dict[str, str] = {}
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return docs
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            if names:
                continue
            break
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        if depth == indent and ":" in line:
            head, text = line.strip().split(":", 1)
            names = [n.strip().strip("`") for n in re.split(r"[/,]", head) if n.strip()]
            for n in names:
                docs[n] = text.strip()
        elif names:
            for n in names:
                docs[n] = f"{docs[n]} {line.strip()}".strip()
    return {k: v.replace("`", "") for k, v in docs.items()}


def _summary(cls: type) -> str:
    return (inspect.getdoc(cls) or "").split("\n", 1)[0].replace("`", "")


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=\.)\s+(?=[A-Z])", text, maxsplit=1)[0]


def _show(value: Any) -> str:
    """A value as `--set` takes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if value == "":
        return "''"
    return str(value)


def config_keys(cfg: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, value, description) of every field of `cfg` and its sections, in field order."""
    docs = field_docs(type(cfg))
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += config_keys(value, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", value, _first_sentence(docs.get(f.name, ""))))
    return out


def config_help(cfg: Any) -> str:
    """The `config keys` section of `jaxrl-lp train --help`: sections, keys, defaults, docs."""
    out = ["config keys (--set KEY=VALUE; the values shown are the defaults of the embedded",
           "default run; `jaxrl-lp config` prints the resolved config):"]
    col = 40  # descriptions start here, wrapped to WIDTH, as argparse lays out options
    keys = config_keys(cfg)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.append(f"  {f.name}: {_summary(type(value))}")
            rows = [k for k in keys if k[0].startswith(f"{f.name}.")]
        else:
            rows = [k for k in keys if k[0] == f.name]
        for key, val, doc in rows:
            head = f"    {key} = {_show(val)}"
            lines = textwrap.wrap(doc, WIDTH - col) or [""]
            if len(head) < col - 1:
                out.append(head.ljust(col) + lines.pop(0))
            else:
                out.append(head)
            out += [" " * col + line for line in lines]
    return "\n".join(out)


CONFIG_KEYS = "<config keys>"  # an epilog that `ConfigKeysFormatter` expands


class ConfigKeysFormatter(argparse.RawDescriptionHelpFormatter):
    """Expands the `CONFIG_KEYS` epilog into `config_help` of the embedded default config.

    The listing is built only when help is printed (it imports the training
    package); usage lines and errors never include the epilog.
    """

    def add_text(self, text):
        if text == CONFIG_KEYS:
            from jaxrl_lp.train.defaults import default_config

            text = config_help(default_config())
        super().add_text(text)


def add_config_keys_help(parser: argparse.ArgumentParser) -> None:
    """Makes `parser --help` end with every config key, its default and its description."""
    parser.epilog = CONFIG_KEYS
    parser.formatter_class = ConfigKeysFormatter


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Appends `(default: X)` to the help of every option with a meaningful default.

    Options whose default is None, False or empty (flags, "unset") and
    options whose help already names its default are left as they are.
    """
    for action in parser._actions:  # argparse keeps a parser's options here
        d = action.default
        if not action.option_strings or d is None or d is False or d is argparse.SUPPRESS \
                or (isinstance(d, (str, list)) and not d):
            continue
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower():
            continue
        action.help = f"{text} (default: %(default)s)".strip()
