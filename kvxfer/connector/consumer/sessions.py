"""`ProducerSessions`: a decode rank's sessions with the producer ranks of a prefill engine.

One ZeroMQ DEALER socket and one `kvxfer.session.SessionClient` per producer rank: the
handshake proves the shared secret both ways and carries this rank's claim (`KVClaim`: engine
id, geometry) and the producer's terms (`KVTerms`: geometry, transport endpoint, cache regions,
staging slot size); every later message travels sealed (`[session, payload, MAC]`).

    hello -> challenge -> handshake (claim, proof) -> welcome (terms, proof) -> live

This module keeps the sessions alive; what their messages mean for chunks is the fetch
machine's, which it tells through a `SessionListener`. The rules:
- a producer is dead when its host says so, never for its silence alone: its address refused
  a connection (nothing listens there: its process ended; libzmq's `EVENT_CLOSED` before a
  connection), or a reconnect found no connection by its deadline nor for `peer_timeout_s`
  after its last one dropped (a lost host). Then the
  chunks that relied on it fail at once with their blocks;
- a live session whose connection dropped (the producer closed it, or its libzmq answered no
  heartbeat for `peer_timeout_s`) is lost, not dead: the chunks it had not served yet are asked
  again on a new session, whose connection tells which it was (refused: the process ended;
  accepted by the producer's kernel: the process exists, frozen or not run by a loaded
  machine, and the new handshake waits for it as long as the fetches that need it allow). A
  silent producer and a starved one look the same from here: whole vLLM CPU worker processes
  went unrun for 10-21 s under the real-engine suite on 2 cores, their libzmq threads
  included, and a rule that failed their loads after 10 s of silence failed loads of live
  engines; now their fetches wait for them within `fetch_timeout_s`. The heartbeats (ZMTP PING
  and PONG, every `heartbeat_s`) are answered by libzmq's I/O threads, which need no GIL: a
  producer whose Python threads cannot run (a C call holding its GIL, as vLLM CPU workers' TP
  all-gather did for 56-60 s) keeps its connection and serves once it runs again;
- the chunks asked again go to whichever process answers at the address: one restarted there
  serves what it publishes, and what it never publishes fails at the fetch's deadline (the
  loss may be seen after a fetch began, so its begin cannot tell which process it relied on);
- a first handshake not finished in its `timeout` fails the session (while its connection is
  up, the caller's `held_timeout`);
- a handshake whose connection drops (libzmq's heartbeats unanswered: the producer's libzmq
  greeted, then its process was not run for `peer_timeout_s`, as a loaded machine runs one in
  bursts; or the producer closed it) starts over on a new connection, at most once a
  `heartbeat_s`: the producer may yet answer the hello it read on the dropped one, an answer
  that never arrives here, and libzmq's own reconnect sends no hello again. While its host
  took a connection within the last `peer_timeout_s` the handshake is held, not late;
- a live producer is also pinged every `heartbeat_s` by this loop: its answers keep the
  producer's side of the session fresh (it drops a consumer it has not heard from for its
  `session_timeout_s`), and say nothing about liveness here;
- a producer that answers that it forgot the session (it restarted within a heartbeat) is
  told to the listener first: chunks it had not served yet ask again on a new session;
- done and abort notices for a producer that is not live wait (at most `_MAX_NOTICES`) until
  a new session is, and ask for one: a producer silent for a while still frees blocks early;
- a lost session is opened again at once; a dead one when a fetch or a notice needs it, at
  most once a `peer_timeout_s` after a handshake that timed out (a producer that stays away
  is not flooded; a refusal costs it nothing, and a restarted producer listens again),
  with as long for its handshake as the longest `connect` allowed (a starved producer answers
  a reconnect no faster than a connect), and only with the same producer geometry (else
  `connect` must plan the new engine).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from kvxfer.connector.messages import (
    KV_SERVICE,
    KVClaim,
    KVTerms,
    Message,
    Ping,
    Pong,
    ProtocolError,
    RegionInfo,
    RequestsDone,
    TransferRequest,
    decode,
    decode_terms,
    encode,
)
from kvxfer.connector.sidechannel import close_watched, connection_events, has_message
from kvxfer.plan.paged import STAGING_REGION
from kvxfer.session.protocol import Delivered, Opened, Rejected, Reply, SessionClient
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Peer, Region, Transport
from kvxfer.transport.factory import check_peer_endpoint

log = logging.getLogger(__name__)

_MAX_NOTICES = 4096  # done/abort notices kept per producer rank while it is unreachable
# Finished requests are reported in batches while other fetches run: at most this long after
# the first one finished (the loop turns at least every 10 ms while one waits), or once this
# many wait; at once when the last fetch in flight finished (`FetchMachine`). Nothing waits for
# the report but the prefill's blocks: one message per producer rank per batch, not per
# request, and none in the way of the fetches still running.
_DONE_BATCH_S = 0.005
_DONE_BATCH_MAX = 64
# A session's connection events that decide whether its producer is there (`_on_connection_events`).
_WATCHED_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def _late_handshake(session: ProducerSession) -> str:
    """Why a handshake past its deadline failed (`ProducerSessions.tick`)."""
    if session.reconnect:
        return "could not be reached again in time: its host is lost or unreachable"
    return "did not answer the handshake in time"


class SessionState(enum.Enum):
    """Where a session with one producer rank stands."""

    CONNECTING = "connecting"  # shaking hands
    LIVE = "live"
    DEAD = "dead"  # failed, timed out, refused or replaced; its socket is closed


@dataclass(eq=False)  # identity: compared and hashed as objects
class ProducerSession:
    """This rank's session with one producer rank (one socket, one handshake)."""

    address: str
    sock: zmq.Socket
    monitor: zmq.Socket  # `sock`'s connection events: a closed connection is a dead producer
    client: SessionClient
    deadline: float  # of the handshake
    expect: KVCacheSpec | None = None  # a reconnect must find the same producer geometry
    # While its connection is up (the producer's process exists, not run yet) the handshake
    # waits until this: a first one the caller's `held_timeout` (`KVConsumer.connect`), a
    # reconnect as long as the fetches that wait for it (never late on its own).
    held_deadline: float = 0.0
    state: SessionState = SessionState.CONNECTING
    spec: KVCacheSpec | None = None
    peer: Peer | None = None  # the producer's cache regions, by layer
    # Where the plan's source region keys lie in `peer` (its layers, then a staging slot at
    # key `num_layers`): built once at the handshake, used by every read.
    src_places: dict[int, tuple[int, int]] = field(default_factory=dict)
    slot_bytes: int = 0
    last_ping: float = 0.0
    error: str = ""
    died_at: float = float("inf")
    # The producer forgot it, or its connection dropped: its unread chunks may ask anew.
    lost: bool = False
    opened: bool = False  # the handshake completed, with terms that passed the checks
    # A reconnect's handshake outlives its deadline while its connection is up (the producer's
    # process exists); a first handshake's deadline is the caller's.
    reconnect: bool = False
    connected: bool = False  # libzmq holds a connection to the producer's address now
    dropped_at: float = float("-inf")  # when a connection of its handshake last dropped
    redialed_at: float = 0.0  # when its handshake last started on a new socket
    redial_due: bool = False  # a connection dropped mid-handshake: start it over (`tick`)
    refused: bool = False  # its address refused a connection: nothing listened there then

    @property
    def rank(self) -> int:
        """The producer's engine rank (its TP rank without pipeline parallelism)."""
        assert self.spec is not None
        return self.spec.engine_rank

    def take_terms(self, terms: KVTerms, transport: Transport) -> None:
        """Learn the producer's geometry and memory from the terms of its welcome; its
        transport must be of `transport`'s kind (this consumer's).

        Raises:
            ValueError: another transport kind, a bad endpoint, or regions that do not cover
                its cache.
        """
        endpoint = check_peer_endpoint(transport.kind, terms.transport, terms.endpoint)
        if len(terms.cache_regions) != terms.spec.num_layers or any(
            r.nbytes < terms.spec.layer_extent_bytes for r in terms.cache_regions
        ):
            raise ValueError("its advertised regions do not cover its cache")
        self.opened, self.spec = True, terms.spec
        regions = {
            layer: Region(layer, r.address, r.nbytes) for layer, r in enumerate(terms.cache_regions)
        }
        self.peer = Peer(endpoint, regions)
        staging_key = terms.spec.num_layers  # after the producer's layer regions
        self.src_places = {layer: (layer, 0) for layer in range(staging_key)}
        self.src_places[STAGING_REGION] = (staging_key, 0)
        self.slot_bytes = terms.staging_slot_bytes

    def source(self, staging: RegionInfo | None) -> Peer:
        """The producer memory a chunk's read may touch: its staging slot `staging` (at key
        `num_layers`, as `src_places` maps it), or else its cache regions."""
        assert self.spec is not None and self.peer is not None
        if staging is None:
            return Peer(self.peer.endpoint, self.peer.regions)
        key = self.spec.num_layers
        return Peer(self.peer.endpoint, {key: Region(key, staging.address, staging.nbytes)})


class SessionListener(Protocol):
    """What the sessions tell the fetch machine."""

    def session_ended(self, session: ProducerSession, why: str) -> None:
        """`session` is dead: fail every chunk that relied on it."""

    def session_forgotten(self, session: ProducerSession) -> None:
        """`session` was lost (the producer forgot it, or its connection dropped): requeue
        the chunks not in the cache yet; the session ends right after."""

    def answer(self, session: ProducerSession, message: Message) -> None:
        """The producer answered on `session` (a chunk's answer)."""


class ProducerSessions:
    """Every session of one decode rank, owned by the consumer's loop thread.

    Args:
        ctx: the ZeroMQ context of the sockets.
        spec: this rank's geometry (its claim).
        engine_id: this decode engine's id.
        secret: the shared secret ("" for none).
        heartbeat_s: how often libzmq sends each producer a heartbeat, and this loop a ping.
        peer_timeout_s: a producer whose libzmq answers no heartbeat for this long has its
            connection dropped (its session is lost, and opened again).
        listener: told of ended and forgotten sessions and of answers.
        transport: the consumer's transport (a producer's must be of its kind).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        spec: KVCacheSpec,
        engine_id: str,
        secret: str,
        heartbeat_s: float,
        peer_timeout_s: float,
        listener: SessionListener,
        transport: Transport,
    ) -> None:
        self._ctx, self._spec, self._engine_id, self._secret = ctx, spec, engine_id, secret
        self._heartbeat_s, self._peer_timeout_s = heartbeat_s, peer_timeout_s
        # A reconnect's handshake may take as long as the longest `connect` allowed its own.
        self._handshake_timeout_s = peer_timeout_s
        self._listener = listener
        self._transport = transport
        self.by_rank: dict[int, ProducerSession] = {}  # the engine's, once `connect` adopted
        self._open: dict[zmq.Socket, ProducerSession] = {}  # every session not dead
        self._monitors: dict[zmq.Socket, ProducerSession] = {}  # their connection events
        self._notices: dict[int, list[Message]] = {}  # for producers that are not live
        self._done: dict[str, None] = {}  # finished request ids not reported yet, in order
        self._done_since = 0.0  # when the first of them finished

    # ---- opening -------------------------------------------------------------------------

    def open(
        self,
        address: str,
        timeout: float,
        expect: KVCacheSpec | None = None,
        reconnect: bool = False,
        held_timeout: float | None = None,
    ) -> ProducerSession:
        """Start a handshake with the producer at `address`, done within `timeout` seconds or
        the session fails; while its connection is up it may take `held_timeout` (default
        `timeout`), and a `reconnect` as long as its connection stays up. A reconnect later
        allows its handshake as long as the longest `timeout`."""
        self._handshake_timeout_s = max(self._handshake_timeout_s, timeout)
        sock, monitor, client = self._dial(address)
        now = time.monotonic()
        deadline = now + timeout
        session = ProducerSession(address, sock, monitor, client, deadline, expect)
        held = float("inf") if reconnect else max(deadline, now + (held_timeout or 0.0))
        session.held_deadline = held
        session.reconnect = reconnect
        session.redialed_at = now
        self._start_handshake(session)
        return session

    def _dial(self, address: str) -> tuple[zmq.Socket, zmq.Socket, SessionClient]:
        """A socket connecting to `address`, its monitor, and a new handshake's client."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self._heartbeat_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self._peer_timeout_s * 1000)))
        # No ZMTP greeting deadline of libzmq's own: a producer whose kernel accepted the
        # connection but whose process is not run keeps it (the handshake's deadline rules).
        sock.setsockopt(zmq.HANDSHAKE_IVL, 0)
        monitor = sock.get_monitor_socket(_WATCHED_EVENTS)
        sock.connect(address)
        claim = encode(KVClaim(engine_id=self._engine_id, spec=self._spec))
        return sock, monitor, SessionClient(KV_SERVICE, self._secret, self._engine_id, claim)

    def _start_handshake(self, session: ProducerSession) -> None:
        session.sock.send_multipart(session.client.hello())
        self._open[session.sock] = session
        self._monitors[session.monitor] = session

    def _may_redial(self, session: ProducerSession, now: float) -> bool:
        """At most one new socket a `heartbeat_s` per handshake: a peer that takes each
        connection and closes it is not dialled in a loop (its handshake ends at its deadline,
        a reconnect's fetches at theirs)."""
        return now - session.redialed_at >= self._heartbeat_s

    def _redial(self, session: ProducerSession) -> None:
        """The connection of a session still shaking hands dropped (its producer answered no
        heartbeat: frozen, or not run by a loaded machine, after its libzmq greeted; or it
        closed it): the producer may have read the hello and answer it on that connection,
        never seen again here, and libzmq's own reconnect sends no hello again, so the
        handshake starts over on a new socket, with the same deadlines."""
        self._open.pop(session.sock, None)
        self._close_sockets(session)
        session.sock, session.monitor, session.client = self._dial(session.address)
        session.connected, session.redial_due = False, False
        session.redialed_at = time.monotonic()
        self._start_handshake(session)

    @staticmethod
    def settled(pending: list[ProducerSession]) -> bool:
        """Whether a `connect`'s handshakes are over: every one live, or one failed."""
        return not any(s.state is SessionState.CONNECTING for s in pending) or any(
            s.state is SessionState.DEAD for s in pending
        )

    def adopt(self, pending: list[ProducerSession]) -> None:
        """Make the settled sessions of a `connect` the engine's, by producer rank.

        Raises:
            ConnectionError: one of them failed.
            ValueError: two addresses lead to the same producer rank.
        """
        failed = next((s for s in pending if s.state is SessionState.DEAD), None)
        if failed is not None:
            raise ConnectionError(f"producer {failed.address} {failed.error}")
        self.by_rank = {s.rank: s for s in pending}
        if len(self.by_rank) != len(pending):
            raise ValueError("connect: two addresses lead to the same producer rank")

    def drop(self, sessions: Collection[ProducerSession], why: str) -> None:
        """End `sessions` and forget the engine's (a `connect` that failed or was replaced)."""
        for session in list(sessions):
            self.fail(session, why)
        self.by_rank = {}

    # ---- the loop's side -----------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket]:
        """The sockets to poll: every session's that is not dead, and its monitor."""
        return [*self._open, *self._monitors]

    def drain(self, sock: zmq.Socket) -> None:
        """Handle every message waiting on `sock`."""
        watched = self._monitors.get(sock)
        if watched is not None:
            self._on_connection_events(watched)
            return
        session = self._open.get(sock)
        while session is not None and session.state is not SessionState.DEAD:
            if not has_message(sock):
                return
            frames = sock.recv_multipart(zmq.NOBLOCK)
            try:
                self._on_frames(session, frames)
            except ProtocolError as exc:
                live = session.state is SessionState.LIVE
                what = "unreadable answer" if live else "failed the handshake"
                self.fail(session, f"{what}: {exc}")
                return

    def tick(self, now: float) -> None:
        """Fail late handshakes; ping the live producers when due (a dead one is found by its
        connection's events: `_on_connection_events`)."""
        for session in list(self._open.values()):
            if session.state is SessionState.CONNECTING and self._handshake_late(session, now):
                self.fail(session, _late_handshake(session))
            elif session.state is SessionState.CONNECTING and session.redial_due:
                if self._may_redial(session, now):
                    self._redial(session)
            elif session.state is SessionState.LIVE and self._ping_due(session, now):
                session.last_ping = now
                self.send(session, Ping())
        if self._done and now - self._done_since >= _DONE_BATCH_S:
            self.report_done()

    def postpone(self, seconds: float) -> None:
        """Move every handshake's deadline `seconds` later: the loop was not run that long
        (a handshake's deadline counts the time this rank could hear the answer)."""
        for session in self._open.values():
            if session.state is SessionState.CONNECTING:
                session.deadline += seconds
                session.held_deadline += seconds
                session.dropped_at += seconds

    def _handshake_late(self, session: ProducerSession, now: float) -> bool:
        """Past its deadline, or past its `held_deadline` while its producer's host holds its
        connection (the process exists, and is not run yet) or held one within the last
        `peer_timeout_s` (a dropped one is dialled again within a `heartbeat_s`: a host that
        takes no connection for that long is lost)."""
        held = session.connected or now - session.dropped_at < self._peer_timeout_s
        return now > (session.held_deadline if held else session.deadline)

    def _ping_due(self, session: ProducerSession, now: float) -> bool:
        return now - session.last_ping >= self._heartbeat_s

    # ---- the fetch machine's side --------------------------------------------------------

    def session_for(self, rank: int, since: float) -> ProducerSession | str | None:
        """The live session with producer `rank`; None while one is being opened; or why a
        chunk of a fetch begun at `since` cannot be served (the producer died, or a new
        handshake failed, during that fetch). A session that died before is opened again."""
        session = self.by_rank.get(rank)
        if session is None:
            return "is not connected"
        if session.state is SessionState.DEAD:
            if session.died_at >= since and not session.lost:
                return f"producer {session.address} {session.error}"
            self._reconnect(rank)  # shake hands again, as briefly as a peer may stay silent
            return None
        return session if session.state is SessionState.LIVE else None

    def send(self, session: ProducerSession, message: Message) -> None:
        """Send `message` on the live `session` (a failed send ends it). An ask for a request
        reported done in the batch still to go sends the batch first: the producer must see
        the report before the new ask, or it would drop what it does for the ask."""
        if isinstance(message, TransferRequest) and message.request_id in self._done:
            self.report_done()
        try:
            session.sock.send_multipart(session.client.seal(encode(message)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.fail(session, f"cannot be sent to: {exc}")

    def notify_all(self, message: Message) -> None:
        """`notify` every producer rank of the engine (after the done batch: see `send`)."""
        self.report_done()
        self._notify_ranks(message)

    def done(self, request_id: str) -> None:
        """This rank is finished with the request (ok or not): every producer rank is told in
        the next batch (`_DONE_BATCH_S`)."""
        if not self._done:
            self._done_since = time.monotonic()
        self._done[request_id] = None
        if len(self._done) >= _DONE_BATCH_MAX:
            self.report_done()

    @property
    def reporting(self) -> bool:
        """Finished requests wait to be reported (the loop must turn within the batch time)."""
        return bool(self._done)

    def report_done(self) -> None:
        """Tell every producer rank the finished requests now, in one message each."""
        ids, self._done = list(self._done), {}
        if ids:
            self._notify_ranks(RequestsDone(request_ids=ids))

    def _notify_ranks(self, message: Message) -> None:
        for rank in list(self.by_rank):
            self.notify(rank, message)

    def notify(self, rank: int, message: Message) -> None:
        """Send a notice (done, abort) to producer `rank` now, or once a session with it is
        live again: a producer that was silent for a while still frees its blocks early."""
        session = self.by_rank.get(rank)
        if session is not None and session.state is SessionState.LIVE:
            self.send(session, message)
            return
        queue = self._notices.setdefault(rank, [])
        queue.append(message)
        del queue[:-_MAX_NOTICES]
        self._reconnect(rank)

    def fail(self, session: ProducerSession, why: str) -> None:
        """The session is over: the listener fails every chunk that relied on it."""
        if session.state is SessionState.DEAD:
            return
        session.state, session.error = SessionState.DEAD, why
        session.died_at = time.monotonic()
        self._open.pop(session.sock, None)
        log.warning("consumer %s: producer %s %s", self._engine_id, session.address, why)
        self._listener.session_ended(session, why)
        self._close_sockets(session)

    def counts(self) -> tuple[int, int]:
        """The engine's live and dead sessions."""
        sessions = list(self.by_rank.values())
        live = sum(s.state is SessionState.LIVE for s in sessions)
        return live, sum(s.state is SessionState.DEAD for s in sessions)

    def close(self) -> None:
        """Report the finished requests, then close every socket (the consumer closes: no
        chunk is left to fail)."""
        self.report_done()
        for session in list(self._open.values()):
            session.state = SessionState.DEAD
            self._close_sockets(session)
        self._open.clear()

    def _close_sockets(self, session: ProducerSession) -> None:
        """Close the session's socket and its monitor (no event of it matters any more)."""
        self._monitors.pop(session.monitor, None)
        close_watched(session.sock, session.monitor)

    def _on_connection_events(self, session: ProducerSession) -> None:
        """What libzmq did with the session's connection: connected; refused (`EVENT_CLOSED`:
        nothing listens at the address, the producer's process ended: dead); dropped (the
        producer closed it, or answered no heartbeat for `peer_timeout_s`: a live session is
        lost, its unread chunks asked again on a new one, whose connection tells which; a
        handshake's starts over on a new socket)."""
        for event in connection_events(session.monitor):
            if session.state is SessionState.DEAD:
                return  # its monitor is closed
            if event == zmq.EVENT_CONNECTED:
                session.connected = True
            elif event == zmq.EVENT_CLOSED:
                session.refused = True
                self.fail(
                    session,
                    "refused the connection: nothing listens at its address (its process ended)",
                )
            elif event == zmq.EVENT_DISCONNECTED:
                session.connected = False
                if session.state is SessionState.LIVE:
                    self._lose(session)
                    return
                session.dropped_at, session.redial_due = time.monotonic(), True
                if self._may_redial(session, session.dropped_at):
                    self._redial(session)
                    return  # the old monitor is closed

    def _lose(self, session: ProducerSession) -> None:
        """The live session's connection dropped: the chunks the producer had not served yet
        ask again on a new session, opened now: its connection's first events tell within
        milliseconds whether the producer is gone (refused: dead, so the engine's owner looks
        it up again before its next load) or there (accepted: the session waits for it)."""
        session.lost = True
        self._listener.session_forgotten(session)
        self.fail(
            session,
            f"closed the connection or answered no heartbeat for {self._peer_timeout_s:g} s "
            "(its process ended, or it is frozen or not run): connecting again",
        )
        if session.spec is not None and self.by_rank.get(session.rank) is session:
            self._reconnect(session.rank)

    # ---- one session's frames ------------------------------------------------------------

    def _on_frames(self, session: ProducerSession, frames: list[bytes]) -> None:
        event = session.client.receive(frames)
        if isinstance(event, Reply):
            session.sock.send_multipart(event.frames)
        elif isinstance(event, Opened):
            self._on_opened(session, event.terms)
        elif isinstance(event, Rejected):
            if event.session_lost and session.state is SessionState.LIVE:
                session.lost = True
                self._listener.session_forgotten(session)
            self.fail(session, f"refused: {event.reason}")
        elif isinstance(event, Delivered) and session.state is SessionState.LIVE:
            message = decode(event.payload)
            if not isinstance(message, Pong):  # a pong only says alive: heard, above
                self._listener.answer(session, message)

    def _on_opened(self, session: ProducerSession, data: bytes) -> None:
        """The producer proved the secret: check its terms, then the session is live."""
        try:
            session.take_terms(decode_terms(data, KVTerms), self._transport)
        except ValueError as exc:  # ProtocolError included
            self.fail(session, f"sent a bad handshake: {exc}")
            return
        if session.expect is not None and session.expect != session.spec:
            self.fail(
                session,
                "came back with another geometry; call connect() again to plan the new engine",
            )
            return
        session.state, session.last_ping = SessionState.LIVE, time.monotonic()
        for notice in self._notices.pop(session.rank, []):
            self.send(session, notice)

    def _reconnect(self, rank: int) -> None:
        """Shake hands again with producer `rank` if its session died (at most once a
        `peer_timeout_s` after a handshake that timed out; at once after a refused one: a
        refusal costs the producer's host nothing, and a restarted producer listens again)."""
        session = self.by_rank.get(rank)
        if session is None or session.state is not SessionState.DEAD:
            return
        recent = time.monotonic() - session.died_at < self._peer_timeout_s
        if recent and not (session.opened or session.refused):
            return  # the last attempt timed out a moment ago
        fresh = self.open(session.address, self._handshake_timeout_s, session.spec, reconnect=True)
        fresh.spec = session.spec
        self.by_rank[rank] = fresh
