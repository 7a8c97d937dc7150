"""`EnvRunner`: the environments of many episodes stepped at once, on host threads, each call
with a timeout.

A failing environment never stops a run: one that raises ends its episode with
`info["failed"] = "error: <Type>: <message>"`, one that does not answer within
`timeout_s` with `"timeout"` (its thread is left behind: a daemon, never joined), one
that returns something else than a `StepResult` with `"error: ..."`; each such
episode gets `failure_reward`. The other rows are stepped as usual and every result
comes back in row order.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Sequence

from jaxrl_lp.envs.base import Environment, StepResult, Turn

__all__ = ["EnvRunner"]


class EnvRunner:
    """Steps environments on host threads (at most `max_workers` at once), each call
    bounded by `timeout_s`.

    Attributes:
      seconds: wall seconds spent in `step` so far.
      calls: environment calls made.
      failures: failed calls by kind (`error`, `timeout`).

    Args:
      timeout_s: seconds one environment call may take, > 0.
      max_workers: environment calls running at once, >= 1 (a call left behind after
        its timeout no longer counts).
      failure_reward: the reward of a turn whose environment failed.

    Examples:
      >>> runner = EnvRunner(timeout_s=5.0)
      >>> task = CalculatorTask()
      >>> env = task.make_env(); prompt_ids = env.reset(task.train[0])
      >>> turn = Turn(tuple(task.tokenizer.encode("23")), "23", "eos")
      >>> [r if r is None else r.done for r in runner.step([env, env], [turn, None])]
      [True, None]
    """

    def __init__(self, *, timeout_s: float = 10.0, max_workers: int = 8,
                 failure_reward: float = 0.0):
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) \
                or not timeout_s > 0:
            raise ValueError(f"EnvRunner: timeout_s={timeout_s!r} must be a number > 0")
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
            raise ValueError(f"EnvRunner: max_workers={max_workers!r} must be an int >= 1")
        if isinstance(failure_reward, bool) or not isinstance(failure_reward, (int, float)) \
                or not math.isfinite(failure_reward):
            raise ValueError(f"EnvRunner: failure_reward={failure_reward!r} must be a finite "
                             "number")
        self.timeout_s, self.max_workers = float(timeout_s), max_workers
        self.failure_reward = float(failure_reward)
        self.seconds, self.calls = 0.0, 0
        self.failures: collections.Counter[str] = collections.Counter()

    def _failed(self, why: str) -> StepResult:
        self.failures[why.split(":")[0]] += 1
        return StepResult(reward=self.failure_reward, done=True, info={"failed": why})

    def step(self, envs: Sequence[Environment],
             turns: Sequence[Turn | None]) -> list[StepResult | None]:
        """Each environment's answer to its turn (None turn: None, the row not stepped)."""
        if len(envs) != len(turns):
            raise ValueError(f"EnvRunner.step: {len(envs)} environments for {len(turns)} turns")
        t0 = time.perf_counter()
        results: list[StepResult | None] = [None] * len(envs)
        todo = [i for i, t in enumerate(turns) if t is not None]
        answers: queue.Queue = queue.Queue()

        def call(i):
            try:
                answers.put((i, True, envs[i].step(turns[i])))
            # BaseException too: an env's `sys.exit()` would otherwise end its thread
            # silently and be reported, `timeout_s` later, as a hang.
            except BaseException as e:  # noqa: BLE001 - any failure of a user's env is recorded
                answers.put((i, False, f"error: {type(e).__name__}: {e}"[:300]))

        started: dict[int, float] = {}
        pending = list(todo)
        while pending or started:
            while pending and len(started) < self.max_workers:
                i = pending.pop(0)
                started[i] = time.perf_counter()
                threading.Thread(target=call, args=(i,), daemon=True).start()
            deadline = min(started.values()) + self.timeout_s
            try:
                i, ok, value = answers.get(timeout=max(deadline - time.perf_counter(), 0.0))
            except queue.Empty:  # the oldest call ran out of time: left behind
                i = min(started, key=started.get)
                del started[i]
                results[i] = self._failed("timeout")
                continue
            if i not in started:  # a late answer of a call already timed out
                continue
            del started[i]
            if not ok:
                results[i] = self._failed(value)
            elif not isinstance(value, StepResult):
                results[i] = self._failed(f"error: step returned {type(value).__name__}, "
                                          "not a StepResult")
            else:
                results[i] = value
        self.calls += len(todo)
        self.seconds += time.perf_counter() - t0
        return results

    def close(self) -> None:
        """Nothing to release: calls run on daemon threads, a hung one is never joined."""
