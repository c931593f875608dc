"""Every repository path that code, tests or docs cite exists, and every cited section is a
heading of the file cited.

A path is any `kvxfer/...`, `kernels/...`, `tests/...`, `benchmarks/...`, `scripts/...`,
`docs/...`, `notebooks/...` or `.ci/...` written in a file of those folders, README.md, the
Makefile, pyproject.toml or mkdocs.yml (not part of a longer path: vLLM's `v1/attention/...`
is not ours), or a top-level README.md, DESIGN.md, Makefile, pyproject.toml or mkdocs.yml. A
section citation is `FILE, "Heading"` or `FILE ("Heading")`; a Markdown link's `#anchor` must
be a heading of its page. Paths in other projects' repositories that happen to start like ours
are listed in EXTERNAL, each with where it lives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_markdown import ROOT, anchors, heading_text, headings, markdown_files, without_fences

SCANNED_DIRS = ("kvxfer", "kernels", "tests", "benchmarks", "scripts", "docs", "notebooks")
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml", "mkdocs.yml", ".ci/run")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".ipynb", ".txt", ".cfg"}
# Files that quote citations as data rather than make them: this test's own made-up samples.
NOT_SCANNED = {"tests/docs/test_citations.py"}

ROOTS = "kvxfer|kernels|tests|benchmarks|scripts|docs|notebooks|\\.ci"
TOP_LEVEL = "README\\.md|DESIGN\\.md|Makefile|pyproject\\.toml|mkdocs\\.yml"
# Not preceded by a path character (so `vllm/tests/x.py` or `nixl/README.md` is someone
# else's), ending on a word character or `/` (so a sentence's full stop is not part of it).
PATH = re.compile(rf"(?<![\w./-])(?:(?:{ROOTS})/(?:[\w.-]+/)*[\w.-]*[\w/]|(?:{TOP_LEVEL})\b)")
# `docs/connectors.md, "No late bytes"`, `docs/design.md ("JIT and the kernels")`, also the old
# forms `README, "..."` and `DESIGN.md, "..."`, so that they fail until rewritten. The quoted
# section may wrap onto a comment's next line. (`FILE's "words"` quotes words, not a section.)
SECTION = re.compile(
    rf"(?<![\w./-])(?P<file>(?:{ROOTS})/[\w./-]+\.md|README(?:\.md)?|DESIGN(?:\.md)?)"
    r"(?:,\s*|\s*\(\s*|\s+)\"(?P<section>[^\"\n]+(?:\n[ \t]*(?:#[ \t]*)?[^\"\n]+)?)\""
)
# "README" cited as the manual in code, as in `(README, "Trust")`, `(README)`, `README "X"`,
# `README's "X"` or "documented in the README": the manual is docs/ now. (The file README.md,
# and prose about the front page, are fine.)
BARE_README = re.compile(
    r"\bREADME(?:'s)?(?=[,)]|\s+\")|\(README\b(?!\.md)|\bin the README\b(?!\.md)"
)
LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?:#(?P<anchor>[^)\s]+))?\)")

# Paths of other repositories cited in our docs, each with where it lives.
EXTERNAL = {
    "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py": "vllm-project/vllm",
}


def scanned_files() -> list[Path]:
    """Every text file of the scanned folders and top-level files, in a stable order."""
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for folder in SCANNED_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if (
                path.is_file()
                and path.suffix in SUFFIXES
                and "__pycache__" not in parts
                and not any(p.endswith(".egg-info") for p in parts)
                and path.relative_to(ROOT).as_posix() not in NOT_SCANNED
            ):
                files.append(path)
    return files


def line_of(text: str, index: int) -> int:
    """The line number (1-based) of a character index."""
    return text.count("\n", 0, index) + 1


def cited_paths(path: Path) -> list[tuple[int, str]]:
    """(line, cited path) of every repository path a file cites."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return [(line_of(text, m.start()), m.group(0)) for m in PATH.finditer(text)]


def cited_sections(path: Path) -> list[tuple[int, str, str]]:
    """(line, cited file, section) of every section citation in a file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    found = []
    for m in SECTION.finditer(text):
        section = re.sub(r"\n[ \t]*(?:#[ \t]*)?", " ", m.group("section"))
        found.append((line_of(text, m.start()), m.group("file"), " ".join(section.split())))
    return found


def where(path: Path, line: int) -> str:
    """`file:line`, the file relative to the repository root."""
    return f"{path.relative_to(ROOT)}:{line}"


FILES = scanned_files()


def test_the_scan_sees_code_tests_and_docs():
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"README.md", "docs/design.md", "kernels/copy_cells.py", "Makefile"} <= names
    assert "tests/docs/docs_markdown.py" in names and "tests/docs/test_citations.py" not in names


def test_the_patterns_find_what_they_should(tmp_path):
    """The patterns on made-up text: what counts as a path, a section and a bare README."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""See docs/connectors.md, "No late bytes"; benchmarks/soak.py. and tests/faults/.\n'
        'Not ours: vllm/tests/v1/x.py, nixl/README.md, /dev/shm. DESIGN.md, "Invariants";\n'
        'docs/design.md\'s "about 1%" quotes words.\n'
        '(README, "Pipeline\n# parallelism") and docs/design.md ("JIT and the kernels")."""\n'
    )
    assert [p for _, p in cited_paths(sample)] == [
        "docs/connectors.md",
        "benchmarks/soak.py",
        "tests/faults/",
        "DESIGN.md",
        "docs/design.md",
        "docs/design.md",
    ]
    assert [(f, s) for _, f, s in cited_sections(sample)] == [
        ("docs/connectors.md", "No late bytes"),
        ("DESIGN.md", "Invariants"),
        ("README", "Pipeline parallelism"),
        ("docs/design.md", "JIT and the kernels"),
    ]
    bare = '(README, "X"), (README). README "X"; README\'s "X", in the README; README.md'
    assert len(BARE_README.findall(bare)) == 5
    assert not BARE_README.findall("The README's example; README.md, (README.md); the README")
    assert heading_text("`kvxfer demo --json`") == "kvxfer demo --json"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_path_exists(path):
    missing = [
        f"{where(path, line)}: {cited}"
        for line, cited in cited_paths(path)
        if cited not in EXTERNAL and not (ROOT / cited).exists()
    ]
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_section_is_a_heading_of_the_cited_file(path):
    wrong = []
    for line, cited, section in cited_sections(path):
        target = ROOT / cited
        if not target.is_file():
            wrong.append(f'{where(path, line)}: {cited}, "{section}": no such file')
            continue
        names = {h.lower() for h in headings(target)}
        if section.lower() not in names:
            wrong.append(f'{where(path, line)}: {cited} has no heading "{section}"')
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "path",
    [p for p in FILES if p.suffix == ".py" or p.name == "Makefile"],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_code_cites_the_manual_by_file(path):
    """The README is a front page now: code cites the docs/ page that holds a section."""
    text = path.read_text(encoding="utf-8")
    bare = [line_of(text, m.start()) for m in BARE_README.finditer(text)]
    assert not bare, f"{path.relative_to(ROOT)}: 'README' on lines {bare}: cite docs/PAGE.md"


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_into_the_repository_lands_on_a_file_and_heading(page):
    """README.md's links into docs/ (mkdocs checks the pages' own links too, in `make docs`)."""
    text = without_fences(page.read_text(encoding="utf-8"))
    wrong = []
    for m in LINK.finditer(text):
        target, anchor = m.group("target"), m.group("anchor")
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file = (page.parent / target).resolve() if target else page
        if not file.exists():
            wrong.append(f"{where(page, line_of(text, m.start()))}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            wrong.append(f"{where(page, line_of(text, m.start()))}: {target}#{anchor}: no heading")
    assert not wrong, "\n".join(wrong)
