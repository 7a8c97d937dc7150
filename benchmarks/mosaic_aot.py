"""Our Mosaic GPU kernels compiled for an H100 and an H200 on this host, no GPU: ptxas's report
of each (registers, spills) at the shapes the models run them (`jaxrl_lp.bench.mosaic_aot`).

    pip install --no-deps --target DIR jax-cuda12-plugin==$V jax-cuda12-pjrt==$V
    python benchmarks/mosaic_aot.py --cuda-plugin DIR --out docs/bench/mosaic-aot-cuda.json

(`V` the running jax's version; `$JAXRL_LP_CUDA_PLUGIN` names DIR too.) One JSON object on
stdout (and `--out`): the machine, jax, and per target and cell the kernels' ptxas report and
the compile's seconds. `ok` is whether every cell compiled with no register spilled.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from jaxrl_lp.bench.mosaic_aot import CELLS, run  # noqa: E402
from jaxrl_lp.plan.cuda_aot import GPU_TARGETS, plugin_from_env  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-plugin", default=None,
                        help="folder the CUDA PJRT plugin is installed in "
                             "(default $JAXRL_LP_CUDA_PLUGIN)")
    parser.add_argument("--targets", default="h100,h200",
                        help=f"comma-separated, of {sorted(GPU_TARGETS)}")
    parser.add_argument("--cells", default=",".join(CELLS),
                        help=f"comma-separated, of {list(CELLS)}")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    plugin = plugin_from_env(args.cuda_plugin)
    targets = [t for t in args.targets.split(",") if t]
    cells = [c for c in args.cells.split(",") if c]
    bad = [t for t in targets if t not in GPU_TARGETS] + [c for c in cells if c not in CELLS]
    if plugin is None or bad:
        why = (f"unknown {bad}; targets {sorted(GPU_TARGETS)}, cells {list(CELLS)}" if bad else
               "no CUDA PJRT plugin: pass --cuda-plugin DIR or set $JAXRL_LP_CUDA_PLUGIN "
               "(module docstring: how to install one)")
        print(f"mosaic_aot: {why}", file=sys.stderr)
        return 2
    res = run(plugin, targets, cells)
    spilled = [k for row in res["targets"].values() for cell in row.values()
               for k in cell.get("kernels", []) if k.get("spill_store_bytes")]
    failed = [c for row in res["targets"].values() for c, cell in row.items() if "error" in cell]
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain") else "")
    out = {"target": "benchmarks/mosaic_aot.py", "date": datetime.date.today().isoformat(),
           "machine": f"{platform.machine()} {platform.system().lower()}, {os.cpu_count()} "
                      "cores (nothing runs on a GPU)",
           "jax": jax.__version__, "commit": commit,
           "command": f"python benchmarks/mosaic_aot.py --cuda-plugin DIR --targets "
                      f"{','.join(targets)} --cells {','.join(cells)}",
           **res, "ok": not spilled and not failed}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
