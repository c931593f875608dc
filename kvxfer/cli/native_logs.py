"""Quiet native logging: Mooncake's log level, and a filter for its known-harmless lines.

Mooncake Transfer Engine logs from C++ through glog, straight to file descriptor 2: Python's
`logging` and `sys.stderr` never see those lines. This wheel reads its level from
`MC_LOG_LEVEL` (TRACE, INFO, WARNING, ERROR). Even at ERROR it prints two lines that report no
failure: glog's "WARNING: Logging before InitGoogleLogging() is written to STDERR" header, and
`E... transfer_metadata.cpp:...] Local segment descriptor not found` when an engine with no
memory registered yet looks itself up. `filtered_stderr` drops exactly those lines, from this
process and from every process it starts while active, and forwards everything else.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import select
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

HARMLESS_LINES: tuple[re.Pattern[bytes], ...] = (
    re.compile(rb"WARNING: Logging before InitGoogleLogging\(\) is written to STDERR"),
    re.compile(
        rb"E\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ transfer_metadata\.cpp:\d+\] "
        rb"Local segment descriptor not found"
    ),
)
"""Lines Mooncake prints at ERROR level that report no failure (matched whole, without the
newline)."""

_FLUSH_PARTIAL_S = 0.1  # a line without its newline yet is forwarded after this long


def set_mooncake_log_level(verbose: bool = False) -> str:
    """Choose Mooncake's log level for this process and the processes it starts.

    A level the user set (`MC_LOG_LEVEL` in the environment) is kept; otherwise ERROR, or INFO
    when `verbose`. Must run before the first Mooncake engine starts.

    Returns:
        The level in effect.
    """
    return os.environ.setdefault("MC_LOG_LEVEL", "INFO" if verbose else "ERROR")


def is_harmless(line: bytes) -> bool:
    """Whether a line of native stderr output (without its newline) is one of `HARMLESS_LINES`."""
    text = line.rstrip(b"\r")
    return any(p.fullmatch(text) for p in HARMLESS_LINES)


class _Forwarder(threading.Thread):
    """Reads the pipe behind fd 2, writes every line but the harmless ones to `out_fd`."""

    def __init__(self, read_fd: int, out_fd: int) -> None:
        super().__init__(name="kvxfer-stderr-filter", daemon=True)
        self.read_fd, self.out_fd = read_fd, out_fd

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view) :]
            except InterruptedError:
                continue
            except OSError:
                return  # the real stderr is gone: nothing left to show anything on

    def run(self) -> None:
        pending = b""
        try:
            while True:
                ready, _, _ = select.select([self.read_fd], [], [], _FLUSH_PARTIAL_S)
                if not ready:
                    if pending:  # a prompt or a line still being written: show it now
                        self._write(pending)
                        pending = b""
                    continue
                data = os.read(self.read_fd, 1 << 16)
                if not data:  # every writer closed its end
                    break
                *lines, pending = (pending + data).split(b"\n")
                kept = b"".join(line + b"\n" for line in lines if not is_harmless(line))
                if kept:
                    self._write(kept)
            if pending and not is_harmless(pending):
                self._write(pending)
        finally:
            os.close(self.read_fd)
            os.close(self.out_fd)


@contextlib.contextmanager
def filtered_stderr() -> Iterator[TextIO]:
    """Route file descriptor 2 through a filter that drops Mooncake's known-harmless lines.

    Everything else written to fd 2 (by Python, C++ or a child process started inside the
    block, which inherits the filtered fd 2) reaches the real stderr, line by line. On exit fd 2
    is restored; lines from children still running are forwarded until they exit.

    Yields:
        A text stream on the real stderr, for output that must not pass through the filter (a
        progress bar: `.isatty()` answers for the terminal).
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 at all: nothing to filter
        with open(os.devnull, "w") as devnull:
            yield devnull
        return
    read_fd, write_fd = os.pipe()
    forwarder = _Forwarder(read_fd, os.dup(saved))
    os.dup2(write_fd, 2)  # inheritable: child processes write into the filter too
    os.close(write_fd)
    forwarder.start()
    console = io.TextIOWrapper(
        io.FileIO(os.dup(saved), "w"), encoding="utf-8", errors="replace", line_buffering=True
    )
    try:
        yield console
    finally:
        console.close()
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes this process's write end of the pipe
        os.close(saved)
        forwarder.join(timeout=2.0)  # the rest once children still holding the pipe exit
