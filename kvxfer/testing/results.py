"""One result schema for kvxfer's benchmarks, and the `--record` flag every benchmark shares.

A benchmark script says its name, title and command once (`Benchmark`); run with `--record`,
it writes one result file, `benchmarks/results/<name>.json`: what it measured (`rows`, the
script's own JSON), the figure and the targets it states from them (the two cells of
`benchmarks/RESULTS.md`), the command that reproduces it, the machine it ran on, the commit,
and the day (UTC). `benchmarks/results_page.py` makes RESULTS.md from these files alone, so the
page always shows what a recorded run measured; a newer run of the same benchmark replaces its
file (git keeps the older ones; `benchmarks/history/` tells why figures moved).

Standard library only, plus torch where it is importable (the machine's CPU capability and GPU):
the GPU benchmark records on a machine with CUDA, the engine benchmarks in vLLM's environment.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RESULT_KEYS = frozenset(
    {"schema", "benchmark", "title", "command", "machine", "commit", "measured", "figure",
     "targets", "rows", "note"}
)  # fmt: skip
RESULTS_PATH = "benchmarks/results"  # in the repository: where --record writes by default
MACHINE_KEYS = frozenset({"cpu", "cores", "memory_gib", "cpu_capability", "amx", "gpu"})


@dataclass(frozen=True)
class Result:
    """One recorded run of one benchmark.

    Attributes:
        benchmark: the result file's name (`latency` for `benchmarks/results/latency.json`).
        title: what the benchmark measures, as RESULTS.md's first column says it.
        command: the command line that reproduces the run (with `--record`).
        machine: `describe_machine()`'s answer where the run took place.
        commit: the commit measured (`git describe`-style, `-dirty` for uncommitted changes).
        measured: the day of the run, `YYYY-MM-DD`, UTC.
        figure: the current figure in one line of Markdown, made from `rows` by the benchmark.
        targets: the targets and whether this run met them, or "none".
        rows: what the benchmark printed with `--json` (its whole JSON object).
        note: a remark the page shows after the figure ("" for none).
    """

    benchmark: str
    title: str
    command: str
    machine: dict[str, Any]
    commit: str
    measured: str
    figure: str
    targets: str
    rows: Any
    note: str = ""
    schema: int = field(default=SCHEMA_VERSION)

    def to_json(self) -> str:
        """The result file's text: sorted keys, one trailing newline."""
        return json.dumps(asdict(self), indent=1, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = "a result file") -> Result:
        """Parse a result file, naming what is missing or extra."""
        data = json.loads(text)
        keys = set(data)
        missing, extra = RESULT_KEYS - keys, keys - RESULT_KEYS
        if missing or extra:
            raise ValueError(
                f"{origin}: not a kvxfer result (missing {sorted(missing)}, unknown "
                f"{sorted(extra)}); write it with a benchmark's --record"
            )
        if data["schema"] != SCHEMA_VERSION:
            raise ValueError(
                f"{origin}: schema {data['schema']}, this kvxfer reads {SCHEMA_VERSION}"
            )
        if set(data["machine"]) != MACHINE_KEYS:
            raise ValueError(f"{origin}: its machine needs exactly the keys {sorted(MACHINE_KEYS)}")
        return cls(**data)

    def machine_label(self) -> str:
        """The machine in a few words: its GPU, or its cores and CPU features."""
        return machine_label(self.machine)


def machine_label(machine: Mapping[str, Any]) -> str:
    """`describe_machine()`'s answer in a few words, for the results page."""
    if machine["gpu"]:
        return str(machine["gpu"])
    features = [str(machine["cpu_capability"]).upper()] if machine["cpu_capability"] else []
    if machine["amx"]:
        features.append("AMX")
    return ", ".join([f"{machine['cores']} cores", *features])


def describe_machine() -> dict[str, Any]:
    """The machine a benchmark runs on: CPU model, cores, memory, torch's CPU capability (the
    vector ISA its kernels use), AMX tiles, and the first CUDA device's name (None without)."""
    cpu = platform.processor() or platform.machine()
    names = [
        line.split(":", 1)[1] for line in _lines("/proc/cpuinfo") if line.startswith("model name")
    ]
    cpu = names[0].strip() if names else cpu
    totals = [line.split()[1] for line in _lines("/proc/meminfo") if line.startswith("MemTotal:")]
    memory_gib = round(int(totals[0]) / 2**20) if totals else 0
    capability, amx, gpu = None, False, None
    try:
        import torch
    except ImportError:
        pass
    else:
        capability = torch.backends.cpu.get_cpu_capability()
        amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "cpu_capability": capability,
        "amx": amx,
        "gpu": gpu,
    }


def _lines(path: str) -> list[str]:
    """A text file's lines, or none where the file is absent (not Linux)."""
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def current_commit(where: Path) -> str:
    """The commit checked out at `where`, `-dirty` where tracked files differ from it (result
    files aside: recording one run must not mark the next as dirty); "unknown" outside a git
    checkout."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        changed = git(
            "status", "--porcelain", "--untracked-files=no", "--", ":(top,exclude)" + RESULTS_PATH
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}-dirty" if changed else commit


@dataclass(frozen=True)
class Benchmark:
    """What a benchmark script says of itself once, for its result file.

    Attributes:
        name: its result file's name (`benchmarks/results/<name>.json`).
        title: what it measures, as the page's first column says it.
        command: the environment and program as a reader types them; the run's own arguments
            are appended (`command_line`).
        results_dir: where `--record` without a directory writes (the repository's
            `benchmarks/results`).
    """

    name: str
    title: str
    command: str
    results_dir: Path

    def add_record_flag(self, parser: argparse.ArgumentParser) -> None:
        """The flag every benchmark shares: `--record [DIR]` writes its result file into DIR
        (`results_dir` when DIR is left out)."""
        parser.add_argument(
            "--record",
            nargs="?",
            const=self.results_dir,
            default=None,
            type=Path,
            metavar="DIR",
            help=f"write the result file for benchmarks/RESULTS.md (default {self.results_dir})",
        )

    def record(
        self,
        directory: Path | None,
        argv: Sequence[str] | None,
        rows: Any,
        figure: Callable[[Any], tuple[str, str]],
        note: str = "",
    ) -> Path | None:
        """Write this run's result file into `directory` (None: `--record` was not given, and
        nothing is written): `rows`, what the run printed, and `figure(rows)`, the figure and
        the targets it states from them; measured now on this machine at the commit checked
        out where the benchmark lives. Answer its path. `argv`: the run's arguments (None:
        `sys.argv`'s)."""
        if directory is None:
            return None
        text, targets = figure(rows)
        directory.mkdir(parents=True, exist_ok=True)
        result = Result(
            benchmark=self.name,
            title=self.title,
            command=command_line(self.command, sys.argv[1:] if argv is None else argv),
            machine=describe_machine(),
            commit=current_commit(self.results_dir.parent),
            measured=datetime.datetime.now(datetime.UTC).date().isoformat(),
            figure=text,
            targets=targets,
            rows=rows,
            note=note,
        )
        path = directory / f"{self.name}.json"
        path.write_text(result.to_json())
        print(f"recorded {path}", file=sys.stderr)
        return path


def command_line(base: str, argv: Sequence[str]) -> str:
    """`base` and the arguments the run was given; a `--record` keeps no directory (it names
    where this run wrote, not how to measure)."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            if not arg.startswith("-"):
                continue
        if arg == "--record":
            skip = True
        elif arg.startswith("--record="):
            arg = "--record"
        args.append(arg)
    return " ".join([base, *(shlex.quote(a) for a in args)])


def verdict(misses: Sequence[str], unit: str = "") -> str:
    """A target's verdict for the page: "met", or "not met at" the places (`unit` after them)
    that missed it."""
    if not misses:
        return "met"
    return f"not met at {', '.join(misses)}" + (f" {unit}" if unit else "")


def read_results(directory: Path) -> dict[str, Result]:
    """Every result file in `directory`, by benchmark; a file whose name is not its benchmark's
    is refused (two files would claim one row of the page)."""
    results = {}
    for path in sorted(directory.glob("*.json")):
        result = Result.from_json(path.read_text(), str(path))
        if result.benchmark != path.stem:
            raise ValueError(f"{path}: holds benchmark {result.benchmark!r}; name it after it")
        results[result.benchmark] = result
    return results
