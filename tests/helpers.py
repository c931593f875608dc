"""What several test files share that is not part of `kvxfer.testing` (geometries, poisoned memory,
scenarios; its `strategies` for Hypothesis): `shared_result`, a value computed once for a whole
parallel run; `run_quick_benchmark` and `load_benchmark`; `TransitionTableCases`, the checks
every state module's transition table gets (with `documented_moves`, the table its docstring
draws); `cpu_attention_rank`, one small rank on a vLLM CPU attention layout, and
`assert_run_offsets`, where the reference writes each element inside a (block, head) run;
`first_tokens_ask`, a consumer's ask for a request's first 32 tokens; `REPO`, the repository's
root. tests/conftest.py puts this folder on sys.path for the tests in every subfolder."""

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
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvxfer import KVCacheSpec
    from kvxfer.connector.messages import TransferRequest
    from kvxfer.testing import Geometry

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


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` imported as the module `name` (once; registered in sys.modules,
    where dataclasses look their module up)."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


__all__ = [
    "TransitionTableCases",
    "assert_run_offsets",
    "cpu_attention_rank",
    "documented_moves",
    "first_tokens_ask",
    "run_quick_benchmark",
    "shared_result",
    "unlisted_moves",
]


def cpu_attention_rank(placement: str) -> Geometry:
    """One small rank on one of vLLM CPU attention's layouts (HND, behind kv_inner's strides):
    `k_transposed` (its `vec` ISAs') float32, 2 heads of 3 in blocks of 4; `amx_tiles` bf16, 2
    heads of 32 in blocks of 32 (AMX's groups of 16)."""
    from kvxfer.testing import Geometry  # not at the top: the files that need only REPO stay light

    if placement == "amx_tiles":
        shape: dict[str, Any] = dict(head_dim=32, block_size=32)
    else:
        shape = dict(head_dim=3, dtype="float32", block_size=4)
    return Geometry(layers=1, heads=2, num_blocks=3, layout="HND", placement=placement, **shape)


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


class TransitionTableCases:
    """The checks every state machine's transition table gets, for a `Test...` class to inherit
    with `module` (the states module: its `TRANSITIONS`, `next_state`, `IllegalTransition`,
    `accepts` where it has one, and the docstring that draws the table), `states` and `events`
    (its two enums) and `legal` (event -> {state: next state}, every legal move: the table
    read event by event, where the modules write it state by state): each legal move leads
    where `legal` says, the table has exactly those moves, every other move raises, and the
    docstring draws the same table."""

    module: ModuleType
    states: type[enum.Enum]
    events: type[enum.Enum]
    legal: dict[Any, dict[Any, Any]]

    def rows(self) -> list[tuple[Any, Any, Any]]:
        """`legal` as (state, event, next) rows."""
        return [(s, e, after) for e, moves in self.legal.items() for s, after in moves.items()]

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        name = metafunc.function.__name__
        if name == "test_every_legal_move":
            metafunc.parametrize(("state", "event", "after"), self.rows(), ids=_value)
        elif name == "test_every_other_move_raises":
            moves = unlisted_moves(self.rows(), self.states, self.events)
            metafunc.parametrize(("state", "event"), moves, ids=_value)

    def test_every_legal_move(self, state: Any, event: Any, after: Any) -> None:
        if hasattr(self.module, "accepts"):
            assert self.module.accepts(state, event)
        assert self.module.next_state(state, event) is after

    def test_the_table_has_exactly_the_legal_moves(self) -> None:
        assert {(s, e): after for s, e, after in self.rows()} == self.module.TRANSITIONS

    def test_every_other_move_raises(self, state: Any, event: Any) -> None:
        if hasattr(self.module, "accepts"):
            assert not self.module.accepts(state, event)
        with pytest.raises(
            self.module.IllegalTransition, match=f"{state.value!r} cannot take event"
        ):
            self.module.next_state(state, event)

    def test_the_docstring_table_is_the_table(self) -> None:
        drawn = documented_moves(self.module.__doc__, self.states, self.events)
        assert drawn == self.module.TRANSITIONS


def _value(member: enum.Enum) -> str:
    return member.value


def assert_run_offsets(
    spec: KVCacheSpec,
    num_tokens: int,
    k_at: Callable[[int, int], int],
    v_at: Callable[[int, int], int],
) -> None:
    """Write `num_tokens` tokens of the reference KV (`kvxfer.reference`) into blocks 2 then 0
    of a one-layer cache of `spec` (a (block, head) run per head, as CPU attention's layouts
    have), and check that inside the run of its block and head, element d of the token in slot
    s has its K at `k_at(s, d)` and its V at `v_at(s, d)`."""
    import torch

    from kvxfer.reference import random_global_kv, write_rank_cells

    cache = torch.zeros(spec.layer_shape, dtype=spec.torch_dtype)
    kv = random_global_kv(spec, num_tokens)
    block_ids = [2, 0]
    write_rank_cells(spec, [cache], block_ids, kv, 0, num_tokens)
    for t in range(num_tokens):
        block, slot = block_ids[t // spec.block_size], t % spec.block_size
        for h in range(spec.heads_per_rank):
            run = cache[block, h].reshape(-1)
            for d in range(spec.head_dim):
                assert run[k_at(slot, d)] == kv[0, 0, t, h, d]
                assert run[v_at(slot, d)] == kv[0, 1, t, h, d]


def first_tokens_ask(
    request_id: str, chunk_id: int, *, layers: int, strategy: str, wait_seconds: float
) -> TransferRequest:
    """A consumer's ask (`TransferRequest`) for chunk `chunk_id` of a request of 32 tokens:
    all of them, layers [0, `layers`)."""
    from kvxfer.connector.messages import TransferRequest

    return TransferRequest(
        request_id=request_id,
        chunk_id=chunk_id,
        num_tokens=32,
        token_start=0,
        token_end=32,
        layer_start=0,
        layer_end=layers,
        strategy=strategy,
        wait_seconds=wait_seconds,
    )
