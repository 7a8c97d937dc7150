"""What the profile scripts share: XLA op names from HLO text, op times from a profiler trace,
and how a result is printed.

Imported by `profile_update.py` and `profile_sampler.py` (run as scripts, so
this folder is on `sys.path`).
"""

from __future__ import annotations

import collections
import glob
import json
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
    {op: events per call}, what the trace held), over the events of the ops in
    `names` (HLO instructions): on CPU the XLA executor threads' lines, on a GPU
    its device planes' `XLA Ops` line (an event name may carry the HLO's `%`).
    The last value names the planes and lines whose events matched (`lines`) and,
    where none did, a sample of each line's event names (`unmatched`), so a trace
    of another layout says what it held instead of an empty table.
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
    matched, sample = collections.Counter(), {}
    for plane in profile.planes:
        for line in plane.lines:
            if "XLA" not in line.name:  # the executor's threads or the device's op line
                continue
            where = f"{plane.name}/{line.name}"
            for ev in line.events:
                name = ev.name.lstrip("%")
                if name in names:
                    total[name] += ev.duration_ns / 1e9 / calls
                    count[name] += 1
                    matched[where] += 1
                elif len(sample.setdefault(where, [])) < 8:
                    sample[where].append(ev.name[:80])
    trace = {"lines": dict(matched)}
    if not matched:
        trace["unmatched"] = sample
    return seconds, total, {name: c // calls for name, c in count.items()}, trace


def emit(result: dict, out: str | None) -> None:
    """Prints `result` as JSON, and writes it to `out` too when given (`--out`)."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
