"""XLA's GPU flags as a run setting (`run.xla_gpu_flags`): named presets, set in `XLA_FLAGS`
before JAX starts its backend.

XLA reads `XLA_FLAGS` once per process, when its first backend starts; a flag set
after that does nothing. So a preset is applied at the boundary where a run's config
is read, before any JAX computation (`apply`), and refused with one line where it
cannot take effect any more.

Presets (comma-separated to combine, e.g. `decode_graphs,scheduler`):

- `none`: nothing added; XLA's own defaults (the default).
- `decode_graphs`: CUDA graphs (XLA's command buffers) around the sampler's decode
  loop. XLA captures fusions, products and custom calls by default but not a
  `while` loop or a `conditional`, so each decode step is launched op by op, and
  the loop's predicate goes back to the host once a step;
  `--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL` adds them to what is
  captured (a CUDA 12.3+ conditional node runs the loop on the device), and
  `--xla_gpu_command_buffer_unroll_loops=true` unrolls a loop of known trip count
  into the graph instead.
- `scheduler`: `--xla_gpu_enable_latency_hiding_scheduler=true`, XLA's scheduler
  that overlaps independent work (collectives, copies) with compute.

None of them changes what a program computes, only how it is launched and
ordered, so the sampler's and the replay's bits are unchanged (a GPU session
checks it: `benchmarks/gpu.sh`, `SUITE=graphs`). What each gains on a GPU is
not measured yet; none is on by default until one is.
"""

from __future__ import annotations

import os

__all__ = ["PRESETS", "apply", "flags_for", "parse"]

PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "decode_graphs": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
                      "--xla_gpu_command_buffer_unroll_loops=true"),
    "scheduler": ("--xla_gpu_enable_latency_hiding_scheduler=true",),
}


def parse(text: str, field: str = "run.xla_gpu_flags") -> tuple[str, ...]:
    """The preset names of `text` (comma-separated, in order, each once); ValueError naming
    `field` and the presets otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string of presets ({', '.join(PRESETS)}), "
                         f"got {text!r}")
    names = tuple(s.strip() for s in text.split(","))
    bad = [n for n in names if n not in PRESETS]
    if bad or not names:
        raise ValueError(f"{field}: unknown preset {bad[0] if bad else text!r}; allowed: "
                         f"{', '.join(PRESETS)} (comma-separated to combine)")
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: {text!r} names a preset twice")
    if "none" in names and len(names) > 1:
        raise ValueError(f"{field}: 'none' adds no flag and combines with nothing; got {text!r}")
    return names


def flags_for(presets: tuple[str, ...]) -> tuple[str, ...]:
    """The XLA flags of the parsed `presets`, in order."""
    return tuple(f for p in presets for f in PRESETS[p])


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def apply(presets: tuple[str, ...], field: str = "run.xla_gpu_flags",
          environ: dict | None = None) -> str:
    """Appends the flags of `presets` to `XLA_FLAGS` in `environ` (default `os.environ`);
    returns the new value.

    A flag already there with the same value is left as it is. ValueError, one line
    naming `field`: a flag already there with another value (the environment's wins:
    say one), or flags to add after JAX's backend started (XLA read `XLA_FLAGS` then).
    """
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "").split()
    have = {_name(f): f for f in current}
    add = []
    for flag in flags_for(presets):
        if _name(flag) in have:
            if have[_name(flag)] != flag:
                raise ValueError(f"{field}: XLA_FLAGS already sets {have[_name(flag)]}, the "
                                 f"preset sets {flag}; unset one")
            continue
        add.append(flag)
    if add and environ is None and _backend_started():
        raise ValueError(f"{field}={','.join(presets)} cannot apply: JAX's backend has "
                         f"started and XLA read XLA_FLAGS then; set XLA_FLAGS='{' '.join(add)}' "
                         "in the environment, or set the key before any JAX computation")
    value = " ".join(current + add)
    env["XLA_FLAGS"] = value
    return value


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()
