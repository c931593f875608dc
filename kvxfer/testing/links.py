"""`StallingLink`: a TCP relay whose connections can be made to stop carrying bytes.

A process that a loaded machine runs in bursts looks so from the network: its kernel accepts a
connection and keeps it, its libzmq threads answer for a moment (the ZMTP greeting, a few
heartbeats), then nothing, then again. SIGSTOP cannot make that pattern (a frozen process
answers nothing at all, a thawed one everything at once); a relay in front of the process can.
Its connections carry bytes both ways until stalled; a stalled connection stays open and its
bytes wait in the kernel's buffers, as a frozen process's do.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass

_TURN_S = 0.01  # how often the relay looks again at its connections' stall times
_SEND_TIMEOUT_S = 5.0  # a peer that takes no bytes for this long ends its pair, not the relay


@dataclass(eq=False)
class _Pair:
    """One relayed connection: the client's end, the target's end, when it stops."""

    client: socket.socket
    target: socket.socket
    stall_at: float = float("inf")

    def other(self, end: socket.socket) -> socket.socket:
        return self.target if end is self.client else self.client


class StallingLink:
    """A relay on 127.0.0.1 in front of the TCP port `target_port` of 127.0.0.1.

    Connect to `address` instead of the target. `stall_each(after_s)` stops every connection
    open now and, from then on, each new one `after_s` seconds after it opened; `flow()` lets
    every connection carry bytes again. `connections` counts the connections accepted.
    """

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._stall_after: float | None = None
        self._closed = False
        self.connections = 0
        self._thread = threading.Thread(target=self._run, name="stalling-link", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """The relay's ZeroMQ address."""
        return f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"

    def stall_each(self, after_s: float) -> None:
        """Stop every open connection now, and each later one `after_s` after it opened."""
        now = time.monotonic()
        with self._lock:
            self._stall_after = after_s
            for pair in self._pairs:
                pair.stall_at = min(pair.stall_at, now)

    def flow(self) -> None:
        """Every connection carries bytes again, and later ones are not stopped."""
        with self._lock:
            self._stall_after = None
            for pair in self._pairs:
                pair.stall_at = float("inf")

    def close(self) -> None:
        """End the relay and every connection through it."""
        self._closed = True
        self._thread.join()
        self._listener.close()
        for pair in self._pairs:
            pair.client.close()
            pair.target.close()

    def __enter__(self) -> StallingLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._closed:
            ends = self._flowing_ends(time.monotonic())
            readable, _, _ = select.select([self._listener, *ends], [], [], _TURN_S)
            for end in readable:
                if end is self._listener:
                    self._accept()
                else:
                    self._relay(end, ends[end])

    def _flowing_ends(self, now: float) -> dict[socket.socket, _Pair]:
        with self._lock:
            pairs = [p for p in self._pairs if p.stall_at > now]
        return {end: p for p in pairs for end in (p.client, p.target)}

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        try:
            target = socket.create_connection(("127.0.0.1", self._target_port))
        except OSError:  # nothing listens at the target: the client sees its connection close
            client.close()
            return
        for end in (client, target):
            end.settimeout(_SEND_TIMEOUT_S)
        with self._lock:
            pair = _Pair(client, target)
            if self._stall_after is not None:
                pair.stall_at = time.monotonic() + self._stall_after
            self._pairs.append(pair)
            self.connections += 1

    def _relay(self, end: socket.socket, pair: _Pair) -> None:
        """Carry what `end` has to the other end; a closed end closes the pair."""
        if end.fileno() < 0:  # its pair was closed earlier in this turn
            return
        try:
            data = end.recv(1 << 16)
            if data:
                pair.other(end).sendall(data)
                return
        except OSError:
            pass
        with self._lock:
            self._pairs.remove(pair)
        pair.client.close()
        pair.target.close()
