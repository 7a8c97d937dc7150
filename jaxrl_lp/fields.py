"""Checks of single config fields; every error names the key as a user types it (`grpo.lr`).

The config dataclasses call these from `__post_init__`, so a bad value is
refused where it is made (a `--set` override, a config file, a run's
`config.json`), before a run builds or writes anything.

    >>> check_int("run.checkpoint_every", 0, minimum=1)
    Traceback (most recent call last):
    ValueError: run.checkpoint_every must be an integer >= 1; got 0
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "check_str", "user_key"]


def check_int(key: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              why: str = "") -> None:
    """An integer (not a bool) in `[minimum, maximum]`; `why` is appended to the message."""
    bounds = [f">= {minimum}"] if minimum is not None else []
    bounds += [f"<= {maximum}"] if maximum is not None else []
    ok = (isinstance(value, numbers.Integral) and not isinstance(value, bool)
          and (minimum is None or value >= minimum) and (maximum is None or value <= maximum))
    if not ok:
        want = " ".join(["an integer", " and ".join(bounds)]).rstrip()
        raise ValueError(f"{key} must be {want}{why}; got {value!r}")


def check_number(key: str, value: Any, *, gt: float | None = None, ge: float | None = None,
                 lt: float | None = None, why: str = "") -> None:
    """A finite real number (not a bool) with the given strict/non-strict bounds."""
    parts = [f"> {gt}" if gt is not None else "", f">= {ge}" if ge is not None else "",
             f"< {lt}" if lt is not None else ""]
    want = " and ".join(p for p in parts if p)
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value)
          and (gt is None or value > gt) and (ge is None or value >= ge)
          and (lt is None or value < lt))
    if not ok:
        raise ValueError(f"{key} must be a finite number{' ' + want if want else ''}{why}; "
                         f"got {value!r}")


def check_bool(key: str, value: Any) -> None:
    """`True` or `False` (on the command line: true/false/1/0)."""
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false; got {value!r}")


def check_str(key: str, value: Any, *, nonempty: bool = False, what: str = "a string") -> None:
    """A string (non-empty when `nonempty`); `what` describes it in the message."""
    if not isinstance(value, str) or (nonempty and not value.strip()):
        raise ValueError(f"{key} must be {what}; got {value!r}")


def check_choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    """One of `allowed`."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def user_key(message: str, cls_name: str, prefix: str) -> str:
    """Rewrites `ClassName.field` in a library class's message as the user's key `prefix.field`.

    Library configs (`ModelConfig`, `LossConfig`) name their fields by class, which
    is right for Python callers; a `--set` user knows them as `model.x`, `loss.x`.
    """
    return message.replace(f"{cls_name}.", f"{prefix}.") if prefix else message
