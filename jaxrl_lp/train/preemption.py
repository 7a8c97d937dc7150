"""Stopping a run on SIGTERM or SIGINT with a checkpoint (`run.save_on_signal`).

A TPU VM preemption, a spot reclaim, SLURM's `--signal` and Ctrl-C all send a
signal and, usually, a grace period. `SignalGuard` turns the first SIGTERM or
SIGINT into a request: the training loop finishes the step it is in (a
checkpoint save in progress completes), writes a checkpoint of the step it
reached, flushes the metrics and raises `Preempted`, which the command line
reports in one line with exit status `EXIT_PREEMPTED` (75, EX_TEMPFAIL: run
the same command again to resume). A second signal exits at once
(`os._exit(128 + signal)`): orbax writes a checkpoint to a temporary
directory and renames it when complete, so the newest finished checkpoint is
untouched whatever was being written.

Across processes (`jax.distributed`) the request is agreed after every step
(`agreed`: the maximum over processes of each one's flag), so every process
stops after the same step and saves the same checkpoint, whichever of them the
signal reached first.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np

__all__ = ["EXIT_PREEMPTED", "Preempted", "SignalGuard"]

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped on a signal, resumable
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):  # noqa: N818 - it names what happened, not an error
    """The run stopped on a signal after saving a checkpoint of `step` (resume it)."""

    def __init__(self, step: int, signum: int, run_dir: str):
        self.step, self.signum, self.run_dir = step, signum, run_dir
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; its checkpoint is in {run_dir}: "
                         "run the same command to resume")


class SignalGuard:
    """Catches SIGTERM and SIGINT while a run is in it (a context manager).

    `requested` is the first signal's number (0: none). Outside the main thread
    (where Python cannot install handlers) or with `enabled=False` it does
    nothing and the signals keep their usual effect.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = 0
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested:  # the second signal: now, without writing anything
            print(f"jaxrl-lp: second {signal.Signals(signum).name}: exiting at once; the newest "
                  "finished checkpoint is untouched", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = signum
        print(f"jaxrl-lp: {signal.Signals(signum).name}: finishing this step, then saving a "
              "checkpoint (a second signal exits at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> SignalGuard:
        if self.enabled:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def agreed(self) -> int:
        """The signal every process stops for after this step (0: none); collective across
        processes (every process calls it after every step)."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.requested))
        return int(np.max(flags))
