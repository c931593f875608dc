"""`benchmarks/RESULTS.md` is what `benchmarks/results_page.py` makes of the result files in
`benchmarks/results/`: a stale page, a missing result file, or a file no section names fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE_SCRIPT = REPO / "benchmarks" / "results_page.py"


def _page(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PAGE_SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_the_page_is_made_from_the_result_files():
    run = _page("--check")
    assert run.returncode == 0, run.stderr


def test_an_edited_page_is_stale(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text((REPO / "benchmarks" / "RESULTS.md").read_text().replace("×", "x"))
    run = _page("--check", "--page", str(page))
    assert run.returncode == 1 and "differs from what" in run.stderr


def test_a_missing_or_unplaced_result_file_is_named(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results)
    (results / "latency.json").rename(results / "spare.json")
    text = (results / "spare.json").read_text().replace('"latency"', '"spare"', 1)
    (results / "spare.json").write_text(text)
    run = _page("--results", str(results), "--page", str(tmp_path / "page.md"))
    assert run.returncode != 0
    assert "result files missing for ['latency']" in run.stderr
    assert "no section names: ['spare']" in run.stderr
