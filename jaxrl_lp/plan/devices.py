"""Simulated devices for `jaxrl-lp plan`: N CPU devices stand in for N accelerators.

XLA's CPU client makes N devices when `--xla_force_host_platform_device_count=N`
is in `XLA_FLAGS` (JAX's `jax_num_cpu_devices` says the same), but only when
it is created: the number is fixed once jax has initialized its backends.
So `use_simulated_devices(n)` sets both, with `JAX_PLATFORMS=cpu`, when jax
has not initialized yet (the case of the `jaxrl-lp plan` command) and says
whether the process has enough devices; when it has not, `rerun` runs the
same command in a child process with those settings (a test session, or a
program that has already used jax with fewer devices).

Programs are only lowered and compiled on these devices, never run, so their
memory is never allocated.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax

__all__ = ["rerun", "simulated_env", "use_simulated_devices"]

_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def _backends_ready() -> bool:
    from jax._src import xla_bridge  # no public query: "have backends been created?"

    return xla_bridge.backends_are_initialized()


def simulated_env(n: int, env: dict | None = None) -> dict:
    """`env` (default: this process's) with `XLA_FLAGS` asking for n CPU devices and
    `JAX_PLATFORMS=cpu`."""
    env = dict(os.environ if env is None else env)
    flags = _COUNT.sub("", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def use_simulated_devices(n: int) -> bool:
    """Asks for n simulated CPU devices if jax has not started; True if n devices are there.

    Args:
      n: the number of devices to simulate.

    Returns:
      Whether `jax.devices()` now has at least n devices (a plan then uses the
      first n); False means `rerun` is needed.
    """
    if not _backends_ready():
        os.environ.update({k: v for k, v in simulated_env(n).items()
                           if k in ("XLA_FLAGS", "JAX_PLATFORMS")})
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    return jax.device_count() >= n


def rerun(argv: list[str], n: int) -> int:
    """Runs `jaxrl-lp *argv` in a child process with n simulated devices; its exit status.

    The child's output goes straight to this process's stdout and stderr.
    """
    cmd = [sys.executable, "-m", "jaxrl_lp.cli.main", *argv]
    return subprocess.run(cmd, env=simulated_env(n), check=False).returncode
