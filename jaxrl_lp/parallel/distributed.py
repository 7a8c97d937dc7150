"""Several processes, one program: `jax.distributed` from the `distributed` config section.

Every process runs the same `jaxrl-lp train` command; `jax.distributed.initialize`
connects them through a coordinator, after which `jax.devices()` lists every
process's devices and one mesh spans them all. Three ways to say how:

- `distributed.coordinator=''` (default): one process, no initialization.
- `distributed.coordinator=auto`: the cluster tells (SLURM, Open MPI, TPU pod
  slices, Kubernetes with JAX's environment variables): `initialize()` with no
  arguments.
- `distributed.coordinator=HOST:PORT` with `distributed.num_processes` and
  `distributed.process_id` (or the environment variables
  `JAXRL_LP_PROCESS_ID` / `JAXRL_LP_NUM_PROCESSES`, so one command line serves
  every process).

A coordinator that cannot be reached fails within `distributed.timeout_s`
seconds with one line naming the address.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import jax

from jaxrl_lp.fields import check_int, check_str

__all__ = ["DistributedConfig", "initialize"]


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How the processes of a multi-process run find each other.

    Attributes:
      coordinator: '' (one process), 'auto' (from the cluster's environment:
        SLURM, Open MPI, TPU pods) or HOST:PORT of process 0's coordinator.
      num_processes: processes in the run (with HOST:PORT; -1: from
        $JAXRL_LP_NUM_PROCESSES).
      process_id: this process's index (with HOST:PORT; -1: from
        $JAXRL_LP_PROCESS_ID).
      timeout_s: seconds to wait for the coordinator and the other processes.
    """

    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0
    timeout_s: int = 300

    def __post_init__(self):
        check_str("distributed.coordinator", self.coordinator, what="'', 'auto' or HOST:PORT")
        check_int("distributed.num_processes", self.num_processes, minimum=-1)
        check_int("distributed.process_id", self.process_id, minimum=-1)
        check_int("distributed.timeout_s", self.timeout_s, minimum=1)
        c = self.coordinator
        if c not in ("", "auto"):
            host, sep, port = c.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"distributed.coordinator={c!r} must be '', 'auto' or HOST:PORT "
                                 "(e.g. 10.0.0.1:8476)")
        if self.num_processes == 0:
            raise ValueError("distributed.num_processes must be >= 1 (or -1: from "
                             "$JAXRL_LP_NUM_PROCESSES)")

    def resolved(self) -> tuple[int, int]:
        """(num_processes, process_id), reading the environment for -1."""
        n, i = self.num_processes, self.process_id
        try:
            n = int(os.environ["JAXRL_LP_NUM_PROCESSES"]) if n == -1 else n
            i = int(os.environ["JAXRL_LP_PROCESS_ID"]) if i == -1 else i
        except (KeyError, ValueError) as e:
            raise ValueError(f"distributed: {e} is not set to an integer; export it or set "
                             "distributed.num_processes / process_id") from None
        if not 0 <= i < n:
            raise ValueError(f"distributed.process_id={i} must be in [0, "
                             f"distributed.num_processes={n})")
        return n, i


def initialize(cfg: DistributedConfig) -> None:
    """Joins the run's processes (a no-op for one process, or when already joined).

    Raises:
      ValueError: the coordinator cannot be reached within `timeout_s`, or the
        settings are inconsistent; one line naming the address.
    """
    if not cfg.coordinator or jax.distributed.is_initialized():
        return
    if os.environ.get("JAX_PLATFORMS", "cpu").startswith("cpu"):
        # Collectives between CPU processes (tests, CPU clusters) go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        if cfg.coordinator == "auto":
            jax.distributed.initialize(initialization_timeout=cfg.timeout_s)
            return
        n, i = cfg.resolved()
        if i != 0:  # JAX aborts the process when it cannot reach the coordinator: look first
            _wait_for(cfg.coordinator, cfg.timeout_s)
        jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=n,
                                   process_id=i, initialization_timeout=cfg.timeout_s)
    except (RuntimeError, ValueError) as e:  # the runtime's own error is a long C++ status
        first = " ".join(str(e).split())[:200]
        raise ValueError(f"distributed.coordinator={cfg.coordinator!r}: the processes could not "
                         f"join within {cfg.timeout_s} s ({first}); check the address, that "
                         "process 0 runs, and distributed.timeout_s") from None


def _wait_for(address: str, timeout_s: int) -> None:
    """Returns once something listens at `address` (HOST:PORT); ValueError after `timeout_s`."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"distributed.coordinator={address!r}: the processes could not join within "
                    f"{timeout_s} s (nothing accepts connections there: {e.strerror or e}); start "
                    "process 0 (the coordinator) or check the address and "
                    "distributed.timeout_s") from None
            time.sleep(0.5)
