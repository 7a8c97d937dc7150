"""Progress bars of a training run: one per phase (warm-start, then GRPO).

A warm-start step and a GRPO step differ in cost by orders of magnitude, so a
single bar over both would show a meaningless rate and ETA. Each phase gets its
own bar, with its own rate and ETA; the warm-start bar is closed when its last
step is done and the GRPO bar opens at once (it then shows 0/N while the
first GRPO step compiles). A resumed run opens the bar of the phase it resumes
in, with the steps already done counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PhaseProgress"]


class PhaseProgress:
    """Progress bars over consecutive phases of a run, indexed by the global step.

    Args:
      phases: (name, steps) in order, e.g. `[("warm-start", 1200), ("grpo", 60)]`;
        phases of 0 steps are skipped.
      step: the global step the run starts (or resumes) at.
      enabled: False makes every method a no-op.
      make_bar: the bar factory (`tqdm.tqdm` by default), called with `total`,
        `initial`, `desc` and `unit`.

    Examples:
      >>> bars = PhaseProgress([("warm-start", 2), ("grpo", 1)], step=0)
      >>> for step in (1, 2, 3):
      ...     bars.update(step, {"loss": 0.5})
      >>> bars.close()
    """

    def __init__(self, phases: Sequence[tuple[str, int]], step: int, *, enabled: bool = True,
                 make_bar: Callable[..., Any] | None = None):
        self._spans = []
        start = 0
        for name, steps in phases:
            self._spans.append((name, start, start + steps))
            start += steps
        self._enabled = enabled
        self._make_bar = make_bar
        self._bar = None
        self._end = 0
        if enabled:
            self._open(step)

    def _open(self, step: int) -> None:
        """Opens the bar of the phase that `step` (the next step to run) belongs to."""
        for name, start, end in self._spans:
            if start <= step < end:
                make = self._make_bar
                if make is None:
                    from tqdm import tqdm as make
                self._bar = make(total=end - start, initial=step - start, desc=name, unit="step")
                self._end = end
                return

    def update(self, step: int, postfix: dict[str, float] | None = None) -> None:
        """Records that global step `step` is done (steps count from 1), with optional figures."""
        if self._bar is None:
            return
        self._bar.update(1)
        if postfix:
            self._bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items()})
        if step >= self._end:
            self._bar.close()
            self._bar = None
            self._open(step)

    def close(self) -> None:
        """Closes the open bar (an interrupted or finished run)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
