"""What the profile scripts share: XLA op names from HLO text, and op times from a profiler trace.

Imported by `profile_update.py` and `profile_sampler.py` (run as scripts, so
this folder is on `sys.path`).
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its `op_name` metadata (the jaxpr path it lowers); first wins."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([^\s=]+) = ", line)
        n = re.search(r'op_name="([^"]*)"', line)
        if m and n:
            out.setdefault(m.group(1), n.group(1))
    return out


def op_times(call, calls: int, names: dict[str, str]):
    """Runs `call()` `calls` times under `jax.profiler.trace`.

    Returns (seconds per call under the profiler, {op: seconds per call},
    {op: events per call}), over the XLA executor threads' events of the ops in
    `names` (HLO instructions, not the executor's own spans).
    """
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        jax.profiler.start_trace(d)
        for _ in range(calls):
            call()
        jax.profiler.stop_trace()
        seconds = (time.perf_counter() - t) / calls
        profile = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    total, count = collections.Counter(), collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if "XLA" not in line.name:  # the executor's threads, not Python's
                continue
            for ev in line.events:
                if ev.name in names:
                    total[ev.name] += ev.duration_ns / 1e9 / calls
                    count[ev.name] += 1
    return seconds, total, {name: c // calls for name, c in count.items()}
