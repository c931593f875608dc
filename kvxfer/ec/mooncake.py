"""`MooncakeECConnector`: encoder outputs served from a bounded registered pool over Mooncake.

Pull, as the KV connector (README, "No late bytes"): the producer never writes into anybody's
memory. A consumer asks a producer to pin an item (`ECPin`); the producer answers where it lies
in its registered pool, with a lease; the consumer reads the bytes with its own Mooncake engine
into its own receive buffer, then reports the read (`ECDone`) and learns whether the item stayed
in the pool throughout (`ECValid`). Only then are the bytes copied out and returned.

    query every producer -> pin at one that holds it -> read -> done/valid -> copy out

Hence: a peer can only make the producer touch the producer's own memory, and no byte of a load
lands in the consumer's memory after that load returned or failed, except in a receive range the
load gave up on, which stays out of use until the consumer's own Mooncake read of it has settled
(Mooncake fails a read from a frozen peer after 30 s without progress); never on a timer.

Authentication: with a `secret`, the handshake is a challenge-response (HMAC over both sides'
nonces, the secret never on the wire, `kvxfer.connector.auth`) and every later frame in either
direction carries a MAC under the session key; every answer echoes its question's `ref`.
Without a secret the same exchange runs with an empty key (README, "Trust").

Producer: one side-channel thread (`SideChannelServer`) answers everything at once: pinning,
unpinning and lookups are dictionary operations under one lock. Leases end after `lease_s`: a
frozen or vanished consumer cannot pin the pool for longer. An item whose lease ended may be
evicted and its bytes overwritten; the consumer's `ECDone` then gets `ok=False` and that load
fails (or goes to another producer) instead of returning torn bytes.

Consumer: a query goes to every producer at once and waits `query_timeout_s` (0.5 s) at most; a
producer that did not answer is skipped for `retry_after_s` (5 s), so `has` answers in well
under a second however many producers are down, and never raises for a peer's fault. Each
producer has its own Mooncake engine on the consumer (the receive buffer registered in each) and
its own small pool of fetch threads: Mooncake's first transfer to a peer shakes hands under an
engine-wide lock, and a peer frozen then stops every transfer of that engine (measured: about
60 s), so a frozen or hostile producer holds only its own loads.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import math
import os
import re
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import zmq

from kvxfer.connector import auth
from kvxfer.connector.messages import (
    EC_SESSION_MESSAGES,
    ECChallenge,
    ECDone,
    ECHandshake,
    ECHello,
    ECInfo,
    ECPin,
    ECPinned,
    ECQuery,
    ECRelease,
    ECValid,
    ECWelcome,
    ErrorReply,
    Message,
    ProtocolError,
    decode,
    encode,
)
from kvxfer.connector.sidechannel import SideChannelServer
from kvxfer.ec.base import ECConnectorBase, ECLoadError, tensor_bytes
from kvxfer.plan.segments import Segments
from kvxfer.transport.base import Peer, Region, TransferError
from kvxfer.transport.mooncake import MooncakeTransport, check_protocol, rdma_devices
from kvxfer.validation import check_host, check_transport_endpoint

log = logging.getLogger(__name__)

_ALIGN = 256
# ZeroMQ drops peers that send frames larger than this; side-channel messages are tiny.
_FRAME_LIMIT = 1 << 20
_ADDRESS = re.compile(r"^tcp://[^\s/:]+:\d{1,5}$")
_DESCRIPTOR_BYTES = 4 << 20  # a read is cut in Mooncake descriptors of at most this size
_POLL_SLICE_S = 0.1  # waits are sliced so that close() is never held up
_ENDED_LEASE_MEMORY_S = 60.0  # an ended lease is remembered this long, to answer a late done

T = TypeVar("T")
Talk = Generator[list[bytes], list[bytes], T]
"""A conversation with one producer: yields the frames to send, is sent the answer's frames,
returns its result."""


class ByteRanges:
    """First-fit allocation of aligned byte ranges in `[0, capacity)`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted

    @staticmethod
    def rounded(nbytes: int) -> int:
        """The size a request of `nbytes` occupies."""
        return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)

    def alloc(self, nbytes: int) -> int | None:
        """An offset for `nbytes`, or None when no free range is large enough."""
        size = self.rounded(nbytes)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give a range back, merging it with free neighbours."""
        size = self.rounded(nbytes)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated."""
        return sum(size for _, size in self._free)


# ---- producer state ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    """An item in the pool. Its bytes never change while it is in the pool: a range is written
    only when it is allocated, and an entry's range is not free until the entry is evicted."""

    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    pins: int = 0


@dataclass
class _Lease:
    """An item pinned for one consumer's read."""

    mm_hash: str
    entry: _Entry
    session: str
    expires: float
    pinned: bool = True  # False once expired: the record stays a while to answer a late done


@dataclass
class _Session:
    """A consumer that completed the handshake (producer side)."""

    session: str
    consumer: str
    key: bytes
    last_heard: float
    leases: set[str] = field(default_factory=set)


# ---- consumer state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Link:
    """A session with a producer (consumer side): its id, the key that signs its frames, and
    the producer's Mooncake endpoint it named."""

    session: str
    key: bytes
    endpoint: str


@dataclass
class _Producer:
    """What a consumer knows of one producer: its session, its endpoint, its Mooncake engine
    here (the receive buffer registered in it), and whether it is skipped for now."""

    address: str
    transport: MooncakeTransport | None = None  # made on the first read from this producer
    region: Region | None = None
    session: _Link | None = None  # the one new conversations use
    down_until: float = 0.0
    unsettled: int = 0  # reads submitted to `transport` and not settled


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ECLoadError(f"unknown dtype {name!r} from the producer")
    return dtype


def _settle(future: Future[torch.Tensor], result: torch.Tensor | BaseException) -> None:
    try:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    except InvalidStateError:  # already settled (close() failed it)
        pass


class MooncakeECConnector(ECConnectorBase):
    """Encoder outputs over Mooncake Transfer Engine, pulled by the consumer.

    Producer config: `host` (127.0.0.1: side channel and Mooncake bind there), `port` (0: any;
    see `address`), `pool_bytes` (256 MiB), `secret`, `protocol` ("tcp" or "rdma"),
    `rdma_fallback` (False), `lease_s` (30: the longest a consumer's read pins an item),
    `max_leases` (64 pinned reads per consumer session), `session_timeout_s` (600: an idle
    session is forgotten; its consumer shakes hands again), `max_sessions` (256).

    Consumer config: `producer_addresses` (list of producer `address`es, "tcp://host:port"),
    `recv_bytes` (256 MiB), `secret`, `timeout_s` (30: one load from one producer),
    `query_timeout_s` (0.5: one round of queries), `retry_after_s` (5: how long a producer that
    did not answer is skipped), `fetch_workers` (4 loads in flight per producer),
    `close_timeout_s` (2: how long `close` waits for reads from a frozen producer to settle),
    `host`, `protocol`, `rdma_fallback`, `name` (for the producers' logs).
    """

    def __init__(self, role: str, config: dict[str, Any] | None = None) -> None:
        super().__init__(role, config)
        cfg = self.config
        self._secret = str(cfg.get("secret") or "")
        self._timeout_s = float(cfg.get("timeout_s", 30.0))
        self._host = check_host(str(cfg.get("host", "127.0.0.1")))
        self._protocol = check_protocol(cfg.get("protocol", "tcp"))
        self._rdma_fallback = bool(cfg.get("rdma_fallback", False))
        self._lock = threading.Condition()
        if self.role == "producer":
            self._start_producer(cfg)
        else:
            self._start_consumer(cfg)

    def _transport(self) -> MooncakeTransport:
        return MooncakeTransport(self._host, self._protocol, rdma_fallback=self._rdma_fallback)

    # ---- producer -----------------------------------------------------------------------

    def _start_producer(self, cfg: dict[str, Any]) -> None:
        capacity = int(cfg.get("pool_bytes", 256 << 20))
        if capacity <= 0:
            raise ValueError(f"pool_bytes: {capacity} must be positive")
        self._lease_s = float(cfg.get("lease_s", 30.0))
        self._max_leases = int(cfg.get("max_leases", 64))
        self._session_timeout_s = float(cfg.get("session_timeout_s", 600.0))
        self._max_sessions = int(cfg.get("max_sessions", 256))
        self._pool = torch.empty(capacity, dtype=torch.uint8)
        self._ranges = ByteRanges(capacity)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._sessions: dict[str, _Session] = {}
        self._leases: dict[str, _Lease] = {}
        self._challenges = auth.Challenges()
        self._pool_transport = self._transport()
        try:
            self._pool_region = self._pool_transport.register(self._pool)
            self._server = SideChannelServer(
                self._host,
                int(cfg.get("port", 0)),
                self._on_frames,
                self._on_tick,
                name="kvxfer-ec",
                tick_s=0.1,
            )
        except BaseException:
            self._pool_transport.close()
            raise
        self.address = self._server.address

    @property
    def stored(self) -> list[str]:
        """Hashes held, least recently used first (producer)."""
        with self._lock:
            return list(self._entries)

    def stats_snapshot(self) -> dict[str, object]:
        """Live state, for monitoring and leak checks.

        Producer: consumer sessions, leases (pinned, and expired ones remembered to answer a
        late done), items held and pinned, free pool bytes, the transport, threads.
        Consumer: producers skipped now, sessions, receive-buffer bytes quarantined and in use,
        reads in flight, loads pending, threads.
        """
        with self._lock:
            if self.role == "producer":
                return {
                    "sessions": len(self._sessions),
                    "leases": sum(lease.pinned for lease in self._leases.values()),
                    "expired_leases": sum(not lease.pinned for lease in self._leases.values()),
                    "stored": len(self._entries),
                    "pinned": sum(e.pins > 0 for e in self._entries.values()),
                    "pool_free_bytes": self._ranges.free_bytes,
                    "transport": self._pool_transport.protocol,
                    "threads": 2,  # the side channel, the transport's completion thread
                }
            now = time.monotonic()
            return {
                "producers_down": sum(p.down_until > now for p in self._producers.values()),
                "sessions": sum(p.session is not None for p in self._producers.values()),
                "quarantined_bytes": self._quarantined_bytes(),
                "recv_used_bytes": self._recv_ranges.capacity - self._recv_ranges.free_bytes,
                "reads_in_flight": sum(p.unsettled for p in self._producers.values()),
                "pending_loads": len(self._pending),
                "transport": next(  # what runs: "tcp" after an RDMA fallback
                    (p.transport.protocol for p in self._producers.values() if p.transport),
                    self._protocol,
                ),
                "engines": sum(p.transport is not None for p in self._producers.values()),
                # an engine's completion thread each, and the fetch threads running now
                "threads": sum(p.transport is not None for p in self._producers.values())
                + sum(len(getattr(f, "_threads", ())) for f in self._fetchers.values()),
            }

    def _save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        data = tensor_bytes(tensor.cpu())
        nbytes = data.numel()
        if ByteRanges.rounded(nbytes) > self._ranges.capacity:
            raise ValueError(
                f"tensor: {nbytes} bytes exceed the pool of {self._ranges.capacity}; raise "
                "pool_bytes"
            )
        with self._lock:
            if mm_hash in self._entries:  # same hash, same content: just touch it
                self._entries.move_to_end(mm_hash)
                return
            offset = self._ranges.alloc(nbytes)
            while offset is None:
                victim = next((h for h, e in self._entries.items() if e.pins == 0), None)
                if victim is None:
                    raise RuntimeError(
                        "the encoder-cache pool is full of outputs being read; retry, or raise "
                        "pool_bytes"
                    )
                gone = self._entries.pop(victim)
                self._ranges.free(gone.offset, gone.nbytes)
                log.debug("evicted encoder output %s", victim)
                offset = self._ranges.alloc(nbytes)
        # The copy runs without the lock (the side channel keeps answering); the entry is
        # published once its bytes are in place.
        self._pool[offset : offset + nbytes].copy_(data)
        with self._lock:
            if mm_hash in self._entries:  # another thread saved it meanwhile
                self._ranges.free(offset, nbytes)
                return
            self._entries[mm_hash] = _Entry(
                offset, nbytes, _dtype_name(tensor.dtype), [int(n) for n in tensor.shape]
            )

    # The side-channel thread: every handler is a few dictionary operations, never a wait.

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            if not 1 <= len(frames) <= 2:
                raise ProtocolError(f"expected a frame and its MAC, got {len(frames)} frames")
            message = decode(frames[0])
            if isinstance(message, EC_SESSION_MESSAGES):
                self._on_session_frame(identity, message, frames)
            elif isinstance(message, ECHello):
                self._on_hello(identity, message)
            elif isinstance(message, ECHandshake):
                self._on_handshake(identity, message)
            else:
                raise ProtocolError(
                    f"an encoder-cache producer does not accept {type(message).__name__}"
                )
        except ProtocolError as exc:
            log.warning("encoder-cache producer: refused a frame: %s", exc)
            self._server.send(identity, [encode(ErrorReply(reason=str(exc)))])

    def _on_hello(self, identity: bytes, hello: ECHello) -> None:
        with self._lock:
            if len(self._sessions) >= self._max_sessions:
                raise ProtocolError(
                    f"handshake refused: {self._max_sessions} sessions are open (max_sessions)"
                )
        server_nonce = self._challenges.issue(identity, hello.nonce)
        self._server.send(identity, [encode(ECChallenge(nonce=server_nonce))])

    def _on_handshake(self, identity: bytes, shake: ECHandshake) -> None:
        # A hello is used once: a replayed handshake finds none.
        if not self._challenges.redeem(identity, shake.client_nonce, shake.server_nonce):
            raise ProtocolError("handshake refused: no matching hello; start with ECHello")
        expected = auth.proof(
            self._secret, "consumer", shake.client_nonce, shake.server_nonce, "ec", shake.consumer
        )
        if not auth.proof_matches(expected, shake.proof):
            raise ProtocolError(
                "handshake refused: wrong or missing shared secret (both sides need the same "
                "secret)"
            )
        session_id = secrets.token_hex(16)
        session = _Session(
            session_id,
            shake.consumer,
            auth.session_key(self._secret, shake.client_nonce, shake.server_nonce, session_id),
            time.monotonic(),
        )
        with self._lock:
            self._sessions[session_id] = session
        endpoint = self._pool_transport.endpoint
        welcome = ECWelcome(
            session=session_id,
            endpoint=endpoint,
            proof=auth.proof(
                self._secret,
                "producer",
                shake.client_nonce,
                shake.server_nonce,
                session_id,
                endpoint,
            ),
        )
        self._server.send(identity, [encode(welcome)])

    def _on_session_frame(self, identity: bytes, message: Message, frames: list[bytes]) -> None:
        with self._lock:
            session = self._sessions.get(getattr(message, "session", ""))
        if session is None:
            lost = ErrorReply(reason="unknown session; shake hands again", session_lost=True)
            self._server.send(identity, [encode(lost)])
            return
        if len(frames) != 2 or not auth.verify(session.key, frames[0], frames[1]):
            raise ProtocolError("a session frame without a valid MAC was refused")
        session.last_heard = time.monotonic()
        reply: Message
        if isinstance(message, ECQuery):
            reply = self._info(message)
        elif isinstance(message, ECPin):
            reply = self._pin(session, message)
        elif isinstance(message, ECDone):
            reply = self._unpin(session, message)
        else:
            assert isinstance(message, ECRelease)
            with self._lock:  # a hint: evict it first (not while pinned)
                if message.mm_hash in self._entries:
                    self._entries.move_to_end(message.mm_hash, last=False)
            return
        frame = encode(reply)
        self._server.send(identity, [frame, auth.sign(session.key, frame)])

    def _info(self, ask: ECQuery) -> ECInfo:
        with self._lock:
            entry = self._entries.get(ask.mm_hash)
        if entry is None:
            return ECInfo(ref=ask.ref, mm_hash=ask.mm_hash, found=False)
        return ECInfo(
            ref=ask.ref,
            mm_hash=ask.mm_hash,
            found=True,
            dtype=entry.dtype,
            shape=entry.shape,
            nbytes=entry.nbytes,
        )

    def _pin(self, session: _Session, ask: ECPin) -> ECPinned:
        def refuse(reason: str) -> ECPinned:
            return ECPinned(ref=ask.ref, mm_hash=ask.mm_hash, ok=False, reason=reason)

        with self._lock:
            entry = self._entries.get(ask.mm_hash)
            if entry is None:
                return refuse("not held (evicted?)")
            if sum(self._leases[i].pinned for i in session.leases) >= self._max_leases:
                return refuse(
                    f"busy: {self._max_leases} reads of this consumer pinned (max_leases)"
                )
            lease_id = secrets.token_hex(8)
            entry.pins += 1
            self._entries.move_to_end(ask.mm_hash)
            self._leases[lease_id] = _Lease(
                ask.mm_hash, entry, session.session, time.monotonic() + self._lease_s
            )
            session.leases.add(lease_id)
        return ECPinned(
            ref=ask.ref,
            mm_hash=ask.mm_hash,
            ok=True,
            lease=lease_id,
            address=self._pool_region.address + entry.offset,
            nbytes=entry.nbytes,
            dtype=entry.dtype,
            shape=entry.shape,
            lease_s=self._lease_s,
        )

    def _unpin(self, session: _Session, done: ECDone) -> ECValid:
        with self._lock:
            lease = self._leases.get(done.lease)
            if lease is None or lease.session != session.session:
                return ECValid(
                    ref=done.ref,
                    lease=done.lease,
                    ok=False,
                    reason="unknown lease (it ended long ago, or is not this session's)",
                )
            self._end_lease(done.lease)
            # Present and the same entry: its range was never freed, so never rewritten.
            held = self._entries.get(lease.mm_hash) is lease.entry
        reason = "" if held else "it was evicted while being read (its lease had ended)"
        return ECValid(ref=done.ref, lease=done.lease, ok=held, reason=reason)

    def _end_lease(self, lease_id: str) -> None:
        """Forget a lease, unpinning its item if it still pins it (under the lock)."""
        lease = self._leases.pop(lease_id)
        if lease.pinned:
            lease.entry.pins -= 1
        session = self._sessions.get(lease.session)
        if session is not None:
            session.leases.discard(lease_id)

    def _on_tick(self) -> None:
        now = time.monotonic()
        self._challenges.expire()
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.pinned and lease.expires <= now:
                    lease.pinned = False  # evictable now; a late done learns if it was
                    lease.entry.pins -= 1
                elif not lease.pinned and lease.expires + _ENDED_LEASE_MEMORY_S <= now:
                    self._end_lease(lease_id)
            for session in list(self._sessions.values()):
                if now - session.last_heard > self._session_timeout_s:
                    for lease_id in list(session.leases):
                        self._end_lease(lease_id)
                    del self._sessions[session.session]

    # ---- consumer -----------------------------------------------------------------------

    def _start_consumer(self, cfg: dict[str, Any]) -> None:
        addresses = _producer_addresses(cfg.get("producer_addresses"))
        capacity = int(cfg.get("recv_bytes", 256 << 20))
        if capacity <= 0:
            raise ValueError(f"recv_bytes: {capacity} must be positive")
        self._query_timeout_s = float(cfg.get("query_timeout_s", 0.5))
        self._retry_after_s = float(cfg.get("retry_after_s", 5.0))
        self._close_timeout_s = float(cfg.get("close_timeout_s", 2.0))
        self._fetch_workers = int(cfg.get("fetch_workers", 4))
        self._name = str(cfg.get("name") or f"{socket.gethostname()}:{os.getpid()}")
        self._recv = torch.empty(capacity, dtype=torch.uint8)
        self._recv_ranges = ByteRanges(capacity)
        self._quarantine: dict[int, int] = {}  # offset -> bytes, of reads given up on
        self._refs = itertools.count(1)
        self._warned: dict[tuple[str, str], float] = {}
        self._pending: set[Future[torch.Tensor]] = set()  # loads not settled yet
        # An engine per producer (see the module docstring), made on its first read.
        self._producers = {address: _Producer(address) for address in addresses}
        self._engine_lock = threading.Lock()
        _check_transport(self._protocol, self._rdma_fallback)
        self._ctx = zmq.Context()
        self._release_socks: dict[str, zmq.Socket[bytes]] = {}
        self._release_lock = threading.Lock()
        self._fetchers = {
            address: ThreadPoolExecutor(self._fetch_workers, thread_name_prefix="kvxfer-ec-fetch")
            for address in addresses
        }

    @property
    def producers_down(self) -> list[str]:
        """Producers skipped now because they did not answer (consumer)."""
        now = time.monotonic()
        with self._lock:
            return [a for a, p in self._producers.items() if p.down_until > now]

    @property
    def quarantined_bytes(self) -> int:
        """Receive-buffer bytes held back from reuse: reads given up on that have not settled
        (consumer)."""
        with self._lock:
            return self._quarantined_bytes()

    def _quarantined_bytes(self) -> int:
        return sum(ByteRanges.rounded(n) for n in self._quarantine.values())

    def _mark_down(self, address: str, reason: str) -> None:
        with self._lock:
            producer = self._producers[address]
            fresh = producer.down_until <= time.monotonic()
            producer.down_until = time.monotonic() + self._retry_after_s
        if fresh:
            log.warning(
                "encoder-cache producer %s %s; skipped for %.1f s",
                address,
                reason,
                self._retry_after_s,
            )

    def _mark_up(self, address: str) -> None:
        with self._lock:
            producer = self._producers[address]
            if producer.down_until:
                producer.down_until = 0.0
                log.info("encoder-cache producer %s answers again", address)

    def _live(self, exclude: tuple[str, ...] = ()) -> list[_Producer]:
        now = time.monotonic()
        with self._lock:
            return [
                p for a, p in self._producers.items() if a not in exclude and p.down_until <= now
            ]

    def _dealer(self, address: str) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _FRAME_LIMIT)
        try:
            sock.connect(address)
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    def _warn_once(self, address: str, text: str) -> None:
        """Log a peer's problem at most once a minute (the scheduler asks many times a step)."""
        now = time.monotonic()
        with self._lock:
            if self._warned.get((address, text), -math.inf) > now - 60:
                return
            self._warned[(address, text)] = now
            if len(self._warned) > 1024:
                self._warned.clear()
        log.warning("%s", text)

    # Conversations: generators that yield frames to send and are sent the answers.

    def _handshake(self, producer: _Producer) -> Talk[_Link]:
        """Prove the secret to the producer and have it prove it back; open a session (kept
        for later conversations unless another one was opened meanwhile)."""
        client_nonce = auth.new_nonce()
        challenge = _unsigned(
            producer.address, (yield [encode(ECHello(consumer=self._name, nonce=client_nonce))])
        )
        if not isinstance(challenge, ECChallenge):
            raise ProtocolError(f"expected a challenge, got {type(challenge).__name__}")
        server_nonce = challenge.nonce
        proof = auth.proof(self._secret, "consumer", client_nonce, server_nonce, "ec", self._name)
        shake = ECHandshake(
            consumer=self._name,
            client_nonce=client_nonce,
            server_nonce=server_nonce,
            proof=proof,
        )
        welcome = _unsigned(producer.address, (yield [encode(shake)]))
        if not isinstance(welcome, ECWelcome):
            raise ProtocolError(f"expected a welcome, got {type(welcome).__name__}")
        expected = auth.proof(
            self._secret, "producer", client_nonce, server_nonce, welcome.session, welcome.endpoint
        )
        if not auth.proof_matches(expected, welcome.proof):
            raise ECLoadError(
                f"producer {producer.address} could not prove the shared secret: set the same "
                "secret on both sides"
            )
        try:
            endpoint = check_transport_endpoint(welcome.endpoint)
        except ValueError as exc:
            raise ProtocolError(f"a bad Mooncake endpoint: {exc}") from exc
        session = _Link(
            welcome.session,
            auth.session_key(self._secret, client_nonce, server_nonce, welcome.session),
            endpoint,
        )
        with self._lock:
            if producer.session is None:
                producer.session = session
        return session

    def _ask(
        self,
        producer: _Producer,
        make: Callable[[str, int], Message],
        session: _Link | None = None,
    ) -> Talk[tuple[Message, _Link]]:
        """Send one session message and return its authenticated answer and the session it
        went on: `session`, or the producer's (shaking hands first if there is none, and once
        more if the producer lost it)."""
        fixed = session is not None
        for attempt in range(2):
            if session is None:
                with self._lock:
                    session = producer.session
            if session is None:
                session = yield from self._handshake(producer)
            ref = next(self._refs)
            frame = encode(make(session.session, ref))
            frames = yield [frame, auth.sign(session.key, frame)]
            answer = decode(frames[0])
            if isinstance(answer, ErrorReply):
                if answer.session_lost and attempt == 0 and not fixed:
                    with self._lock:
                        if producer.session is session:
                            producer.session = None
                    session = None
                    continue
                raise ECLoadError(f"producer {producer.address} refused: {answer.reason}")
            if len(frames) != 2 or not auth.verify(session.key, frames[0], frames[1]):
                raise ProtocolError("an answer without a valid MAC was refused")
            if getattr(answer, "ref", None) != ref:
                raise ProtocolError("an answer to another question")
            return answer, session
        raise ECLoadError(f"producer {producer.address} lost the session twice")

    def _drive(
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
        socks: dict[zmq.Socket[bytes], tuple[str, Talk[T]]] = {}
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
            poller.unregister(sock)
            del socks[sock]
            sock.close(linger=0)

        def send(sock: zmq.Socket[bytes], address: str, frames: list[bytes]) -> bool:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as exc:
                results[address] = ECLoadError(f"producer {address} cannot be reached: {exc}")
                finish(sock)
                return False

        try:
            for address, talk in talks.items():
                frames = advance(address, talk, None)
                if frames is None:
                    continue
                try:
                    sock = self._dealer(address)
                except zmq.ZMQError as exc:
                    results[address] = ECLoadError(f"producer {address} cannot be reached: {exc}")
                    continue
                socks[sock] = (address, talk)
                poller.register(sock, zmq.POLLIN)
                send(sock, address, frames)
            while socks and not self._closed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for sock, _ in poller.poll(max(1, int(1000 * min(left, _POLL_SLICE_S)))):
                    address, talk = socks[sock]
                    try:
                        answer = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.ZMQError:
                        continue
                    self._mark_up(address)
                    frames = advance(address, talk, answer)
                    if frames is not None:
                        send(sock, address, frames)
                        continue
                    finish(sock)
                    result = results[address]
                    if enough is not None and not isinstance(result, Exception) and enough(result):
                        return results
            return results
        finally:
            for sock, (_, talk) in socks.items():
                sock.close(linger=0)
                talk.close()

    def _converse(
        self,
        producer: _Producer,
        make: Callable[[str, int], Message],
        deadline: float,
        session: _Link | None = None,
    ) -> tuple[Message, _Link]:
        """One session message to one producer (on `session`, or the producer's); its answer
        and the session it went on.

        Raises:
            ECLoadError: refused, unreadable, or no answer by the deadline (the producer is
                then skipped for `retry_after_s`).
        """
        results = self._drive({producer.address: self._ask(producer, make, session)}, deadline)
        if producer.address not in results:
            self._mark_down(producer.address, "did not answer in time")
            raise ECLoadError(f"producer {producer.address} did not answer in time")
        result = results[producer.address]
        if isinstance(result, Exception):
            raise result
        return result

    def _locate(
        self, mm_hash: str, exclude: tuple[str, ...] = (), problems: list[str] | None = None
    ) -> tuple[_Producer, ECInfo] | None:
        """Ask every live producer at once; the first that holds the item wins. Producers
        that refused or answered nonsense are added to `problems`."""
        candidates = {p.address: p for p in self._live(exclude)}
        if not candidates:
            return None

        def query(producer: _Producer) -> Talk[tuple[Message, _Link]]:
            return self._ask(
                producer, lambda session, ref: ECQuery(session=session, ref=ref, mm_hash=mm_hash)
            )

        def found(result: tuple[Message, _Link]) -> bool:
            answer = result[0]
            return isinstance(answer, ECInfo) and answer.found and answer.mm_hash == mm_hash

        results = self._drive(
            {a: query(p) for a, p in candidates.items()},
            time.monotonic() + self._query_timeout_s,
            found,
        )
        for address, result in results.items():
            if isinstance(result, Exception):
                self._warn_once(address, f"encoder cache: {result}")
                if problems is not None:
                    problems.append(str(result))
            elif found(result):
                assert isinstance(result[0], ECInfo)
                return candidates[address], result[0]
        if self._closed.is_set():
            return None
        for address in candidates.keys() - results.keys():
            self._mark_down(address, f"did not answer a query in {self._query_timeout_s} s")
        return None

    def _has(self, mm_hash: str) -> bool:
        try:
            return self._locate(mm_hash) is not None
        except Exception:  # a peer's fault is never the caller's: the item is just not there
            log.exception("encoder-cache lookup of %s failed", mm_hash)
            return False

    def _submit(self, mm_hash: str, device: str | torch.device) -> Future[torch.Tensor]:
        future: Future[torch.Tensor] = Future()
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)
        self._loader.submit(self._find_then_fetch, mm_hash, device, future, (), [])
        return future

    def _done(self, future: Future[torch.Tensor]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _find_then_fetch(
        self,
        mm_hash: str,
        device: str | torch.device,
        future: Future[torch.Tensor],
        tried: tuple[str, ...],
        errors: list[str],
    ) -> None:
        """Locate the item among the producers not tried yet, then fetch it from there."""
        try:
            problems: list[str] = []
            found = self._locate(mm_hash, tried, problems)
            if found is None:
                why = "; ".join(errors + problems) if errors or problems else "none holds it"
                raise ECLoadError(f"no producer could serve {mm_hash!r}: {why}")
            producer, info = found
            self._fetchers[producer.address].submit(
                self._fetch_step, mm_hash, device, future, (*tried, producer.address), errors, info
            )
        except BaseException as exc:
            _settle(future, exc)

    def _fetch_step(
        self,
        mm_hash: str,
        device: str | torch.device,
        future: Future[torch.Tensor],
        tried: tuple[str, ...],
        errors: list[str],
        info: ECInfo,
    ) -> None:
        producer = self._producers[tried[-1]]
        try:
            tensor = self._fetch(producer, mm_hash, info).to(device)
        except ECLoadError as exc:
            errors.append(str(exc))
            if self._closed.is_set():
                _settle(future, ECLoadError("; ".join(errors)))
            else:  # another producer may hold it too
                self._find_then_fetch(mm_hash, device, future, tried, errors)
            return
        except BaseException as exc:
            _settle(future, exc)
            return
        _settle(future, tensor)

    def _load(self, mm_hash: str) -> torch.Tensor:
        return self._submit(mm_hash, "cpu").result()

    def _fetch(self, producer: _Producer, mm_hash: str, info: ECInfo) -> torch.Tensor:
        """Pin, read into the receive buffer, confirm, copy out.

        Raises:
            ECLoadError: any failure; nothing of this read lands in memory in use afterwards.
        """
        address = producer.address
        deadline = time.monotonic() + self._timeout_s
        dtype, shape = self._described(address, mm_hash, info.dtype, info.shape, info.nbytes)
        if info.nbytes == 0:  # an empty tensor: its dtype and shape are all there is
            return torch.empty(shape, dtype=dtype)
        pinned, session = self._converse(
            producer,
            lambda session, ref: ECPin(session=session, ref=ref, mm_hash=mm_hash),
            deadline,
        )
        if not isinstance(pinned, ECPinned) or pinned.mm_hash != mm_hash:
            raise ECLoadError(
                f"producer {address} answered a pin of {mm_hash!r} with something else"
            )
        if not pinned.ok:
            raise ECLoadError(f"producer {address} could not serve {mm_hash!r}: {pinned.reason}")
        dtype, shape = self._described(address, mm_hash, pinned.dtype, pinned.shape, pinned.nbytes)
        nbytes = pinned.nbytes
        offset = self._reserve(nbytes, deadline)
        try:
            read = self._read(producer, session.endpoint, pinned.address, offset, nbytes)
        except BaseException:
            self._unreserve(offset, nbytes)
            raise
        try:
            self._wait_read(read, deadline)
        except FutureTimeout:
            self._quarantine_until_settled(offset, nbytes, read)
            self._mark_down(address, f"did not deliver a read in {self._timeout_s} s")
            raise ECLoadError(
                f"producer {address} did not deliver {mm_hash!r} in {self._timeout_s} s"
            ) from None
        except Exception as exc:  # settled, failed: nothing more lands
            self._unreserve(offset, nbytes)
            raise ECLoadError(f"reading {mm_hash!r} from producer {address} failed: {exc}") from exc
        try:  # on the session that holds the lease
            valid, _ = self._converse(
                producer,
                lambda session, ref: ECDone(session=session, ref=ref, lease=pinned.lease),
                deadline,
                session,
            )
            if not isinstance(valid, ECValid) or valid.lease != pinned.lease:
                raise ECLoadError(f"producer {address} answered a done with something else")
            if not valid.ok:
                raise ECLoadError(
                    f"{mm_hash!r} changed at producer {address} while it was read: {valid.reason}"
                )
            data = self._recv[offset : offset + nbytes].clone()
        finally:
            self._unreserve(offset, nbytes)
        return data.view(dtype).reshape(shape)

    def _described(
        self, address: str, mm_hash: str, dtype_name: str, shape: list[int], nbytes: int
    ) -> tuple[torch.dtype, list[int]]:
        dtype = _dtype(dtype_name)
        if any(n < 0 for n in shape) or dtype.itemsize * math.prod(shape) != nbytes:
            raise ECLoadError(
                f"producer {address} describes {mm_hash!r} inconsistently: {dtype_name} "
                f"{shape} in {nbytes} bytes"
            )
        if ByteRanges.rounded(nbytes) > self._recv_ranges.capacity:
            raise ECLoadError(
                f"{mm_hash!r}: {nbytes} bytes exceed recv_bytes {self._recv_ranges.capacity}; "
                "raise recv_bytes"
            )
        return dtype, shape

    def _engine(self, producer: _Producer) -> tuple[MooncakeTransport, Region]:
        """This consumer's Mooncake engine for one producer, the receive buffer registered."""
        with self._engine_lock:
            if producer.transport is None or producer.region is None:
                transport = self._transport()
                try:
                    producer.region = transport.register(self._recv)
                except BaseException:
                    transport.close()
                    raise
                producer.transport = transport
            return producer.transport, producer.region

    def _read(
        self, producer: _Producer, endpoint: str, remote: int, offset: int, nbytes: int
    ) -> Future[None]:
        """Read `[remote, remote + nbytes)` of the producer's pool (its Mooncake engine at
        `endpoint`) into the receive buffer at `offset`, in descriptors of at most 4 MiB; the
        future settles once every one has."""
        try:
            transport, region = self._engine(producer)
        except Exception as exc:
            raise ECLoadError(f"no Mooncake engine for producer {producer.address}: {exc}") from exc
        starts = np.arange(0, nbytes, _DESCRIPTOR_BYTES, dtype=np.int64)
        lengths = np.minimum(_DESCRIPTOR_BYTES, nbytes - starts)
        segments = Segments(
            src_region=np.zeros_like(starts),
            src_offset=starts,
            dst_region=np.full_like(starts, region.region_id),
            dst_offset=starts + offset,
            length=lengths,
        )
        peer = Peer(endpoint, {0: Region(0, remote, nbytes)})
        try:
            future = transport.read(segments, peer)
        except Exception as exc:
            raise ECLoadError(f"cannot read from producer {producer.address}: {exc}") from exc
        with self._lock:
            producer.unsettled += 1

        def settled(_: Future[None]) -> None:
            with self._lock:
                producer.unsettled -= 1
                self._lock.notify_all()

        future.add_done_callback(settled)
        return future

    def _wait_read(self, read: Future[None], deadline: float) -> None:
        """Wait for a read to settle; `FutureTimeout` at the deadline or on close."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed.is_set():
                raise FutureTimeout
            try:
                read.result(min(left, _POLL_SLICE_S))
                return
            except FutureTimeout:
                continue

    def _reserve(self, nbytes: int, deadline: float) -> int:
        while True:
            with self._lock:
                offset = self._recv_ranges.alloc(nbytes)
                if offset is not None:
                    return offset
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    raise ECLoadError(
                        f"no room for {nbytes} bytes in the receive buffer in time "
                        f"({self._quarantined_bytes()} bytes quarantined); raise recv_bytes"
                    )
                self._lock.wait(min(left, _POLL_SLICE_S))  # other loads free room

    def _unreserve(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._recv_ranges.free(offset, nbytes)
            self._lock.notify_all()

    def _quarantine_until_settled(self, offset: int, nbytes: int, read: Future[None]) -> None:
        """Keep a range out of use until the read into it has settled: only then can nothing
        more of it land there."""
        with self._lock:
            self._quarantine[offset] = nbytes

        def settled(_: Future[None]) -> None:
            with self._lock:
                if self._quarantine.pop(offset, None) is not None:
                    self._recv_ranges.free(offset, nbytes)
                    self._lock.notify_all()

        read.add_done_callback(settled)

    def _release(self, mm_hash: str) -> None:
        for producer in self._live():
            with self._lock:
                session = producer.session
            if session is None:
                continue  # a hint only: no session, nothing to demote there
            frame = encode(ECRelease(session=session.session, mm_hash=mm_hash))
            with self._release_lock:  # a socket per producer, never waited on
                sock = self._release_socks.get(producer.address)
                try:
                    if sock is None:
                        sock = self._dealer(producer.address)
                        sock.setsockopt(zmq.SNDHWM, 1000)
                        sock.setsockopt(zmq.RCVHWM, 16)  # answers (errors only) are dropped
                        self._release_socks[producer.address] = sock
                    sock.send_multipart([frame, auth.sign(session.key, frame)], zmq.NOBLOCK)
                except zmq.ZMQError:  # queue full or unreachable: a hint lost, nothing more
                    pass

    def _close(self) -> None:
        if self.role == "producer":
            self._server.close()
            # Ends any read a consumer still has in flight from the pool; then the pool goes.
            self._pool_transport.close()
            return
        for executor in self._fetchers.values():
            executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pending = list(self._pending)
        for future in pending:  # their fetch was cancelled: nobody waits forever
            _settle(future, ECLoadError("the encoder-cache connector was closed"))
        for sock in self._release_socks.values():
            sock.close(linger=0)
        self._ctx.term()
        # A read in flight (from a frozen producer) may settle soon; one that does not keeps
        # its engine and the receive buffer alive: destroying an engine whose completion
        # thread may be inside Mooncake, or freeing memory a read may still land in, is not
        # safe, and an engine destroyed later tears down newer engines' registrations.
        deadline = time.monotonic() + self._close_timeout_s
        with self._lock:
            while any(p.unsettled for p in self._producers.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, _POLL_SLICE_S))
            stuck = [p for p in self._producers.values() if p.unsettled]
        with self._engine_lock:  # no engine is made after this
            for producer in self._producers.values():
                if producer not in stuck and producer.transport is not None:
                    producer.transport.close()
        if stuck:
            log.warning(
                "encoder-cache consumer closed with reads from %s not settled; their Mooncake "
                "engines and the receive buffer are kept until the process exits",
                [p.address for p in stuck],
            )
            _KEPT.append(([p.transport for p in stuck if p.transport], self._recv))


_KEPT: list[tuple[list[MooncakeTransport], torch.Tensor]] = []  # engines a read is still inside


def _check_transport(protocol: str, rdma_fallback: bool) -> None:
    """Fail at start, not at the first load, when Mooncake or an asked-for RDMA NIC is missing.

    Raises:
        ImportError: Mooncake Transfer Engine is not installed.
        TransferError: protocol "rdma" on a machine without an RDMA device (and no fallback).
    """
    if importlib.util.find_spec("mooncake") is None:
        raise ImportError(
            "MooncakeECConnector needs Mooncake Transfer Engine: pip install "
            "'kvxfer[mooncake]' on CUDA machines or 'kvxfer[mooncake-cpu]' elsewhere"
        )
    if protocol == "rdma" and not rdma_devices() and not rdma_fallback:
        raise TransferError(
            'protocol="rdma": no RDMA device found on this machine; use protocol="tcp", or '
            "rdma_fallback=True to fall back to TCP when RDMA is unavailable"
        )


def _unsigned(address: str, frames: list[bytes]) -> Message:
    """A handshake answer; a refusal becomes `ECLoadError` with the producer's reason."""
    answer = decode(frames[0])
    if isinstance(answer, ErrorReply):
        raise ECLoadError(f"producer {address} refused: {answer.reason}")
    return answer


def _producer_addresses(value: object) -> list[str]:
    addresses = [value] if isinstance(value, str) else list(value or [])  # type: ignore[call-overload]
    if not addresses:
        raise ValueError("config: a consumer needs producer_addresses (the producers' address)")
    for address in addresses:
        if not isinstance(address, str) or not _ADDRESS.match(address):
            raise ValueError(
                f"producer_addresses: {address!r} is not a producer address; use the "
                "producer's `address`, 'tcp://host:port'"
            )
    return list(dict.fromkeys(addresses))
