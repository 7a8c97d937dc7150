"""Executes every notebook in notebooks/ top to bottom (nbclient), as CI does.

    python notebooks/run_all.py                 # all, SMALL settings (JAXRL_LP_SMALL=1)
    python notebooks/run_all.py --jobs 2        # two notebooks at a time (CI, on 2 cores)
    python notebooks/run_all.py 05 --full       # matching names only, full settings
    python notebooks/run_all.py --full --write  # also save the executed notebooks (outputs)

Each notebook NN_name.ipynb is paired with its source src/NN_name.py by jupytext
(notebooks/jupytext.toml): edit either, then `jupytext --sync notebooks/*.ipynb`. First
checks that every pair agrees and exits 1, naming the pair, if one does not.

Each notebook runs in a fresh kernel of this Python with notebooks/ as its
working directory; with `--jobs N`, N notebooks at a time, each from its own
process (the notebooks write to run directories of their own). Prints each
notebook's wall time as it ends; exits 1 if any cell raises or a notebook
shows no plot (a PNG output), 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The kernel draws figures into the notebook whatever the caller's MPLBACKEND (CI sets Agg).
INLINE = "module://matplotlib_inline.backend_inline"


def notebooks(patterns: list[str] | None = None, folder: Path = HERE) -> list[Path]:
    """The notebooks of `folder` (`NN_name.ipynb`, in order), those matching any of `patterns`."""
    found = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if patterns:
        found = [p for p in found if any(s in p.name for s in patterns)]
    return found


def unsynced(patterns: list[str] | None = None, folder: Path = HERE) -> list[str]:
    """One line per notebook/source pair of `folder` that differs, for those matching `patterns`.

    The pairs are jupytext's (`folder`/jupytext.toml); a pair agrees when its source is
    the text jupytext writes from the notebook, so `jupytext --sync` would change neither.
    A notebook or a source without its other half differs.
    """
    import jupytext
    from jupytext.config import load_jupytext_config
    from jupytext.paired_paths import paired_paths

    config = load_jupytext_config(str(folder))
    if config is None:
        return [f"run_all: no jupytext configuration (jupytext.toml) for {folder}"]
    lines, seen = [], set()
    for path in notebooks(None, folder) + sorted(folder.rglob("[0-9][0-9]_*.py")):
        formats = config.default_formats(str(path))
        if formats is None:  # a notebook must pair; other Python files here are not sources
            if path.suffix == ".ipynb":
                lines.append(f"run_all: {folder}/jupytext.toml pairs {path.name} with nothing")
            continue
        # The configuration pairs two formats, the notebook first: "ipynb,src//py:hydrogen".
        (notebook, _), (source, fmt) = paired_paths(str(path), path.suffix[1:], formats)
        notebook, source = Path(notebook), Path(source)
        if notebook in seen or (patterns and not any(s in notebook.name for s in patterns)):
            continue
        seen.add(notebook)
        if not (notebook.exists() and source.exists()
                and jupytext.writes(jupytext.read(notebook), fmt, config=config) == source.read_text()):
            nb, src = notebook.relative_to(folder.parent), source.relative_to(folder.parent)
            lines.append(f"run_all: {nb} and {src} differ; run `jupytext --sync {src}`"
                         " (the newer file's cells win)")
    return lines


def execute(nb, *, small: bool, timeout: int = 1200):
    """Runs a notebook node in place (outputs filled in); raises on the first failing cell."""
    from nbclient import NotebookClient

    os.environ["JAXRL_LP_SMALL"] = "1" if small else "0"
    os.environ["MPLBACKEND"] = INLINE
    # `!jaxrl-lp ...` cells find this Python's command, as in an activated virtual environment.
    bindir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(HERE)}})
    client.execute()
    return nb


def png_outputs(nb) -> int:
    """How many PNG images the notebook's outputs hold."""
    return sum("image/png" in out.get("data", {}) for cell in nb.cells
               if cell.cell_type == "code" for out in cell.get("outputs", []))


def run_one(path: Path, small: bool, timeout: int, write: bool) -> tuple[str, float, str]:
    """Executes the notebook at `path`: (status, wall seconds, the failing cell's error text)."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    t0 = time.time()
    error = ""
    try:
        execute(nb, small=small, timeout=timeout)
        status = "ok" if png_outputs(nb) else "FAILED (no plot in its outputs)"
    except CellExecutionError as e:
        status, error = "FAILED", str(e)[-3000:]
    if status == "ok" and write:
        nbformat.write(nb, path)
    return status, time.time() - t0, error


def main(argv: list[str] | None = None) -> int:
    """Runs the notebooks; prints one line per notebook and a total."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only notebooks whose file name contains one")
    parser.add_argument("--full", action="store_true", help="full settings (JAXRL_LP_SMALL=0)")
    parser.add_argument("--write", action="store_true", help="save the executed notebooks")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at a time (default 1)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: run at least one notebook at a time (--jobs 1)")
    paths = notebooks(args.names)
    if stale := unsynced(args.names):
        print("\n".join(stale), file=sys.stderr)
        return 1
    if not paths:
        print(f"run_all: no notebooks matching {args.names} in {HERE}", file=sys.stderr)
        return 1
    failed, total = [], time.time()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = {pool.submit(run_one, path, not args.full, args.timeout, args.write): path
                for path in paths}
        for done in as_completed(runs):
            path = runs[done]
            status, wall, error = done.result()
            if error:
                print(error, file=sys.stderr)
            print(f"{path.name}: {status}, {wall:.0f} s", flush=True)
            if status != "ok":
                failed.append(path.name)
    print(f"notebooks: {len(paths) - len(failed)} of {len(paths)} ok in {time.time() - total:.0f} s"
          f" ({'SMALL' if not args.full else 'full'} settings, {args.jobs} at a time)")
    if failed:
        print(f"run_all: failed: {', '.join(sorted(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
