"""Each notebook agrees with its jupytext-paired source, as notebooks/run_all.py checks first."""

import importlib.util
import os
import shutil
from pathlib import Path

import jupytext
import jupytext.cli
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "notebooks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_all = _run_all()


@pytest.fixture
def notebooks(tmp_path) -> Path:
    """A copy of notebooks/: the notebooks, their sources and jupytext.toml."""
    return shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks",
                           ignore=shutil.ignore_patterns("runs", "__pycache__", ".ipynb_checkpoints"))


def test_every_committed_notebook_agrees_with_its_source():
    assert run_all.unsynced() == []
    assert run_all.notebooks()  # the check saw some


def test_an_edited_source_is_caught_and_the_named_sync_fixes_it(notebooks):
    notebook, source = notebooks / "05_library_grpo_loop.ipynb", notebooks / "src" / "05_library_grpo_loop.py"
    source.write_text(source.read_text() + "\n# %%\nprint('planted')\n")
    stale = run_all.unsynced(folder=notebooks)
    assert stale == ["run_all: notebooks/05_library_grpo_loop.ipynb and notebooks/src/05_library_grpo_loop.py"
                     " differ; run `jupytext --sync notebooks/src/05_library_grpo_loop.py`"
                     " (the newer file's cells win)"]
    assert run_all.unsynced(["01"], folder=notebooks) == []  # only the notebooks asked for

    later = notebook.stat().st_mtime + 10  # the source is the newer file, whatever the clock's grain
    os.utime(source, (later, later))
    jupytext.cli.jupytext(["--quiet", "--sync", str(source)])
    assert run_all.unsynced(folder=notebooks) == []
    cells = jupytext.read(notebook).cells
    assert cells[-1].source == "print('planted')"
    assert any(c.get("outputs") for c in cells)  # the other cells keep their outputs


def test_an_edited_notebook_and_a_source_without_notebook_are_caught(notebooks):
    notebook = notebooks / "03_looped_deferred.ipynb"
    nb = jupytext.read(notebook)
    nb.cells[0].source += "\nA planted line."
    jupytext.write(nb, notebook)
    shutil.copy(notebooks / "src" / "01_quickstart.py", notebooks / "src" / "06_new.py")
    stale = run_all.unsynced(folder=notebooks)
    assert [line.split(" differ;")[0] for line in stale] == [
        "run_all: notebooks/03_looped_deferred.ipynb and notebooks/src/03_looped_deferred.py",
        "run_all: notebooks/06_new.ipynb and notebooks/src/06_new.py",
    ]


def test_run_one_reports_a_plot_a_failing_cell_and_jobs_below_one(tmp_path, capsys,
                                                                   monkeypatch):
    """`run_one` (what each of `--jobs N` processes runs): ok with a plot, FAILED with the
    failing cell's error and nothing written; `--jobs 0` is one clear line."""
    import nbformat

    for key in ("JAXRL_LP_SMALL", "MPLBACKEND", "PATH"):  # `execute` sets them; restored after
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if key not in os.environ or not os.environ[key]:
            monkeypatch.delenv(key)

    def notebook(name, code):
        path = tmp_path / name
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)]), path)
        return path

    plots = notebook("01_plot.ipynb", "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
    raises = notebook("02_raises.ipynb", "raise ValueError('planted')")
    before = raises.read_text()
    status, wall, error = run_all.run_one(plots, small=True, timeout=120, write=False)
    assert (status, error) == ("ok", "") and wall > 0
    status, _, error = run_all.run_one(raises, small=True, timeout=120, write=True)
    assert status == "FAILED" and "planted" in error
    assert raises.read_text() == before
    with pytest.raises(SystemExit) as exit_:
        run_all.main(["--jobs", "0"])
    assert exit_.value.code == 2
    assert "--jobs 0: run at least one notebook at a time" in capsys.readouterr().err
