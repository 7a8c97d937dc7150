"""Builds notebooks/NN_name.ipynb from their sources, notebooks/src/NN_name.py.

A source is plain Python in the "percent" format: `# %%` starts a code cell,
`# %% [markdown]` a markdown cell whose lines are comments (`# text`). IPython
magics (`%pip`) may appear in code cells.

    python notebooks/build.py                  # write the .ipynb files, without outputs
    python notebooks/build.py --execute        # and execute them (full settings), keeping outputs
    python notebooks/build.py --execute --small 05   # SMALL settings, notebook 05 only

The committed notebooks hold their outputs (`--execute`), so their plots show on
the web; CI runs them again with `notebooks/run_all.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"


def cells(source: str) -> list[tuple[str, str]]:
    """`[(cell_type, text)]` of a percent-format source."""
    out: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        if line.startswith("# %%"):
            out.append(("markdown" if "[markdown]" in line else "code", []))
        elif out:
            out[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"text before the first '# %%' cell marker: {line!r}")
    result = []
    for kind, lines in out:
        if kind == "markdown":
            bad = [x for x in lines if x.strip() and not x.startswith("#")]
            if bad:
                raise ValueError(f"markdown cell line is not a comment: {bad[0]!r}")
            lines = [x[2:] if x.startswith("# ") else x[1:] for x in lines]
        text = "\n".join(lines).strip("\n")
        if text:
            result.append((kind, text))
    return result


def build(src: Path):
    """The notebook (nbformat v4 node) of one source, without outputs."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata.update({
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
        "accelerator": "GPU",
    })
    for kind, text in cells(src.read_text()):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(text))
    for i, cell in enumerate(nb.cells):  # stable ids: a rebuild changes only what changed
        cell.id = f"{src.stem[:2]}-{i:02d}"
    return nb


def main(argv: list[str] | None = None) -> int:
    """Writes (and with --execute, runs) the notebooks."""
    import nbformat

    sys.path.insert(0, str(HERE))
    from run_all import execute, png_outputs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only sources whose file name contains one")
    parser.add_argument("--execute", action="store_true", help="run them and keep the outputs")
    parser.add_argument("--small", action="store_true", help="with --execute: SMALL settings")
    args = parser.parse_args(argv)
    sources = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if args.names:
        sources = [s for s in sources if any(n in s.name for n in args.names)]
    for src in sources:
        nb = build(src)
        nbformat.validate(nb)
        out = HERE / f"{src.stem}.ipynb"
        if args.execute:
            t0 = time.time()
            execute(nb, small=args.small)
            print(f"{out.name}: executed in {time.time() - t0:.0f} s, {png_outputs(nb)} plots")
        nbformat.write(nb, out)
        print(f"wrote {out.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
