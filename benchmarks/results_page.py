"""Make `benchmarks/RESULTS.md` from the result files in `benchmarks/results/`.

    .venv/bin/python benchmarks/results_page.py            # rewrite RESULTS.md
    .venv/bin/python benchmarks/results_page.py --check    # exit 1 where RESULTS.md is stale

Every benchmark records its run with `--record` (`kvxfer.testing.results`: machine, commit,
command, rows, and the figure it states from them); this page only arranges those files into
sections. `--check` is what the test suite runs (`tests/benchmarks/test_results_page.py`), so
the page cannot drift from the files. A benchmark on the page without a result file, or a file
no section names, is an error naming it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvxfer.testing.results import Result, read_results

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
PAGE = HERE / "RESULTS.md"

INTRO = """\
# Benchmark results

The current figure of each benchmark, with its command: one run each, on the machine named,
ratios taken within that run (these machines are noisy: medians, not best cases, are quoted).
This page is made by `benchmarks/results_page.py` from the result files in `benchmarks/results/`
(one a benchmark: machine, commit, command, what it measured); a benchmark run with `--record`
rewrites its file, then `.venv/bin/python benchmarks/results_page.py` this page. Do not edit it
by hand. How each figure came about, and the figures it replaced, are the dated entries in
`benchmarks/history/` (one file a day). Finished studies, whose conclusions now sit beside the
constants they justify, are in `benchmarks/studies/`.
"""

SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Transfers on the project's CPU machine (2 cores, Mooncake TCP on loopback)",
        ("latency", "floor", "bench", "torch_copy", "streaming", "chunk_costs", "plan", "soak"),
    ),
    ("Real engines (vLLM's CPU build, tiny model, 2 cores)", ("pd_serve", "pd_soak")),
    ("GPU and the compiled kernel", ("gpu_kernels", "kernel_codegen")),
    ("The suite", ("ci", "make_test")),
)
"""The page's sections, each with its benchmarks' result files in the order shown."""

HEADER = "| benchmark | command | current figure | targets | measured |\n|---|---|---|---|---|\n"


def measured_cell(result: Result) -> str:
    """When, where and on which commit; the day's history entry where there is one."""
    cell = f"{result.measured}, {result.machine_label()}, `{result.commit}`"
    if (HERE / "history" / f"{result.measured}.md").exists():
        cell += f" ([history](history/{result.measured}.md))"
    return cell


def row(result: Result) -> str:
    """One benchmark's row of the page."""
    figure = f"{result.figure} ({result.note})" if result.note else result.figure
    cells = [result.title, f"`{result.command}`", figure, result.targets, measured_cell(result)]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |\n"


def render(results: dict[str, Result]) -> str:
    """The whole page from the result files, section by section."""
    named = [name for _, names in SECTIONS for name in names]
    missing = [name for name in named if name not in results]
    unplaced = sorted(set(results) - set(named))
    if missing or unplaced:
        raise ValueError(
            f"result files missing for {missing} (run those benchmarks with --record); files "
            f"no section names: {unplaced} (add them to SECTIONS in {Path(__file__).name})"
        )
    parts = [INTRO]
    for title, names in SECTIONS:
        parts.append(f"\n## {title}\n\n{HEADER}")
        parts.extend(row(results[name]) for name in names)
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the page, or with `--check` say whether it is current."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is stale")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the result files")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check")
    args = parser.parse_args(argv)
    page = render(read_results(args.results))
    if args.check:
        current = args.page.read_text() if args.page.exists() else ""
        if current != page:
            print(
                f"{args.page} differs from what {args.results} makes: run "
                f"`.venv/bin/python benchmarks/results_page.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    args.page.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
