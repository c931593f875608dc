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
from multiprocessing.context import ForkServerContext, SpawnContext

PRELOAD = ["kvxfer.testing._warm"]
"""What the forkserver imports before it forks (torch, kvxfer.connector, the ranks' code)."""

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
