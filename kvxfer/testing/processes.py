"""Where the harness's rank processes come from: a forkserver that has imported torch and kvxfer.

Every rank runs in its own process, started clean (nothing of the test process is inherited:
no threads, no sockets, no Mooncake engine). Importing torch and kvxfer costs a child about
3 s of CPU; a forkserver pays that once per test process and forks each child from a process
that has done nothing else, so a child starts in milliseconds. Mooncake is not preloaded: its
import starts threads, and a process with threads must not fork.

The forkserver takes the environment of the moment it starts (the first child): variables set
later in the parent do not reach the children.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

PRELOAD = ["kvxfer.testing._warm"]
"""What the forkserver imports before it forks (torch, kvxfer.connector, the ranks' code)."""

START_TIMEOUT_S = 300.0
"""How long a child may take to start (imports, caches, engines): a guard against a hang only,
since a child that exits first is seen at once (`first_message`). A loaded machine has stalled
whole processes for tens of seconds."""

_lock = threading.Lock()
_context: ForkServerContext | SpawnContext | None = None


def context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context of the harness's children: a preloaded forkserver where
    the platform has one, else spawn. Set `KVXFER_TEST_START=spawn` for spawn everywhere."""
    global _context
    with _lock:
        if _context is None:
            method = os.environ.get("KVXFER_TEST_START", "forkserver")
            if method not in mp.get_all_start_methods():
                method = "spawn"
            if method == "forkserver":
                server = mp.get_context("forkserver")
                server.set_forkserver_preload(PRELOAD)
                _context = server
            else:
                _context = mp.get_context("spawn")
        return _context


def first_message(
    conn: Connection, proc: BaseProcess, what: str, timeout: float = START_TIMEOUT_S
) -> Any:
    """The first message a child sends on `conn` (its "started"), or its exit, reported at once
    with its exit code: the parent must hold no copy of the child's end of the pipe, so that
    the exit is an EOF here (`start_child` closes it).

    Raises:
        TimeoutError: nothing came, and the child did not exit, within `timeout`.
        RuntimeError: the child exited first (its traceback, if any, is on stderr).
    """
    if not conn.poll(timeout):
        raise TimeoutError(f"{what} did not start within {timeout} s")
    try:
        return conn.recv()
    except EOFError:
        proc.join(10)
        raise RuntimeError(
            f"{what} exited (code {proc.exitcode}) before it started; its traceback, if any, "
            "is on stderr"
        ) from None


def start_child(
    ctx: ForkServerContext | SpawnContext,
    target: Callable[..., None],
    args: tuple[Any, ...],
    what: str,
) -> tuple[BaseProcess, Connection, Any]:
    """Start `target(*args, conn)` in a daemon process of `ctx`; return the process, this
    side's end of the pipe and the child's first message (`first_message`)."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()  # the child's end lives in the child only: its exit is our EOF
    return proc, parent, first_message(parent, proc, what)
