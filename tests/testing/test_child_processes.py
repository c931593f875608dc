"""The harness's child starts: a child that exits before its first message is reported at
once, with its exit code, not after the start timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from kvxfer.testing.processes import START_TIMEOUT_S, first_message, start_child


def _answers(greeting: str, conn) -> None:
    conn.send(greeting)
    conn.recv()  # stays until the test is done with it


def _silent(conn) -> None:
    conn.recv()  # never says it started


def _exits(code: int, conn) -> None:
    os._exit(code)  # before any message, as a crash at import would


def test_a_child_that_starts_returns_its_first_message():
    proc, conn, first = start_child(mp.get_context("spawn"), _answers, ("hello",), "a child")
    try:
        assert first == "hello"
    finally:
        conn.send("bye")
        proc.join(60)
    assert proc.exitcode == 0


def test_a_child_that_exits_first_is_reported_at_once_with_its_code():
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a child exited \(code 3\) before it started"):
        start_child(mp.get_context("spawn"), _exits, (3,), "a child")
    # Its exit was seen, not the start timeout waited out (300 s; a spawn takes seconds).
    assert time.monotonic() - began < START_TIMEOUT_S / 2


def test_a_child_that_never_answers_times_out_naming_it():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_silent, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        with pytest.raises(TimeoutError, match=r"a child did not start within 0\.5 s"):
            first_message(parent, proc, "a child", timeout=0.5)
    finally:
        parent.send("bye")
        proc.join(60)
