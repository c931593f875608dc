"""Every ```python block of README.md and docs/ runs as written, and the two-process example the
connectors page points to runs and matches.

Each page's blocks run top to bottom in one namespace, in a fresh interpreter, as a reader
pasting them would; a page that says `<!-- docs-test: continues OTHER.md -->` runs after the
blocks of OTHER.md, in the same namespace. A block whose first line is
`# docs-test: skip REASON` is not run: it is reported as a skipped test with its reason.
Conventions: docs/development.md, "Docs".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from docs_markdown import (
    DOCS,
    FENCE_LANGUAGES,
    ROOT,
    Block,
    continued_page,
    fenced_blocks,
    markdown_files,
    python_blocks,
)

# Runs in a fresh interpreter: each block compiled under its page's name and line numbers (a
# traceback points at the page's line), all in one namespace.
RUNNER = textwrap.dedent(
    """
    import json, sys
    namespace = {"__name__": "__main__"}
    for block in json.load(open(sys.argv[1], encoding="utf-8")):
        code = "\\n" * (block["line"] - 1) + block["code"]
        print(f"--- {block['where']}", flush=True)
        exec(compile(code, block["path"], "exec"), namespace)
    print("--- all blocks ran", flush=True)
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    env.pop("TRITON_INTERPRET", None)
    return env


def session(page: Path, seen: tuple[Path, ...] = ()) -> list[Block]:
    """The blocks one run of `page` executes: those of the page it continues (recursively),
    then its own; skipped blocks left out."""
    if page in seen:
        raise ValueError(f"'docs-test: continues' loops: {' -> '.join(p.name for p in seen)}")
    before = continued_page(page)
    if before is not None and not before.is_file():
        raise FileNotFoundError(f"{page.relative_to(ROOT)} continues {before}, which is missing")
    earlier = [] if before is None else session(before, (*seen, page))
    return earlier + [b for b in python_blocks(page) if b.skip_reason is None]


def run_blocks(blocks: list[Block], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run the blocks in one fresh interpreter, in `tmp_path` (whatever a block writes lands
    there)."""
    listing = tmp_path / "blocks.json"
    listing.write_text(
        json.dumps(
            [
                {"path": str(b.path), "where": b.where, "line": b.line, "code": b.code}
                for b in blocks
            ]
        )
    )
    runner = tmp_path / "run_blocks.py"
    runner.write_text(RUNNER)
    return subprocess.run(
        [sys.executable, str(runner), str(listing)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


PAGES = [p for p in markdown_files() if python_blocks(p)]
SKIPPED = [b for p in markdown_files() for b in python_blocks(p) if b.skip_reason is not None]


def test_the_readme_and_the_manual_show_python():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/public-api.md", "docs/connectors.md"} <= names, names
    assert len(python_blocks(ROOT / "README.md")) == 1, "the README shows one example"


def test_every_fence_names_a_known_language():
    """A Python block under another name (```py, ```pycon) would never run: refused."""
    for page in markdown_files():
        for block in fenced_blocks(page):
            assert block.language in FENCE_LANGUAGES, (
                f"{block.where}: fence language {block.language!r}; use one of "
                f"{sorted(FENCE_LANGUAGES)} (```python blocks run in tests/docs/test_docs.py)"
            )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_compiles(page):
    for block in python_blocks(page):
        compile(block.code, block.where, "exec")  # a SyntaxError names the page and line


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_of_the_page_runs_top_to_bottom(page, tmp_path):
    blocks = session(page)
    done = run_blocks(blocks, tmp_path)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    assert "--- all blocks ran" in done.stdout
    ran = [line[4:] for line in done.stdout.splitlines() if line.startswith("--- ")]
    assert ran[:-1] == [b.where for b in blocks]


@pytest.mark.parametrize(
    "block",
    SKIPPED or [pytest.param(None, marks=pytest.mark.skip(reason="no block says docs-test: skip"))],
    ids=lambda b: b.where if isinstance(b, Block) else "none",
)
def test_skipped_block(block):
    """Listed, with its reason, among the skipped tests of every run."""
    assert block.skip_reason, f"{block.where}: '# docs-test: skip' needs a reason"
    compile(block.code, block.where, "exec")
    pytest.skip(f"{block.where}: {block.skip_reason}")


def test_the_readme_example_is_the_public_api_pages_first_block():
    """The README's one example opens docs/public-api.md too, word for word: the docs site is
    read without README.md, and the two must not drift apart."""
    (readme,) = python_blocks(ROOT / "README.md")
    assert python_blocks(DOCS / "public-api.md")[0].code == readme.code


def test_markers_are_read_as_the_docs_describe(tmp_path):
    """The parser behind the tests above, on a made-up page: skip markers, continues lines,
    fences of every kind."""
    first = tmp_path / "first.md"
    first.write_text("```python\nx = 1\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n<!-- docs-test: continues first.md -->\n\n"
        "```python\nassert x == 1\n```\n\n"
        "```python\n# docs-test: skip needs a GPU\nimport cuda_only\n```\n\n"
        "````text\n```python\nnot a block of its own\n```\n````\n\n"
        "  ```python\n  y = x + 1\n  ```\n"
    )
    blocks = python_blocks(page)
    assert [(b.line, b.code) for b in blocks] == [
        (6, "assert x == 1\n"),
        (10, "# docs-test: skip needs a GPU\nimport cuda_only\n"),
        (21, "y = x + 1\n"),
    ]
    assert [b.skip_reason for b in blocks] == [None, "needs a GPU", None]
    assert [b.language for b in fenced_blocks(page)] == ["python", "python", "text", "python"]
    assert [b.code for b in session(page)] == ["x = 1\n", "assert x == 1\n", "y = x + 1\n"]
    done = run_blocks(session(page), tmp_path)
    assert done.returncode == 0, done.stderr
    broken = tmp_path / "broken.md"
    broken.write_text("<!-- docs-test: continues first.md -->\n```python\nassert x == 2\n```\n")
    done = run_blocks(session(broken), tmp_path)
    assert done.returncode != 0 and "broken.md" in done.stderr and "line 3" in done.stderr
    loop = tmp_path / "loop.md"
    loop.write_text("<!-- docs-test: continues loop.md -->\n")
    with pytest.raises(ValueError, match="loops"):
        session(loop)
    (tmp_path / "open.md").write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks(tmp_path / "open.md")


def test_the_connectors_page_points_to_the_two_process_example():
    text = (DOCS / "connectors.md").read_text(encoding="utf-8")
    assert "python -m kvxfer.examples.two_process_transfer" in text
    assert "kvxfer/examples/two_process_transfer.py" in text


def test_two_process_transfer_moves_every_byte():
    from kvxfer.examples import two_process_transfer

    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.examples.two_process_transfer"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-8000:]}"
    lines = done.stdout.splitlines()
    assert lines[-1] == "MATCH", done.stdout
    ranks = [line for line in lines if line.lstrip().startswith("decode ")]
    assert len(ranks) == two_process_transfer.DECODE.tp_size
    assert all(line.endswith("bytes exact") for line in ranks), done.stdout
    assert "Local segment descriptor" not in done.stderr
    assert "InitGoogleLogging" not in done.stderr


def test_two_process_report_flags_a_failed_or_inexact_rank():
    from kvxfer.examples import two_process_transfer

    good = {
        "rank": 0,
        "ok": True,
        "exact": True,
        "bytes": 10,
        "num_ops": 1,
        "seconds": 0.01,
        "failed_block_ids": [],
        "errors": [],
        "pairs": [(0, 0, 2, "pack")],
    }
    released = [two_process_transfer.REQUEST] * two_process_transfer.PREFILL.tp_size
    assert two_process_transfer.format_report([good], released)[1]
    assert not two_process_transfer.format_report([{**good, "exact": False}], released)[1]
    failed = {**good, "ok": False, "failed_block_ids": [3], "errors": ["peer gone"]}
    text, match = two_process_transfer.format_report([failed], released)
    assert not match and "FAILED" in text and text.endswith("MISMATCH")
    assert not two_process_transfer.format_report([good], released[:1])[1]
