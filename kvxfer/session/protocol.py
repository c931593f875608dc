"""The session protocol as a server and a client that do no I/O of their own.

Each turns the frames a socket received into one event, and hands back the frames to send; the
application owns the sockets, the threads and the timers (the KV producer's side-channel
thread, the KV consumer's loop, the encoder-cache producer and its consumer's conversations all
drive the same two classes). The handshake and the frames are described in
`kvxfer.session.wire`; the proofs and MACs are `kvxfer.session.auth`.

Server, per received message:
- a `Hello` is answered with a `Challenge` (`Reply`), unless `max_sessions` are open;
- a `Handshake` whose nonces were issued to that peer and whose proof holds becomes a `Claim`:
  the application checks the claim, then `accept`s it with its terms (or `refuse`s it);
- `[session, payload, MAC]` of a known session, with a valid MAC, becomes a `Delivery`; an
  unknown session gets `Refused(session_lost=True)` (the client shakes hands again).

Client: `hello()`, then `receive()` answers the challenge (`Reply`), checks the welcome's proof
(`Opened`), and afterwards checks every session frame's session and MAC (`Delivered`).
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvxfer.session import auth
from kvxfer.session.wire import (
    SESSION_FRAMES,
    Challenge,
    Handshake,
    Hello,
    ProtocolError,
    Refused,
    Welcome,
    decode,
    encode,
)

T = TypeVar("T")


def refusal(reason: str, session_lost: bool = False) -> list[bytes]:
    """The frames that refuse the last frame, naming why (unsigned: no session may exist)."""
    return [encode(Refused(reason=reason, session_lost=session_lost))]


def _claim_proof(
    secret: str, service: str, client_nonce: str, server_nonce: str, name: str, claim: bytes
) -> str:
    return auth.proof(secret, "consumer", service, client_nonce, server_nonce, name, claim)


def _terms_proof(
    secret: str, service: str, client_nonce: str, server_nonce: str, session: str, terms: bytes
) -> str:
    return auth.proof(secret, "producer", service, client_nonce, server_nonce, session, terms)


# ---- server -------------------------------------------------------------------------------


@dataclass(eq=False)  # identity: compared and hashed as objects
class ServerSession(Generic[T]):
    """One open session, as the server keeps it."""

    id: str
    name: str  # the client's name from its hello, for logs
    key: bytes
    identity: bytes  # the client's current ZeroMQ identity (it may reconnect)
    last_heard: float  # time.monotonic() of its last valid frame
    state: T  # the application's state of this session


@dataclass(frozen=True)
class Reply:
    """Send these frames back to the peer that sent the last ones."""

    frames: list[bytes]


@dataclass(frozen=True)
class Claim:
    """A client proved the secret and claims `claim`: `accept` or `refuse` it."""

    identity: bytes
    name: str
    claim: bytes
    client_nonce: str
    server_nonce: str


@dataclass(frozen=True)
class Delivery(Generic[T]):
    """A session frame whose MAC holds: `payload` is the application's message."""

    session: ServerSession[T]
    payload: bytes


class SessionServer(Generic[T]):
    """The server side of `service`'s sessions: challenges, proofs, the session table, MACs.

    The session table is thread-safe: it is read by the side-channel thread and by the
    application's workers (which seal frames and end sessions). `receive` and `accept` belong
    to one thread, the side channel's (the challenges they keep have no lock of their own).

    Args:
        service: the side channel's name ("kv", "ec"), bound into every proof.
        secret: the shared secret ("" for none: frames are then checked for integrity only).
        max_sessions: the most sessions open at once; further hellos are refused.
        challenge_ttl_s: how long a handshake may take after its hello; None: as long as
            the client waits (`auth.Challenges`).
    """

    def __init__(
        self, service: str, secret: str, max_sessions: int, challenge_ttl_s: float | None = None
    ) -> None:
        self.service, self._secret, self._max_sessions = service, secret, max_sessions
        self._challenges = auth.Challenges(ttl_s=challenge_ttl_s)
        self._sessions: dict[str, ServerSession[T]] = {}
        self._lock = threading.Lock()

    def receive(self, identity: bytes, frames: list[bytes]) -> Reply | Claim | Delivery[T]:
        """What `frames`, received from the peer `identity`, amount to.

        Raises:
            ProtocolError: the frames are not a valid step of the protocol (answer with
                `refusal(str(exc))`).
        """
        if len(frames) == SESSION_FRAMES:
            return self._deliver(identity, frames)
        if len(frames) != 1:
            raise ProtocolError(
                f"expected a handshake frame or {SESSION_FRAMES} session frames, got "
                f"{len(frames)} frames"
            )
        message = decode(frames[0])
        if isinstance(message, Hello):
            return self._challenge(identity, message)
        if isinstance(message, Handshake):
            return self._check_claim(identity, message)
        raise ProtocolError(f"a server does not accept {type(message).__name__} messages")

    def serve(
        self,
        identity: bytes,
        frames: list[bytes],
        send: Callable[[bytes, list[bytes]], None],
        on_claim: Callable[[Claim], None],
        on_message: Callable[[Delivery[T]], None],
    ) -> ProtocolError | None:
        """Act on `frames` from the peer `identity` (the side channel's thread): `send` the
        handshake's replies, hand a proven claim to `on_claim` and a session's message to
        `on_message`. Frames that are not a valid step, or that a handler refuses with a
        `ProtocolError`, are answered with a `refusal`; the error is returned for the caller's
        log (None when nothing was refused)."""
        try:
            event = self.receive(identity, frames)
            if isinstance(event, Reply):
                send(identity, event.frames)
            elif isinstance(event, Claim):
                on_claim(event)
            else:
                on_message(event)
        except ProtocolError as exc:
            send(identity, refusal(str(exc)))
            return exc
        return None

    def accept(
        self, claim: Claim, terms: bytes, make_state: Callable[[str], T]
    ) -> tuple[ServerSession[T], list[bytes]]:
        """Open the session `claim` asked for, with the application's `terms`.

        Args:
            claim: a `Claim` from `receive`.
            terms: what the client learns of this server (bound into the server's proof).
            make_state: the application's state of the session, given its id.

        Returns:
            The session, and the frames of the welcome to send to `claim.identity`.

        Raises:
            ProtocolError: `max_sessions` sessions opened since the claim's hello.
        """
        session_id = secrets.token_hex(16)
        with self._lock:  # handshakes may overlap: the limit holds when they complete too
            if len(self._sessions) >= self._max_sessions:
                raise ProtocolError(
                    f"handshake refused: {self._max_sessions} sessions are open (max_sessions)"
                )
        key = auth.session_key(self._secret, claim.client_nonce, claim.server_nonce, session_id)
        session = ServerSession(
            session_id, claim.name, key, claim.identity, time.monotonic(), make_state(session_id)
        )
        with self._lock:
            self._sessions[session_id] = session
        proof = _terms_proof(
            self._secret, self.service, claim.client_nonce, claim.server_nonce, session_id, terms
        )
        return session, [encode(Welcome(session=session_id, terms=terms, proof=proof))]

    def seal(self, session: ServerSession[T], payload: bytes) -> list[bytes]:
        """The frames that carry `payload` to `session`'s client."""
        return [session.id.encode(), payload, auth.sign(session.key, payload)]

    def get(self, session_id: str) -> ServerSession[T] | None:
        """The open session `session_id`, if any."""
        with self._lock:
            return self._sessions.get(session_id)

    def end(self, session_id: str) -> ServerSession[T] | None:
        """Close `session_id`: its frames are refused from now on (the client learns it lost
        the session). Returns it if it was open."""
        with self._lock:
            return self._sessions.pop(session_id, None)

    def open_sessions(self) -> list[ServerSession[T]]:
        """Every open session."""
        with self._lock:
            return list(self._sessions.values())

    def expire_challenges(self) -> None:
        """Forget challenges whose handshake did not come in time."""
        self._challenges.expire()

    def _challenge(self, identity: bytes, hello: Hello) -> Reply:
        if hello.service != self.service:
            raise ProtocolError(
                f"handshake refused: this side channel serves {self.service!r}, not "
                f"{hello.service!r}; check the address"
            )
        with self._lock:
            if len(self._sessions) >= self._max_sessions:
                raise ProtocolError(
                    f"handshake refused: {self._max_sessions} sessions are open (max_sessions)"
                )
        server_nonce = self._challenges.issue(identity, hello.nonce, hello.name)
        return Reply([encode(Challenge(nonce=server_nonce))])

    def _check_claim(self, identity: bytes, shake: Handshake) -> Claim:
        name = self._challenges.redeem(identity, shake.client_nonce, shake.server_nonce)
        if name is None:  # a hello is used once: a replayed handshake finds none
            raise ProtocolError("handshake refused: no matching Hello; start with Hello")
        expected = _claim_proof(
            self._secret, self.service, shake.client_nonce, shake.server_nonce, name, shake.claim
        )
        if not auth.proof_matches(expected, shake.proof):
            raise ProtocolError(
                "handshake refused: wrong or missing shared secret (both sides need the same "
                "secret=...)"
            )
        return Claim(identity, name, shake.claim, shake.client_nonce, shake.server_nonce)

    def _deliver(self, identity: bytes, frames: list[bytes]) -> Reply | Delivery[T]:
        session_id, payload, mac = frames
        with self._lock:
            session = self._sessions.get(session_id.decode("ascii", "replace"))
        if session is None:
            return Reply(refusal("unknown session; shake hands again", session_lost=True))
        if not auth.verify(session.key, payload, mac):
            raise ProtocolError("a session frame without a valid MAC was refused")
        session.identity, session.last_heard = identity, time.monotonic()
        return Delivery(session, payload)


# ---- client -------------------------------------------------------------------------------


class ClientState(enum.Enum):
    """Where a client's handshake stands."""

    NEW = "new"  # hello not sent yet
    GREETED = "greeted"  # hello sent, waiting for the challenge
    CLAIMED = "claimed"  # handshake sent, waiting for the welcome
    OPEN = "open"  # the server proved the secret: session frames flow
    CLOSED = "closed"  # refused, or the server could not prove the secret


@dataclass(frozen=True)
class Opened:
    """The server proved the secret and opened the session on these terms."""

    terms: bytes


@dataclass(frozen=True)
class Rejected:
    """The server refused the last frame (`session_lost`: it no longer knows the session)."""

    reason: str
    session_lost: bool


@dataclass(frozen=True)
class Delivered:
    """A session frame whose MAC holds: `payload` is the application's message."""

    payload: bytes


class SessionClient:
    """The client side of one session with one server.

    The handshake (`hello`, and `receive` until `Opened`) belongs to one thread. Once open, the
    client is only read: `seal` and `receive` of session frames and refusals change nothing, so
    several threads may share an open client (the encoder-cache consumer's conversations do).

    Args:
        service: the side channel's name ("kv", "ec"), bound into every proof.
        secret: the shared secret ("" for none).
        name: this client's name, for the server's logs (bound into the proof).
        claim: what the server learns of this client (bound into the proof).
    """

    def __init__(self, service: str, secret: str, name: str, claim: bytes) -> None:
        self.service, self._secret, self.name, self._claim = service, secret, name, claim
        self.state = ClientState.NEW
        self.session = ""  # the server's id for the session, once open
        self._key = b""
        self._client_nonce = auth.new_nonce()
        self._server_nonce = ""

    def hello(self) -> list[bytes]:
        """The first frames to send."""
        if self.state is not ClientState.NEW:
            raise ProtocolError(f"hello() on a client that is {self.state.value}")
        self.state = ClientState.GREETED
        return [encode(Hello(service=self.service, name=self.name, nonce=self._client_nonce))]

    def receive(self, frames: list[bytes]) -> Reply | Opened | Rejected | Delivered:
        """What `frames`, received from the server, amount to.

        Raises:
            ProtocolError: a message this state does not expect, a session frame of another
                session or without a valid MAC, or a welcome whose proof fails (the server does
                not hold the secret: the client is then closed).
        """
        if len(frames) == SESSION_FRAMES:
            return self._delivered(frames)
        if len(frames) != 1:
            raise ProtocolError(f"expected 1 or {SESSION_FRAMES} frames, got {len(frames)}")
        message = decode(frames[0])
        if isinstance(message, Refused):
            # A refused handshake ends the client; a refused session frame fails only that
            # frame's exchange (the server keeps the session; it says so when it lost it).
            if self.state is not ClientState.OPEN:
                self.state = ClientState.CLOSED
            return Rejected(message.reason, message.session_lost)
        if isinstance(message, Challenge) and self.state is ClientState.GREETED:
            return self._answer(message)
        if isinstance(message, Welcome) and self.state is ClientState.CLAIMED:
            return self._open(message)
        raise ProtocolError(f"unexpected {type(message).__name__} while {self.state.value}")

    def seal(self, payload: bytes) -> list[bytes]:
        """The frames that carry `payload` on the open session."""
        if self.state is not ClientState.OPEN:
            raise ProtocolError(f"no open session to send on (the client is {self.state.value})")
        return [self.session.encode(), payload, auth.sign(self._key, payload)]

    def _answer(self, challenge: Challenge) -> Reply:
        self._server_nonce = challenge.nonce
        proof = _claim_proof(
            self._secret,
            self.service,
            self._client_nonce,
            self._server_nonce,
            self.name,
            self._claim,
        )
        shake = Handshake(
            client_nonce=self._client_nonce,
            server_nonce=self._server_nonce,
            claim=self._claim,
            proof=proof,
        )
        self.state = ClientState.CLAIMED
        return Reply([encode(shake)])

    def _open(self, welcome: Welcome) -> Opened:
        expected = _terms_proof(
            self._secret,
            self.service,
            self._client_nonce,
            self._server_nonce,
            welcome.session,
            welcome.terms,
        )
        if not auth.proof_matches(expected, welcome.proof):
            self.state = ClientState.CLOSED
            raise ProtocolError(
                "the server could not prove the shared secret: set the same secret on both sides"
            )
        self.session, self.state = welcome.session, ClientState.OPEN
        self._key = auth.session_key(
            self._secret, self._client_nonce, self._server_nonce, welcome.session
        )
        return Opened(welcome.terms)

    def _delivered(self, frames: list[bytes]) -> Delivered:
        session_id, payload, mac = frames
        if self.state is not ClientState.OPEN or session_id != self.session.encode():
            raise ProtocolError("a session frame of another session was refused")
        if not auth.verify(self._key, payload, mac):
            raise ProtocolError("an answer without a valid MAC was refused")
        return Delivered(payload)
