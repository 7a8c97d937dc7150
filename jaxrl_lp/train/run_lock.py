"""An exclusive lock on a run directory: one `jaxrl-lp train` per run at a time.

The lock is an advisory `flock` on `<run_dir>/.lock`, held for the whole run
and released by the kernel when the process ends, however it ends (a SIGKILL
included), so a stale lock never blocks a resume. The holder writes its pid
into the file; a second process only reads it, to name the holder in its
error, and touches nothing else of the run.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["RunLock", "RunLockedError"]

LOCK_FILE = ".lock"


class RunLockedError(ValueError):
    """The run directory is in use by another process."""


class RunLock:
    """`with RunLock(run_dir):` holds the run directory's lock (or raises `RunLockedError`).

    The directory must exist. Not reentrant: a second `RunLock` on the same
    directory in the same process is refused too.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLockedError(
                f"run directory {str(self.path.parent)!r} is in use by another jaxrl-lp process "
                f"(pid {holder}); wait for it to finish, or train into another --set "
                "run.out_dir=...") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
