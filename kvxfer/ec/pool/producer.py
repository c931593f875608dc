"""The encoder-cache producer: its registered pool, served to consumers over the side channel.

One side-channel thread (`SideChannelServer`) answers everything at once: pinning, unpinning
and lookups are dictionary operations under short locks, never a wait. A consumer's session is
the session layer's (`kvxfer.session`, service "ec"): with a `secret`, the handshake is a
challenge-response (HMAC over both sides' nonces, the secret never on the wire,
`kvxfer.session.auth`) and every later frame in either direction carries a MAC under the
session key; every answer echoes its question's `ref`. Without a secret the same exchange runs
with an empty key (docs/encoder-cache.md, "Trust"). The producer's terms in the welcome are its
transport's kind and endpoint (`ECTerms`), where the consumer reads from.

Leases end after `lease_s`: a frozen or vanished consumer cannot pin the pool for longer. An
item whose lease ended may be evicted and its bytes overwritten; the consumer's `ECDone` then
gets `ok=False` and that load fails (or goes to another producer) instead of returning torn
bytes. An ended lease is remembered a while to answer a late done; an idle session is
forgotten after `session_timeout_s` (its consumer shakes hands again).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from kvxfer.connector.messages import (
    EC_SERVICE,
    ECDone,
    ECInfo,
    ECPin,
    ECPinned,
    ECQuery,
    ECRelease,
    ECTerms,
    ECValid,
    Message,
    ProtocolError,
    decode,
    encode,
)
from kvxfer.connector.sidechannel import SideChannelServer
from kvxfer.ec.pool.config import ProducerSettings
from kvxfer.ec.pool.pool import Entry, ItemPool
from kvxfer.session.protocol import Claim, Delivery, ServerSession, SessionServer
from kvxfer.transport.factory import TransportOptions, create_transport

log = logging.getLogger(__name__)

ENDED_LEASE_MEMORY_S = 60.0  # an ended lease is remembered this long, to answer a late done
_TICK_S = 0.1  # how often leases and sessions are checked for their end


@dataclass
class Lease:
    """An item pinned for one consumer's read."""

    mm_hash: str
    entry: Entry
    session: str  # the session that pinned it: only it may end the lease
    expires: float
    pinned: bool = True  # False once expired: the record stays a while to answer a late done


@dataclass
class ConsumerState:
    """What the producer keeps of one consumer's session: its leases."""

    leases: set[str] = field(default_factory=set)


class ECProducer:
    """The producer half of `PoolECConnector`: a pool, its transport, a side channel.

    Args:
        settings: the producer's checked config.

    Raises:
        TransferError: the transport could not start or register the pool.
        OSError: the side channel cannot bind.
    """

    def __init__(self, settings: ProducerSettings) -> None:
        self.settings = settings
        self._transport = create_transport(
            settings.transport,
            TransportOptions(settings.host, settings.protocol, settings.rdma_fallback),
        )
        self._sessions: SessionServer[ConsumerState] = SessionServer(
            EC_SERVICE, settings.secret, settings.max_sessions
        )
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()  # the leases and the sessions' sets of them
        try:
            self.pool = ItemPool(settings.pool_bytes, self._transport)
            self._server = SideChannelServer(
                settings.host,
                settings.port,
                self._on_frames,
                self._on_tick,
                name="kvxfer-ec",
                tick_s=_TICK_S,
            )
        except BaseException:
            self._transport.close()
            raise
        self.address = self._server.address

    def save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Store one item's encoder output in the pool (see `ItemPool.put`)."""
        self.pool.put(mm_hash, tensor)

    def stats(self) -> dict[str, object]:
        """Consumer sessions, leases (pinned, and expired ones remembered to answer a late
        done), items held and pinned, free pool bytes, the transport, threads."""
        with self._lock:
            pinned = sum(lease.pinned for lease in self._leases.values())
            expired = len(self._leases) - pinned
        return {
            "sessions": len(self._sessions.open_sessions()),
            "leases": pinned,
            "expired_leases": expired,
            **self.pool.stats(),
            "transport": self._transport.protocol,
            "threads": 2,  # the side channel, the transport's completion thread
        }

    def close(self) -> None:
        """Stop serving; end any read a consumer still has in flight from the pool."""
        self._server.close()
        self._transport.close()

    # ---- the side-channel thread: every handler is a few dictionary operations ----------

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        def on_message(delivery: Delivery[ConsumerState]) -> None:
            answer = self._answer(delivery.session, decode(delivery.payload))
            if answer is not None:  # to the socket that asked: each conversation has one
                self._server.send(identity, self._sessions.seal(delivery.session, encode(answer)))

        refused = self._sessions.serve(
            identity, frames, self._server.send, self._welcome, on_message
        )
        if refused is not None:
            log.warning("encoder-cache producer: refused a frame: %s", refused)

    def _welcome(self, claim: Claim) -> None:
        """A consumer proved the secret (its claim carries nothing more): open its session."""
        terms = encode(ECTerms(self._transport.endpoint, self._transport.kind))
        _, welcome = self._sessions.accept(claim, terms, lambda _: ConsumerState())
        self._server.send(claim.identity, welcome)

    def _answer(self, session: ServerSession[ConsumerState], message: Message) -> Message | None:
        if isinstance(message, ECQuery):
            return self._info(message)
        if isinstance(message, ECPin):
            return self._pin(session, message)
        if isinstance(message, ECDone):
            return self._unpin(session, message)
        if isinstance(message, ECRelease):  # a hint, never answered
            self.pool.demote(message.mm_hash)
            return None
        raise ProtocolError(
            f"an encoder-cache producer does not accept {type(message).__name__} messages"
        )

    def _info(self, ask: ECQuery) -> ECInfo:
        entry = self.pool.get(ask.mm_hash)
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

    def _pin(self, session: ServerSession[ConsumerState], ask: ECPin) -> ECPinned:
        def refuse(reason: str) -> ECPinned:
            return ECPinned(ref=ask.ref, mm_hash=ask.mm_hash, ok=False, reason=reason)

        max_leases = self.settings.max_leases
        with self._lock:
            if self.pool.get(ask.mm_hash) is None:
                return refuse("not held (evicted?)")
            if sum(self._leases[i].pinned for i in session.state.leases) >= max_leases:
                return refuse(f"busy: {max_leases} reads of this consumer pinned (max_leases)")
            entry = self.pool.pin(ask.mm_hash)
            if entry is None:  # evicted by a save since the look above
                return refuse("not held (evicted?)")
            lease_id = secrets.token_hex(8)
            expires = time.monotonic() + self.settings.lease_s
            self._leases[lease_id] = Lease(ask.mm_hash, entry, session.id, expires)
            session.state.leases.add(lease_id)
        return ECPinned(
            ref=ask.ref,
            mm_hash=ask.mm_hash,
            ok=True,
            lease=lease_id,
            address=self.pool.address_of(entry),
            nbytes=entry.nbytes,
            dtype=entry.dtype,
            shape=entry.shape,
            lease_s=self.settings.lease_s,
        )

    def _unpin(self, session: ServerSession[ConsumerState], done: ECDone) -> ECValid:
        with self._lock:
            lease = self._leases.get(done.lease)
            if lease is None or lease.session != session.id:
                return ECValid(
                    ref=done.ref,
                    lease=done.lease,
                    ok=False,
                    reason="unknown lease (it ended long ago, or is not this session's)",
                )
            # Checked before the unpin: while pinned the entry cannot go, so a lease that held
            # to the end reads True; one that expired reads whether the entry survived.
            held = self.pool.holds(lease.mm_hash, lease.entry)
            self._end_lease(done.lease, session.state)
        reason = "" if held else "it was evicted while being read (its lease had ended)"
        return ECValid(ref=done.ref, lease=done.lease, ok=held, reason=reason)

    def _end_lease(self, lease_id: str, state: ConsumerState | None) -> None:
        """Forget a lease, unpinning its item if it still pins it (under the lock)."""
        lease = self._leases.pop(lease_id)
        if lease.pinned:
            self.pool.unpin(lease.entry)
        if state is not None:
            state.leases.discard(lease_id)

    def _on_tick(self) -> None:
        now = time.monotonic()
        self._sessions.expire_challenges()
        idle = [
            s
            for s in self._sessions.open_sessions()
            if now - s.last_heard > self.settings.session_timeout_s
        ]
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.pinned and lease.expires <= now:
                    lease.pinned = False  # evictable now; a late done learns if it was
                    self.pool.unpin(lease.entry)
                elif not lease.pinned and lease.expires + ENDED_LEASE_MEMORY_S <= now:
                    owner = self._sessions.get(lease.session)
                    self._end_lease(lease_id, None if owner is None else owner.state)
            for session in idle:
                for lease_id in list(session.state.leases):
                    self._end_lease(lease_id, session.state)
        for session in idle:
            self._sessions.end(session.id)
