"""The encoder-cache consumer's conversations with producers, over the session layer.

A conversation is a generator: it yields the frames to send, is sent the frames that came
back, and returns its result (`Talk`). `Conversations.drive` runs several at once, one DEALER
socket each, until each has ended, one result is enough, or a deadline; a producer that did
not answer in time is simply missing from the results. The protocol is `kvxfer.session`'s
(service "ec"): `handshake` drives a `SessionClient` to an open session (the producer proves
the secret too, and names its transport's kind and endpoint in its terms: a producer of
another kind is refused), `ask` sends one session message on it and checks the answer's MAC
and that it echoes the question's `ref`, shaking hands again once if the producer lost the
session.

Every conversation has a socket of its own, made for it and closed after it: an answer meant
for another conversation, or one queued before a producer froze, can never reach it. Each
socket's connection is watched too (ZeroMQ's disconnect event): a producer whose connection
closed mid-conversation (its process ended: the kernel closed its sockets) ends the
conversation at once with `PeerClosed`, not at the deadline (the KV consumer's sessions do the
same, `kvxfer.connector.consumer.sessions`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TypeVar

import zmq

from kvxfer.connector.messages import (
    EC_SERVICE,
    ECTerms,
    Message,
    ProtocolError,
    decode,
    decode_terms,
    encode,
)
from kvxfer.connector.sidechannel import close_watched, connection_closed
from kvxfer.ec.base import ECLoadError
from kvxfer.session.protocol import (
    ClientState,
    Delivered,
    Opened,
    Rejected,
    Reply,
    SessionClient,
)
from kvxfer.transport.factory import check_peer_endpoint

T = TypeVar("T")
Talk = Generator[list[bytes], list[bytes], T]
"""A conversation with one producer: yields the frames to send, is sent the answer's frames,
returns its result."""

# ZeroMQ drops peers that send frames larger than this; side-channel messages are tiny.
FRAME_LIMIT = 1 << 20
POLL_SLICE_S = 0.1  # waits are sliced so that close() is never held up


class PeerClosed(ECLoadError):
    """The producer closed the connection mid-conversation: its process ended (or it closed)."""


@dataclass(frozen=True)
class Link:
    """An open session with a producer, and the transport endpoint the producer named.

    Conversations running at once share it: once open, a `SessionClient` is only read (to seal
    and to check frames); a refusal fails only the conversation refused, and a session the
    producer lost is dropped (the next conversation shakes hands again).
    """

    client: SessionClient
    endpoint: str

    @property
    def is_open(self) -> bool:
        """Whether frames may still be sealed on it."""
        return self.client.state is ClientState.OPEN


class Conversations:
    """This consumer's sessions with its producers, and the conversations that use them.

    Args:
        addresses: the producers' side-channel addresses.
        secret: the shared secret ("" for none).
        name: this consumer's name, for the producers' logs.
        transport: this consumer's transport kind: a producer of another kind is refused.
        closed: set when the consumer closes: every conversation then stops waiting.
        heard: called with a producer's address whenever it answered.
    """

    def __init__(
        self,
        addresses: Iterable[str],
        secret: str,
        name: str,
        transport: str,
        closed: threading.Event,
        heard: Callable[[str], None],
    ) -> None:
        self._secret, self._name, self._kind = secret, name, transport
        self._closed, self._heard = closed, heard
        self._links: dict[str, Link | None] = dict.fromkeys(addresses)
        self._lock = threading.Lock()
        self._refs = itertools.count(1)
        self._ctx = zmq.Context()
        self._hint_socks: dict[str, zmq.Socket[bytes]] = {}
        self._hint_lock = threading.Lock()

    def link(self, address: str) -> Link | None:
        """The session new conversations with `address` use, if one is open."""
        with self._lock:
            return self._links[address]

    def open_links(self) -> int:
        """Producers this consumer has a session with."""
        with self._lock:
            return sum(link is not None for link in self._links.values())

    def _forget(self, address: str, link: Link) -> None:
        """Stop using `link` (unless another session replaced it already)."""
        with self._lock:
            if self._links[address] is link:
                self._links[address] = None

    # ---- conversations ------------------------------------------------------------------

    def handshake(self, address: str) -> Talk[Link]:
        """Prove the secret to the producer and have it prove it back; open a session (kept
        for later conversations unless another one was opened meanwhile)."""
        client = SessionClient(EC_SERVICE, self._secret, self._name, b"")
        try:
            event = client.receive((yield client.hello()))
            while isinstance(event, Reply):
                event = client.receive((yield event.frames))
        except ProtocolError as exc:  # the producer could not prove the secret, or nonsense
            raise ECLoadError(f"handshake with producer {address} failed: {exc}") from None
        if isinstance(event, Rejected):
            raise ECLoadError(f"producer {address} refused: {event.reason}")
        if not isinstance(event, Opened):
            raise ProtocolError(f"expected a welcome, got {type(event).__name__}")
        terms = decode_terms(event.terms, ECTerms)
        try:
            endpoint = check_peer_endpoint(self._kind, terms.transport, terms.endpoint)
        except ValueError as exc:
            raise ProtocolError(f"producer {address}'s terms refused: {exc}") from exc
        link = Link(client, endpoint)
        with self._lock:
            if self._links[address] is None:
                self._links[address] = link
        return link

    def ask(
        self, address: str, make: Callable[[int], Message], link: Link | None = None
    ) -> Talk[tuple[Message, Link]]:
        """Send one session message (`make(ref)`) and return its authenticated answer and the
        session it went on: `link`, or the producer's (shaking hands first if there is none,
        and once more if the producer lost it)."""
        fixed = link is not None  # a lease lives in one session: no other will do
        for attempt in range(2):
            if link is None:
                link = self.link(address)
            if link is None:
                link = yield from self.handshake(address)
            ref = next(self._refs)
            event = link.client.receive((yield link.client.seal(encode(make(ref)))))
            if isinstance(event, Delivered):
                answer = decode(event.payload)
                if getattr(answer, "ref", None) != ref:
                    raise ProtocolError("an answer to another question")
                return answer, link
            if not isinstance(event, Rejected):
                raise ProtocolError(f"expected an answer, got {type(event).__name__}")
            if not event.session_lost:  # this question only: the session goes on
                raise ECLoadError(f"producer {address} refused: {event.reason}")
            self._forget(address, link)
            if attempt > 0 or fixed:
                raise ECLoadError(f"producer {address} refused: {event.reason}")
            link = None
        raise ECLoadError(f"producer {address} lost the session twice")

    def hint(self, address: str, message: Message) -> None:
        """Send a session message that has no answer, without waiting (a lost hint costs
        nothing): on a socket per producer, kept."""
        link = self.link(address)
        if link is None or not link.is_open:
            return  # no session, nothing to tell there
        frames = link.client.seal(encode(message))
        with self._hint_lock:
            sock = self._hint_socks.get(address)
            try:
                if sock is None:
                    sock = self._dealer(address)
                    sock.setsockopt(zmq.SNDHWM, 1000)
                    sock.setsockopt(zmq.RCVHWM, 16)  # answers (refusals only) are dropped
                    self._hint_socks[address] = sock
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:  # queue full or unreachable: a hint lost, nothing more
                pass

    def drive(
        self,
        talks: dict[str, Talk[T]],
        deadline: float,
        enough: Callable[[T], bool] | None = None,
    ) -> dict[str, T | Exception]:
        """Run conversations with several producers at once, until each has ended, `enough`
        holds for one result, or the deadline.

        Returns:
            Each producer's result or the error it ended with; producers that did not answer in
            time are missing.
        """
        results: dict[str, T | Exception] = {}
        socks: dict[zmq.Socket[bytes], tuple[str, Talk[T], zmq.Socket[bytes]]] = {}
        monitors: dict[zmq.Socket[bytes], zmq.Socket[bytes]] = {}  # the sockets, by monitor
        poller = zmq.Poller()

        def advance(address: str, talk: Talk[T], answer: list[bytes] | None) -> list[bytes] | None:
            try:
                return next(talk) if answer is None else talk.send(answer)
            except StopIteration as end:
                results[address] = end.value
            except ProtocolError as exc:
                results[address] = ECLoadError(f"producer {address} sent a bad answer: {exc}")
            except ECLoadError as exc:
                results[address] = exc
            return None

        def finish(sock: zmq.Socket[bytes]) -> None:
            monitor = socks.pop(sock)[2]
            del monitors[monitor]
            poller.unregister(sock)
            poller.unregister(monitor)
            close_watched(sock, monitor)

        def send(sock: zmq.Socket[bytes], address: str, frames: list[bytes]) -> None:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                results[address] = ECLoadError(f"producer {address} cannot be reached: {exc}")
                finish(sock)

        def answered(sock: zmq.Socket[bytes]) -> T | Exception | None:
            """The conversation's result if it ended with this answer (None: it goes on)."""
            address, talk, _ = socks[sock]
            try:
                answer = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return None
            self._heard(address)
            frames = advance(address, talk, answer)
            if frames is not None:
                send(sock, address, frames)
                return None
            finish(sock)
            return results[address]

        def watched(monitor: zmq.Socket[bytes]) -> None:
            sock = monitors[monitor]
            if not connection_closed(monitor):
                return
            address, talk, _ = socks[sock]
            talk.close()
            results[address] = PeerClosed(
                f"producer {address} closed the connection: its process ended or it closed"
            )
            finish(sock)

        try:
            for address, talk in talks.items():
                frames = advance(address, talk, None)
                if frames is None:
                    continue
                try:
                    sock, monitor = self._watched_dealer(address)
                except zmq.ZMQError as exc:
                    results[address] = ECLoadError(f"producer {address} cannot be reached: {exc}")
                    continue
                socks[sock], monitors[monitor] = (address, talk, monitor), sock
                poller.register(sock, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)
                send(sock, address, frames)
            while socks and not self._closed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for ready, _ in poller.poll(max(1, int(1000 * min(left, POLL_SLICE_S)))):
                    if ready in monitors:
                        watched(ready)
                        continue
                    if ready not in socks:
                        continue  # its conversation ended this turn (closed)
                    result = answered(ready)
                    if result is None or isinstance(result, Exception) or enough is None:
                        continue
                    if enough(result):
                        return results
            return results
        finally:
            for sock, (_, talk, monitor) in socks.items():
                close_watched(sock, monitor)
                talk.close()

    def _dealer(self, address: str) -> zmq.Socket[bytes]:
        """A socket connected to `address` (for hints: nobody waits on its connection)."""
        sock = self._new_dealer()
        try:
            sock.connect(address)
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    def _watched_dealer(self, address: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """A conversation's socket, connected to `address`, and the monitor of its connection
        (made before the connect, so that no event is missed)."""
        sock = self._new_dealer()
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(address)
        except zmq.ZMQError:
            close_watched(sock, monitor)
            raise
        return sock, monitor

    def _new_dealer(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, FRAME_LIMIT)
        return sock

    def close(self) -> None:
        """Close the sockets (no conversation may run any more)."""
        with self._hint_lock:
            for sock in self._hint_socks.values():
                sock.close(linger=0)
            self._hint_socks.clear()
        self._ctx.term()
