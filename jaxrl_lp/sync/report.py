"""Results of the sync checks: `CheckResult`, `SyncReport`, and the `SamplerState` they read."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_lp.numerics.policy import Policy, require

__all__ = ["CheckResult", "SamplerState", "SyncReport"]

_SHOW = 4  # problems listed in a check's details


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check's outcome: its name, pass/fail, and what it found (or checked)."""

    name: str
    passed: bool
    details: str


@dataclasses.dataclass
class SamplerState:
    """What the sampler holds.

    Attributes:
      params: its served tree (arrays and `QArray`s).
      version: the learner step whose export it holds.
      cache_version: the weights version its caches (KV, prefix) were built on;
        None when it holds no cache.
      policy: the precision `Policy` it runs, if known.
    """

    params: Any
    version: int
    cache_version: int | None = None
    policy: Policy | None = None

    def __post_init__(self):
        if self.policy is not None:
            require(self.policy, "SamplerState")


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """The seven `CheckResult`s of `run_sync_checks`; `str()` prints one line per check."""

    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if not r.passed)

    def metrics(self) -> dict[str, float]:
        """`{"sync/<check>": 1.0 or 0.0}` for logging."""
        return {f"sync/{r.name}": float(r.passed) for r in self.results}

    def __str__(self) -> str:
        head = f"sync checks: {'all passed' if self.passed else f'{len(self.failures)} failed'}"
        lines = [f"  [{'PASS' if r.passed else 'FAIL'}] {r.name}: {r.details}" for r in self.results]
        return "\n".join([head, *lines])


def result(name: str, problems: list[str], ok: str) -> CheckResult:
    """Passed with `ok` as details when `problems` is empty, else failed listing the first few."""
    if not problems:
        return CheckResult(name, True, ok)
    more = f" (+{len(problems) - _SHOW} more)" if len(problems) > _SHOW else ""
    return CheckResult(name, False, "; ".join(problems[:_SHOW]) + more)
