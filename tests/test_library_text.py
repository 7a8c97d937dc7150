"""The library's text says what its code does: no machine, date or run figure in `jaxrl_lp/`.

Measurements live in `docs/` (the design notes and `docs/bench/`, each with its date and
machine); a docstring or comment that names a CPU model or a date goes stale with the next
machine. This reads every source file of the package.
"""

import re
from pathlib import Path

import jaxrl_lp

# A CPU model, or an ISO date.
STALE = re.compile(r"\b(Zen ?\d|Xeon|EPYC|Ryzen|Skylake|Sapphire Rapids)\b|\b20\d\d-[01]\d-[0-3]\d\b")


def test_no_machine_or_date_in_the_library():
    root = Path(jaxrl_lp.__file__).parent
    found = [f"{p.relative_to(root.parent)}:{i}: {line.strip()}"
             for p in sorted(root.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if STALE.search(line)]
    assert not found, "\n".join(found[:20])


def test_the_pattern_finds_what_it_names():
    for text in ("on 2 Zen 3 cores", "a Xeon", "since 2026-12-04", "the Zen5 machine"):
        assert STALE.search(text), text
    for text in ("zenith", "2026 tokens", "x_BxTxD"):
        assert not STALE.search(text), text


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
