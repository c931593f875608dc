"""`SideChannelServer`: the ZeroMQ ROUTER socket a producer listens on, and its one thread.

It owns sockets and framing only: each incoming message (an identity, then its frames) goes
to the service's `on_frames`, which must never block (work that may wait goes to the
service's own per-peer workers); replies may be sent from any thread, and so may work for the
server thread (`post`: it runs at once, not at the next tick). The KV producer and the
encoder-cache producer both serve through it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxfer.connector.turns import TurnClock

log = logging.getLogger(__name__)

HARD_FRAME_LIMIT = 64 << 20  # ZeroMQ drops peers that send more; smaller frames get a reply
_POSTED = b""  # an outbox message of this one frame: run what was posted (never an identity)
_instances = itertools.count()


def has_message(sock: zmq.Socket) -> bool:
    """Whether a non-blocking receive on `sock` would return a message.

    Asked, not tried: an empty socket's `zmq.Again` costs more than a small message's work.
    """
    return bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)


def connection_events(monitor: zmq.Socket) -> list[int]:
    """Every connection event waiting on `monitor` (a socket's `get_monitor_socket`), in
    order: `zmq.EVENT_CONNECTED`, `EVENT_DISCONNECTED`, `EVENT_CLOSED`..., as it watches."""
    events = []
    while has_message(monitor):
        events.append(int(recv_monitor_message(monitor, zmq.NOBLOCK)["event"]))
    return events


def connection_closed(monitor: zmq.Socket) -> bool:
    """Whether the socket `monitor` watches (`get_monitor_socket(zmq.EVENT_DISCONNECTED)`) lost
    its connection: its peer's process ended (the kernel closed its sockets) or it closed.
    Reads every event waiting."""
    return zmq.EVENT_DISCONNECTED in connection_events(monitor)


def close_watched(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close a socket and the monitor of its connection (no event of it matters any more)."""
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


class SideChannelServer:
    """A bound ROUTER socket served by one thread.

    Args:
        host: the address to bind (127.0.0.1 by default in the connectors).
        port: the port (0: a free one; see `address`).
        on_frames: called on the server thread with (identity, frames) of each message.
        on_tick: called on the server thread every `tick_s` seconds (every `idle_tick_s`
            while `busy` says there is nothing whose deadline needs `tick_s`), whatever the
            messages in between.
        name: the thread's name.
        tick_s: the longest wait between two `on_tick` calls.
        idle_tick_s: the same while not busy (default: `tick_s`).
        busy: whether the service has work that needs the short tick (default: always).
        owner: the service's name in warnings about turns that kept the thread from its
            socket for long (`kvxfer.connector.turns`; default: the thread's name).
    """

    def __init__(
        self,
        host: str,
        port: int,
        on_frames: Callable[[bytes, list[bytes]], None],
        on_tick: Callable[[], None] | None = None,
        name: str = "kvxfer-side-channel",
        tick_s: float = 0.01,
        idle_tick_s: float | None = None,
        busy: Callable[[], bool] | None = None,
        owner: str | None = None,
    ) -> None:
        self._on_frames, self._on_tick, self._busy = on_frames, on_tick, busy
        self._clock = TurnClock(log, owner or name)
        self._tick_ms = max(1, int(tick_s * 1000))
        self._idle_tick_ms = max(1, int((tick_s if idle_tick_s is None else idle_tick_s) * 1000))
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        self._router.setsockopt(zmq.LINGER, 0)
        # A peer that stopped reading must not make sends block: drop its replies instead.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if port == 0:
                port = self._router.bind_to_random_port(f"tcp://{host}")
            else:
                self._router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            self._ctx.term()
            raise OSError(
                f"cannot bind the side channel to {host}:{port}: {exc}; pick another port or "
                "port=0 for a free one"
            ) from exc
        self.address = f"tcp://{host}:{port}"
        self._outbox_address = f"inproc://kvxfer-side-channel-{next(_instances)}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_address)
        self._local = threading.local()
        self._senders: list[zmq.Socket] = []
        self._senders_lock = threading.Lock()
        self._posted: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        """Send a message to a peer, from any thread."""
        if self._stop.is_set():
            return
        if threading.current_thread() is self._thread:
            self._router.send_multipart([identity, *frames])
            return
        self._outbox_socket().send_multipart([identity, *frames])

    def post(self, work: Callable[[], None]) -> None:
        """Run `work` on the server thread as soon as it is free (from any thread): what must
        not wait for the next tick, such as serving chunks that waited for a publish."""
        if self._stop.is_set():
            return
        self._posted.put(work)
        if threading.current_thread() is not self._thread:
            self._outbox_socket().send_multipart([_POSTED])

    def _outbox_socket(self) -> zmq.Socket:
        """This thread's PUSH socket into the server thread's outbox."""
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self._outbox_address)
            self._local.sock = sock
            with self._senders_lock:
                self._senders.append(sock)
        return sock

    def close(self) -> None:
        """Stop the thread and close every socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._outbox_socket().send_multipart([_POSTED])  # end the poll now, not at its tick
        self._thread.join()
        with self._senders_lock:
            for sock in self._senders:
                sock.close(linger=0)
        self._router.close(linger=0)
        self._outbox.close(linger=0)
        self._ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        ticked = time.monotonic()
        while not self._stop.is_set():
            idle = self._busy is not None and not self._busy()
            period_ms = self._idle_tick_ms if idle else self._tick_ms
            wait_ms = max(0, int((ticked - time.monotonic()) * 1000) + period_ms)
            self._clock.waiting()
            events = dict(poller.poll(wait_ms))
            self._clock.polled(wait_ms / 1000)
            messages = 0
            if self._router in events:
                messages = self._drain(self._router, self._dispatch)
            if self._outbox in events:
                self._drain(self._outbox, self._forward)
            posted = self._run_posted()
            # The tick is periodic work (deadlines, expiry), not a message's: once per period,
            # not after every message (it was a tenth of a busy server's time).
            now = time.monotonic()
            tick = (now - ticked) * 1000 >= period_ms
            if tick:
                ticked = now
                if self._on_tick is not None:
                    self._guarded(self._on_tick)
            if self._clock.turn_was_long():
                self._clock.report_turn(f"{messages} messages, {posted} posted tasks, tick: {tick}")

    def _dispatch(self, frames: list[bytes]) -> None:
        self._guarded(self._on_frames, frames[0], frames[1:])

    def _run_posted(self) -> int:
        """Run what was posted; returns how many."""
        ran = 0
        while True:
            try:
                work = self._posted.get_nowait()
            except queue.Empty:
                return ran
            self._guarded(work)
            ran += 1

    def _forward(self, frames: list[bytes]) -> None:
        if frames == [_POSTED]:
            return  # a wake-up: `_run_posted` follows the drain
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or not reading: its loss only
            log.debug("side channel: reply dropped: %s", exc)

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> int:
        """Handle the messages waiting on `sock`, at most 1,000; returns how many."""
        for handled in range(1000):  # then let the other socket and the tick have a turn
            if not has_message(sock):
                return handled
            handle(sock.recv_multipart(zmq.NOBLOCK))
        return 1000

    @staticmethod
    def _guarded(fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # a bug must not stop the service for every other peer
            log.exception("side channel: internal error")
