"""The library's text says what its code does: no machine, date or run figure in `jaxrl_lp/`.

Measurements live in `docs/` (the design notes and `docs/bench/`, each with its date,
machine and command); a docstring or comment that names a CPU model, a core count, a date
or a run's time goes stale with the next machine or the next change. This reads every
source file of the package.
"""

import re
from pathlib import Path

import jaxrl_lp

# A machine: a CPU model, a cloud machine type, a core count ("on 2 cores", "the 2-core
# machine"; not "on one core", which says how a program runs, not where it was timed).
MACHINE = (r"\b(Zen ?\d|Xeon|EPYC|Ryzen|Threadripper|Skylake|(Cascade|Ice) Lake|"
           r"(Sapphire|Emerald|Granite) Rapids|Graviton\d?|Neoverse|Apple M\d|Core i[3579])\b"
           r"|\b[a-z]\d[a-z]?-(standard|highcpu|highmem|highgpu|ultragpu|megagpu)\b"
           r"|\b(\d+|two|four|eight|sixteen)[- ](idle )?(CPU )?cores?\b")
# A date: 2026-12-04, 2026-12, December 2026, Dec 4, 2026.
DATE = (r"\b20\d\d-[01]\d(-[0-3]\d)?\b"
        r"|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? (\d{1,2}, )?20\d\d\b")
# A run's figure: a time ("7.2 ms", "~30 s", "5.2 minutes"; "1s" is ones), a rate ("15
# GB/s", "190 GFLOP/s"), a before and after ("1.14 -> 0.33", "44.5% -> 83.6%"), a measured
# ratio ("1.10x as long", "5-15% cheaper"; a target's "1.05x the dense step" is not), a peak
# ("peaks at about 16 GB"; a size worked out, "0.27 GB for 8 x 128 tokens", is not).
FIGURE = (r"\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?(ns|us|µs|ms|sec|seconds?|min|minutes?|hours?)\b"
          r"|\b\d+(\.\d+)?(-\d+(\.\d+)?)? s\b"
          r"|\b\d+(\.\d+)? ?(tok(en)?s/s|it/s|steps/s|[KMGT]i?B/s|[GTP]FLOP/?s|TFLOPS)(?!\w)"
          r"|\b\d+\.\d+%? ?(->|→) ?\d+\.\d+|\b\d+(\.\d+)?% ?(->|→) ?\d+(\.\d+)?%"
          r"|\b\d+(\.\d+)?x (faster|slower|as (long|fast|much))\b"
          r"|\b\d+(\.\d+)?(-\d+(\.\d+)?)?% (faster|slower|cheaper|dearer|longer|shorter)\b"
          r"|\bpeaks?( at)?( about)? \d+(\.\d+)? ?[KMGT]i?B\b")
STALE = re.compile("|".join((MACHINE, DATE)))
RUN_FIGURE = re.compile(FIGURE)
# The accelerators' data-sheet figures, each with its source: a reference, not a run.
SPEC_SHEETS = {"jaxrl_lp/plan/targets.py"}


def test_no_machine_date_or_run_figure_in_the_library():
    root = Path(jaxrl_lp.__file__).parent
    found = [f"{name}:{i}: {line.strip()}"
             for p in sorted(root.rglob("*.py")) if (name := p.relative_to(root.parent).as_posix())
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if STALE.search(line) or (name not in SPEC_SHEETS and RUN_FIGURE.search(line))]
    assert not found, ("a machine, date or run figure in the library's text (move it to docs/, with "
                       "its date, machine and command, and cite the page):\n" + "\n".join(found[:20]))


def test_the_patterns_find_what_they_name():
    for text in ("on 2 Zen 3 cores", "a Xeon", "since 2026-12-04", "the Zen5 machine", "in May 2026",
                 "on Dec 4, 2026", "a c4-standard-8", "an Apple M2", "the 2-core development machine",
                 "on two idle CPU cores", "in 2026-12"):
        assert STALE.search(text), text
    for text in ("1.14 -> 0.33 ms a decode step", "noise plus max on 2 cores", "(~30 s)", "took 5.2 minutes",
                 "8-30 s per run", "in 7.2 ms", "about 1 ms a call", "the CPUs' 15 GB/s",
                 "rate (190 GFLOP/s)", "f32 44.5% -> 83.6%", "took 1.10x as long", "5-15% cheaper on CPU",
                 "peaks at about 16 GB", "1,200 tokens/s"):
        assert STALE.search(text) or RUN_FIGURE.search(text), text
    for text in ("zenith", "2026 tokens", "x_BxTxD", "(1s omitted)", "-1 -> 0 -> +1", "kept as 1s",
                 "at most 1.05x the dense step", "10x the default learning rate", "227 KiB of shared memory",
                 "0.27 GB for the small preset's 8 x 128 tokens", "compiles a program on one core",
                 "docs/bench/sampler-2core-cpu.json", 'f"{os.cpu_count()} cores"', "8 x 32000", "lr 1e-4",
                 "steps 1200-2000", "p=f32,c=bf16", "`min(a, b)`", "a 2-layer, 2-loop model"):
        assert not STALE.search(text) and not RUN_FIGURE.search(text), text


# "SPEC section 11", "SPEC 2.1", "SPEC sections 5 and 7": a design document the repository
# does not hold; the docs pages that hold the design are cited instead.
SPEC_CITATION = re.compile(r"\bSPEC('s)? (sections? )?\d")


def test_no_citation_of_a_document_outside_the_repository():
    root = Path(jaxrl_lp.__file__).parent
    found = [f"{p.relative_to(root.parent)}:{i}: {line.strip()}"
             for p in sorted(root.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if SPEC_CITATION.search(line)]
    assert not found, "\n".join(found[:20])
    assert SPEC_CITATION.search("(SPEC section 11)") and SPEC_CITATION.search("SPEC 2.1's")
    assert not SPEC_CITATION.search('metavar="SPEC"')


# `docs/design/low_precision.md, "Number formats"`: a page of docs/ and a section of it, the name quoted
# as the page writes it: a heading's title (up to its ": ..." or " (`files`)") or, in a
# list of decisions, a bold label. The quote may wrap across comment or docstring lines.
DOC_CITATION = re.compile(r'docs/([\w/-]+\.md),\s+"([^"]+)"')


def _section_names(page):
    names = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            names |= {title, re.split(r": | \(", title)[0]}
        names |= set(re.findall(r"\*\*([^*]+)\*\*", line))
    return names


ROOT = Path(jaxrl_lp.__file__).parent.parent
DOCS = ROOT / "docs"
# The repository's own text: the library, its tests, scripts and tools, and the docs pages.
TEXT_FILES = ("README.md", "docs/**/*.md", "jaxrl_lp/**/*.py", "tests/**/*.py", "benchmarks/*",
              "tools/*.py", "notebooks/src/*.py")


def _missing_citations(text):
    """The `docs/<page>.md, "<section>"` citations in `text` whose page or section does not exist."""
    text = re.sub(r"\s*\n\s*(#\s?)?", " ", text)
    return [f"docs/{page}, {name!r}" for page, name in DOC_CITATION.findall(text)
            if not (DOCS / page).is_file() or name not in _section_names(DOCS / page)]


def test_every_cited_section_is_on_its_page():
    found = [f"{p.relative_to(ROOT)}: {c}" for pattern in TEXT_FILES for p in sorted(ROOT.glob(pattern))
             if p.is_file() for c in _missing_citations(p.read_text())]
    assert not found, "\n".join(found[:20])


def test_a_citation_of_a_missing_page_or_section_is_found():
    # Written in two pieces, so that this file's own text cites nothing that is missing.
    cite = "docs/" + "{}.md, \"{}\""
    assert not _missing_citations(cite.format("design/low_precision", "Number formats"))
    assert not _missing_citations("# (" + cite.format("design/kernels", "Kernels on GPU\n# and TPU") + ")")
    assert _missing_citations(cite.format("design", "Number formats"))  # a page that is gone
    assert _missing_citations(cite.format("design/kernels", "Kernels on GPU"))
    assert _missing_citations(cite.format("design/low_precision", "Kernels on GPU and TPU"))


# A path to a docs page (`docs/guide.md`, `docs/design/lora.md`), anywhere in the repository's
# text: the page exists.
DOC_PATH = re.compile(r"\bdocs/[\w/-]+\.md\b")


def test_every_named_docs_page_exists():
    found = [f"{p.relative_to(ROOT)}: {m}" for pattern in TEXT_FILES for p in sorted(ROOT.glob(pattern))
             if p.is_file() for m in DOC_PATH.findall(p.read_text()) if not (ROOT / m).is_file()]
    assert not found, "\n".join(found[:20])
    assert DOC_PATH.findall("see docs/design/lora.md, docs/guide.md.") == [
        "docs/design/lora.md", "docs/guide.md"]


def _choices(parser):
    """What `parser`'s first positional argument with choices takes (its subcommands or
    names)."""
    return next(a.choices for a in parser._actions if not a.option_strings and a.choices)


def test_the_readme_table_names_every_bench_target_and_study():
    """The README's command table lists what `jaxrl-lp bench` and `jaxrl-lp study` take: a
    target added to the command line and not to the README fails here."""
    from jaxrl_lp.cli.main import build_parser

    commands = _choices(build_parser())
    lines = (ROOT / "README.md").read_text().splitlines()
    for command in ("bench", "study"):
        row = next(x for x in lines if x.startswith(f"| `jaxrl-lp {command} "))
        listed = set(re.findall(r"`([a-z0-9-]+)`", row.split("|")[2]))
        assert listed == set(_choices(commands[command])), (command, row)
