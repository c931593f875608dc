"""What several test files share that is not part of `kvxfer.testing` (geometries, poisoned
memory, scenarios; its `strategies` for Hypothesis): `shared_result`, a value computed once for
a whole parallel run; `run_quick_benchmark`; `documented_moves`, the transition table a state
module's docstring draws; `REPO`, the repository's root. tests/conftest.py puts this folder
on sys.path for the tests in every subfolder."""

from __future__ import annotations

import enum
import fcntl
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_quick_benchmark(name: str, *flags: str) -> tuple[int, str, str]:
    """`benchmarks/<name> --quick --json [flags]` in a fresh interpreter (Mooncake quiet): its
    exit status, standard output and standard error."""
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / name), "--quick", "--json", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
        cwd=REPO,
    )
    return run.returncode, run.stdout, run.stderr


def shared_result(factory: pytest.TempPathFactory, name: str, compute: Callable[[], Any]) -> Any:
    """`compute()` once for the whole run, whichever xdist workers ask (a JSON value): the first
    to ask computes it under a file lock, the others wait and read it."""
    root = factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # an xdist worker: the workers share the parent
        root = root.parent
    path = Path(root) / f"{name}.json"
    with open(Path(root) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value))
        return value


__all__ = ["documented_moves", "run_quick_benchmark", "shared_result", "unlisted_moves"]


def documented_moves(doc: str | None, states: type[enum.Enum], events: type[enum.Enum]) -> dict:
    """The transition table a state module's docstring draws (rows of `state  event -> next`),
    as the module's `TRANSITIONS` maps it: (state, event) -> next state."""
    documented = {}
    for state, moves in re.findall(r"^    (\w+) {2,}(.*)$", doc or "", re.MULTILINE):
        if state == "state":
            continue  # the header
        for event, after in re.findall(r"(\w+) -> (\w+)", moves):
            documented[states(state), events(event)] = states(after)
    return documented


def unlisted_moves(
    legal: list[tuple[Any, Any, Any]], states: type[enum.Enum], events: type[enum.Enum]
) -> list[tuple[Any, Any]]:
    """Every (state, event) that a table test's `legal` rows (state, event, next) do not list."""
    listed = {(state, event) for state, event, _ in legal}
    return [move for move in itertools.product(states, events) if move not in listed]
