"""Side-channel messages: typed msgspec structs with a protocol version, encoded as msgpack.

Nothing else is accepted: an unknown version, an unknown type, a malformed or oversized frame
raises `ProtocolError` with a message fit for the peer and the log. No pickle.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvxfer.spec import KVCacheSpec

# 2: pull transfers, authenticated sessions. 3: `KVCacheSpec` carries pipeline-parallel fields
# (pp_size, pp_rank, layer_start, total_layers) and `num_layers` counts a stage's layers. A
# version-2 peer would drop the new fields when it decodes a spec, so its check of the
# handshake proof (an HMAC over the encoded spec) would fail as if the secret were wrong: the
# version tells it apart clearly instead. 4: `ChunkReady` carries the block ids of its chunk's
# tokens only (none when the chunk is read from staging), not the request's whole table: a
# version-3 consumer would refuse every chunk as "too few block ids". 5: `KVCacheSpec` carries
# `block_stride` (recurrent state groups), which a version-4 peer would drop (as in 3).
PROTOCOL_VERSION = 5
MAX_FRAME_BYTES = 8 << 20  # a chunk's block ids, even a 128k-token chunk's, under 1 MiB


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class RegionInfo(msgspec.Struct, frozen=True):
    """A registered memory region as advertised to peers."""

    region_id: int
    address: int
    nbytes: int


class _Message(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    version: int = PROTOCOL_VERSION


# ---- KV connector: handshake ---------------------------------------------------------------
# Consumer and producer prove knowledge of the shared secret to each other without sending it
# (kvxfer.connector.auth); the producer then names a session whose key signs every later frame.


class Hello(_Message, tag="hello", frozen=True):
    """Consumer -> producer: I want a session; here is my nonce."""

    engine_id: str
    nonce: str  # hex


class Challenge(_Message, tag="challenge", frozen=True):
    """Producer -> consumer: prove you hold the secret, over both nonces."""

    nonce: str  # hex


class Handshake(_Message, tag="handshake", frozen=True):
    """Consumer -> producer: who I am and my geometry, with the proof of the secret."""

    engine_id: str
    spec: KVCacheSpec
    client_nonce: str
    server_nonce: str
    proof: str  # hex HMAC over the nonces, the engine id and the spec


class HandshakeReply(_Message, tag="handshake_reply", frozen=True):
    """Producer -> consumer: my geometry, where my cache lives, and the session."""

    engine_id: str
    spec: KVCacheSpec
    endpoint: str  # transport endpoint (Mooncake host:port)
    cache_regions: list[RegionInfo]  # one per layer, in layer order
    session: str
    staging_slot_bytes: int
    proof: str  # hex HMAC: the producer holds the secret too


# ---- KV connector: session messages (each frame followed by its MAC frame) ----------------


class TransferRequest(_Message, tag="transfer", frozen=True):
    """Consumer -> producer: make tokens `[token_start, token_end)` of a request readable."""

    session: str
    request_id: str
    chunk_id: int
    num_tokens: int
    token_start: int
    token_end: int
    strategy: str
    wait_seconds: float  # how long to wait for the request to be published


class ChunkReady(_Message, tag="chunk_ready", frozen=True):
    """Producer -> consumer: read the chunk now, from my cache blocks or my staging slot."""

    request_id: str
    chunk_id: int
    generation: int  # the publication these bytes belong to
    # My blocks holding the chunk's tokens, from block `token_start // block_size` on; empty
    # when `staging` is given (the chunk is read from there, never from my cache).
    src_block_ids: list[int]
    staging: RegionInfo | None  # the packed chunk, for strategies that pack


class ChunkRead(_Message, tag="chunk_read", frozen=True):
    """Consumer -> producer: I have read the chunk; was its source held all along?"""

    session: str
    request_id: str
    chunk_id: int
    generation: int
    staged: bool  # read from the producer's staging slot (else from its cache blocks)


class ChunkValid(_Message, tag="chunk_valid", frozen=True):
    """Producer -> consumer: the chunk's source was (ok) or was not held while it was read."""

    request_id: str
    chunk_id: int
    ok: bool
    reason: str = ""


class ChunkFailed(_Message, tag="chunk_failed", frozen=True):
    """Producer -> consumer: a chunk cannot be served."""

    request_id: str
    chunk_id: int
    reason: str


class RequestDone(_Message, tag="request_done", frozen=True):
    """Consumer -> producer: this consumer rank is finished with a request (ok or not)."""

    session: str
    request_id: str
    ok: bool


class Abort(_Message, tag="abort", frozen=True):
    """Consumer -> producer: the decode engine will never load this request; free it now."""

    session: str
    request_id: str


class Ping(_Message, tag="ping", frozen=True):
    """Consumer -> producer: I am alive; are you?"""

    session: str


class Pong(_Message, tag="pong", frozen=True):
    """Producer -> consumer: alive."""


class ErrorReply(_Message, tag="error", frozen=True):
    """Either way: the last frame was refused, and why."""

    reason: str
    session_lost: bool = False  # the named session is unknown: shake hands again


SESSION_MESSAGES = (TransferRequest, ChunkRead, RequestDone, Abort, Ping)


# ---- encoder cache ------------------------------------------------------------------------
# Pull, as for KV: a consumer asks a producer to pin an item in its pool, reads the bytes with
# its own Mooncake engine into its own memory, then reports the read and learns whether the item
# stayed in the pool throughout. The handshake proves the shared secret both ways without
# sending it (kvxfer.connector.auth); every later frame carries a MAC under the session key, and
# every answer echoes the `ref` of its ask.


class ECHello(_Message, tag="ec_hello", frozen=True):
    """Encoder-cache consumer -> producer: I want a session; here is my nonce."""

    consumer: str  # a name for logs
    nonce: str  # hex


class ECChallenge(_Message, tag="ec_challenge", frozen=True):
    """Producer -> consumer: prove you hold the secret, over both nonces."""

    nonce: str  # hex


class ECHandshake(_Message, tag="ec_handshake", frozen=True):
    """Consumer -> producer: the proof of the secret over both nonces and my name."""

    consumer: str
    client_nonce: str
    server_nonce: str
    proof: str  # hex HMAC


class ECWelcome(_Message, tag="ec_welcome", frozen=True):
    """Producer -> consumer: the session, my Mooncake endpoint, and my own proof (over the
    nonces, the session and the endpoint)."""

    session: str
    endpoint: str  # Mooncake host:port, where the consumer reads from
    proof: str


class ECQuery(_Message, tag="ec_query", frozen=True):
    """Consumer -> producer (session): do you hold this item, and how large is it?"""

    session: str
    ref: int
    mm_hash: str


class ECInfo(_Message, tag="ec_info", frozen=True):
    """Producer -> consumer: an item's dtype, shape and size, if held."""

    ref: int
    mm_hash: str
    found: bool
    dtype: str = ""
    shape: list[int] = []
    nbytes: int = 0


class ECPin(_Message, tag="ec_pin", frozen=True):
    """Consumer -> producer (session): keep the item in place while I read it."""

    session: str
    ref: int
    mm_hash: str


class ECPinned(_Message, tag="ec_pinned", frozen=True):
    """Producer -> consumer: the item is pinned under `lease` at `[address, address + nbytes)`
    of my registered pool (or why not); the lease ends after `lease_s` seconds at most."""

    ref: int
    mm_hash: str
    ok: bool
    reason: str = ""
    lease: str = ""
    address: int = 0
    nbytes: int = 0
    dtype: str = ""
    shape: list[int] = []
    lease_s: float = 0.0


class ECDone(_Message, tag="ec_done", frozen=True):
    """Consumer -> producer (session): my read under `lease` has settled; unpin the item. Did
    it stay in the pool throughout?"""

    session: str
    ref: int
    lease: str


class ECValid(_Message, tag="ec_valid", frozen=True):
    """Producer -> consumer: the leased item stayed in place while it was read (ok), or not."""

    ref: int
    lease: str
    ok: bool
    reason: str = ""


class ECRelease(_Message, tag="ec_release", frozen=True):
    """Consumer -> producer (session): I am done with the item (evict it first). No reply."""

    session: str
    mm_hash: str


EC_SESSION_MESSAGES = (ECQuery, ECPin, ECDone, ECRelease)


Message = (
    Hello
    | Challenge
    | Handshake
    | HandshakeReply
    | TransferRequest
    | ChunkReady
    | ChunkRead
    | ChunkValid
    | ChunkFailed
    | RequestDone
    | Abort
    | Ping
    | Pong
    | ErrorReply
    | ECHello
    | ECChallenge
    | ECHandshake
    | ECWelcome
    | ECQuery
    | ECInfo
    | ECPin
    | ECPinned
    | ECDone
    | ECValid
    | ECRelease
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """One frame."""
    return _encoder.encode(message)


def decode(frame: bytes) -> Message:
    """Parse one frame.

    Raises:
        ProtocolError: oversized, not msgpack, another protocol version, or not a known message.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} limit")
    try:
        message = _decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raw = _raw(frame)
        if isinstance(raw, dict) and raw.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            raise ProtocolError(_version_problem(raw.get("version"))) from exc
        raise ProtocolError(f"not a kvxfer message: {exc}") from exc
    if message.version != PROTOCOL_VERSION:
        raise ProtocolError(_version_problem(message.version))
    return message


def _version_problem(version: object) -> str:
    return (
        f"protocol version {version!r} is not supported; this peer speaks version "
        f"{PROTOCOL_VERSION}"
    )


def _raw(frame: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
