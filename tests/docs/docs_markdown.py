"""Reading the repository's Markdown as the docs tests need it: fenced blocks, headings, anchors.

`tests/docs/test_docs.py` runs the ```python blocks of README.md and docs/;
`tests/docs/test_citations.py` checks that cited files and sections exist. Both read Markdown
through these functions, so a block or heading means the same thing to both.
"""

from __future__ import annotations

import re
import textwrap
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Fence info strings a page may use. Python is "python" and nothing else ("py", "pycon",
# "python3" would escape the test that runs every Python block), and a language missing here is
# refused until someone decides whether its blocks should run.
FENCE_LANGUAGES = frozenset({"python", "sh", "bash", "text", "json", ""})
# First line of a Python block that cannot run on a CPU machine: `# docs-test: skip REASON`.
SKIP = re.compile(r"#\s*docs-test:\s*skip\b(?P<reason>.*)")
# A page whose blocks use the names of another page's blocks: `<!-- docs-test: continues X.md -->`.
CONTINUES = re.compile(r"<!--\s*docs-test:\s*continues\s+(?P<page>\S+)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown file."""

    path: Path
    line: int  # line number (1-based) of the block's first line of code
    language: str  # the first word of the fence's info string ("" for none)
    code: str  # the block's text, dedented by the fence's indentation

    @property
    def skip_reason(self) -> str | None:
        """The reason after `# docs-test: skip` on the block's first line, or None."""
        first = self.code.split("\n", 1)[0].strip()
        match = SKIP.fullmatch(first)
        return None if match is None else match.group("reason").strip(" :—-")

    @property
    def where(self) -> str:
        """`page:line`, the page relative to the repository root when it is inside it."""
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def fenced_blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a Markdown file, in order; an unclosed fence raises ValueError."""
    text = path.read_text(encoding="utf-8") if text is None else text
    lines = text.split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening.group("fence"), opening.group("indent")
        info = opening.group("info").strip()
        close = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: fence {fence}{info} is never closed")
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
        language = info.split()[0] if info else ""
        blocks.append(Block(path, i + 2, language, textwrap.dedent(body) + "\n"))
        i = end + 1
    return blocks


def python_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The ```python blocks of a Markdown file, in order."""
    return [b for b in fenced_blocks(path, text) if b.language == "python"]


def continued_page(path: Path, text: str | None = None) -> Path | None:
    """The page whose blocks run before this page's (its `docs-test: continues` line), or None."""
    text = path.read_text(encoding="utf-8") if text is None else text
    found = CONTINUES.findall(text)
    if len(found) > 1:
        raise ValueError(f"{path}: more than one 'docs-test: continues' line")
    return (path.parent / found[0]).resolve() if found else None


def without_fences(text: str) -> str:
    """The text with every fenced block's lines blanked (line numbers kept)."""
    lines = text.split("\n")
    out = list(lines)
    inside: str | None = None
    for i, line in enumerate(lines):
        match = FENCE.match(line)
        if inside is None and match is not None:
            inside = match.group("fence")
            out[i] = ""
        elif inside is not None:
            out[i] = ""
            if re.match(rf"^ *{re.escape(inside[0])}{{{len(inside)},}}\s*$", line):
                inside = None
    return "\n".join(out)


def heading_text(raw: str) -> str:
    """A heading as a reader sees it: no Markdown emphasis or code marks, spaces collapsed."""
    return " ".join(re.sub(r"[`*]", "", raw).split())


def headings(path: Path) -> list[str]:
    """The text of every ATX heading (`# ...` to `###### ...`) outside fenced blocks."""
    text = without_fences(path.read_text(encoding="utf-8"))
    return [heading_text(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)]


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs) gives a heading (`slugify`): ASCII
    only, punctuation dropped, lower case, runs of spaces and `-` to one `-`. GitHub's anchors
    agree for headings without non-ASCII characters."""
    text = unicodedata.normalize("NFKD", heading_text(heading)).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    """The anchor of every heading of a Markdown file."""
    return {slug(h) for h in headings(path)}


def markdown_files() -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
