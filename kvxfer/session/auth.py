"""Peer authentication on a side channel: a challenge-response handshake and signed frames.

With a shared secret, neither side sends it: each proves it holds it with an HMAC-SHA256 over
both sides' fresh nonces (so a recorded proof is worthless later) and what it claims (engine
id, geometry, session). Both then derive a session key from the secret and the nonces; every
session frame travels with a MAC under that key, so only the session that fetched a request
can report it done or abort it, and a consumer only trusts answers of the producer it
authenticated.

Without a secret the same exchange runs with an empty key: frames are still checked for
integrity, but anyone who can reach the side channel can open a session. That is the trust
model of an isolated serving network; set a secret anywhere else (docs/connectors.md, "Handshake
and trust"; docs/encoder-cache.md, "Trust").
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict

NONCE_BYTES = 16
MAC_BYTES = 16  # truncated HMAC-SHA256: 128 bits are plenty against forgery


def new_nonce() -> str:
    """A fresh random nonce, hex."""
    return secrets.token_hex(NONCE_BYTES)


def proof(secret: str, role: str, *parts: str | bytes) -> str:
    """Proof that `role` holds `secret`, bound to `parts` (roles: "consumer" and "producer" in
    a handshake, "session" for a session key, "bootstrap" for the bootstrap service's writes)."""
    mac = hmac.new(secret.encode(), role.encode(), hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        mac.update(len(data).to_bytes(4, "big"))  # unambiguous concatenation
        mac.update(data)
    return mac.hexdigest()


def proof_matches(expected: str, received: str) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected.encode(), received.encode())


def session_key(secret: str, client_nonce: str, server_nonce: str, session: str) -> bytes:
    """The key that signs one session's frames."""
    return bytes.fromhex(proof(secret, "session", client_nonce, server_nonce, session))


def sign(key: bytes, frame: bytes) -> bytes:
    """The MAC frame that travels after `frame`."""
    return hmac.new(key, frame, hashlib.sha256).digest()[:MAC_BYTES]


def verify(key: bytes, frame: bytes, mac: bytes) -> bool:
    """Whether `mac` signs `frame` under `key`."""
    return hmac.compare_digest(sign(key, frame), mac)


class Challenges:
    """The nonces a server handed out in challenges, each redeemable once by the peer it was
    given to. Bounded by count, the oldest going first, not by time: how long a handshake may
    take is the client's to decide (its `handshake_timeout_s`), and a client whose process a
    loaded host left unscheduled for tens of seconds between its hello and its proof must not
    find its challenge gone (the real-engine suite saw "no matching Hello" so, with 10 s).

    Args:
        ttl_s: how long a handshake may take after its hello; None (the default): as long as
            the client waits.
        max_pending: the most challenges outstanding at once.
    """

    def __init__(self, ttl_s: float | None = None, max_pending: int = 1024) -> None:
        # (peer identity, client nonce) -> (server nonce, the name the hello gave, expiry)
        self._pending: OrderedDict[tuple[bytes, str], tuple[str, str, float]] = OrderedDict()
        self._ttl_s, self._max_pending = ttl_s, max_pending

    def issue(self, identity: bytes, client_nonce: str, name: str) -> str:
        """A fresh server nonce for the peer `identity` whose hello sent `client_nonce` and
        `name`."""
        server_nonce = new_nonce()
        expires = math.inf if self._ttl_s is None else time.monotonic() + self._ttl_s
        self._pending[(identity, client_nonce)] = (server_nonce, name, expires)
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
        return server_nonce

    def redeem(self, identity: bytes, client_nonce: str, server_nonce: str) -> str | None:
        """The name the hello gave, if the pair of nonces was issued to `identity` and is still
        valid; else None. A challenge is redeemed once (a replayed handshake finds none)."""
        pending = self._pending.pop((identity, client_nonce), None)
        if pending is None or pending[0] != server_nonce or pending[2] < time.monotonic():
            return None
        return pending[1]

    def expire(self) -> None:
        """Forget challenges whose time ran out."""
        now = time.monotonic()
        for key in [k for k, (_, _, expires) in self._pending.items() if expires < now]:
            del self._pending[key]
