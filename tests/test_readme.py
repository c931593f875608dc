"""Every ```python block of README.md runs as written, top to bottom, in one namespace; the
two-process example the connector section points to runs and matches."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from kvxfer.examples import two_process_transfer

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)

# Runs in a fresh interpreter: each block compiled under README.md's name and line numbers (a
# traceback points at the README line), all in one namespace, as a reader pasting them would.
RUNNER = textwrap.dedent(
    """
    import re, sys
    text = open(sys.argv[1], encoding="utf-8").read()
    namespace = {"__name__": "__main__"}
    for match in re.finditer(sys.argv[2], text, re.MULTILINE | re.DOTALL):
        first_line = text.count("\\n", 0, match.start(1))  # lines before the block's first
        code = "\\n" * first_line + match.group(1)
        print(f"--- README.md block at line {first_line + 1}", flush=True)
        exec(compile(code, "README.md", "exec"), namespace)
    print("--- all blocks ran", flush=True)
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    env.pop("TRITON_INTERPRET", None)
    return env


def python_blocks() -> list[tuple[int, str]]:
    """(first line, code) of every ```python block, in order."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_readme_has_python_blocks_and_each_compiles():
    blocks = python_blocks()
    assert len(blocks) >= 2, "the Public API and connector sections show Python"
    for line, code in blocks:
        compile(code, f"README.md block at line {line}", "exec")  # SyntaxError names the line


def test_every_readme_python_block_runs_top_to_bottom(tmp_path):
    runner = tmp_path / "run_readme.py"
    runner.write_text(RUNNER)
    done = subprocess.run(
        [sys.executable, str(runner), str(README), BLOCK.pattern],
        cwd=tmp_path,  # whatever a block writes lands here
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    assert "--- all blocks ran" in done.stdout
    assert done.stdout.count("--- README.md block at line") == len(python_blocks())


def test_the_connector_section_points_to_the_two_process_example():
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Connectors: prefill") :]
    assert "python -m kvxfer.examples.two_process_transfer" in section
    assert "kvxfer/examples/two_process_transfer.py" in section


def test_two_process_transfer_moves_every_byte():
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
