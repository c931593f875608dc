"""Side-channel messages: typed msgspec structs with a protocol version, encoded as msgpack.

The handshake that opens a session, and the framing and MACs of session frames, are the
session layer's (`kvxfer.session`); here are what the KV connector and the encoder cache say
inside it: the claims and terms their handshakes carry, and their session messages. Nothing
else is accepted: an unknown version, an unknown type, a malformed or oversized frame raises
`ProtocolError` with a message fit for the peer and the log. No pickle.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvxfer.session.wire import MAX_FRAME_BYTES, PROTOCOL_VERSION, ProtocolError, decode_with
from kvxfer.session.wire import Versioned as _Message
from kvxfer.spec import KVCacheSpec

__all__ = ["MAX_FRAME_BYTES", "PROTOCOL_VERSION", "ProtocolError"]  # re-exported

KV_SERVICE = "kv"  # the session layer's name of the KV connector's side channel
EC_SERVICE = "ec"  # and of the encoder cache's
T = TypeVar("T")


class RegionInfo(msgspec.Struct, frozen=True):
    """A registered memory region as advertised to peers."""

    region_id: int
    address: int
    nbytes: int


# ---- KV connector: handshake ---------------------------------------------------------------
# Consumer and producer prove knowledge of the shared secret to each other without sending it
# (kvxfer.session); these travel inside the handshake, bound into the proofs.


class KVClaim(msgspec.Struct, frozen=True):
    """Consumer -> producer, in the handshake: who I am and my geometry."""

    engine_id: str
    spec: KVCacheSpec


class KVTerms(msgspec.Struct, frozen=True):
    """Producer -> consumer, in the welcome: my geometry, and where my cache lives."""

    engine_id: str
    spec: KVCacheSpec
    endpoint: str  # transport endpoint, opaque but to a transport of `transport`'s kind
    cache_regions: list[RegionInfo]  # one per layer, in layer order
    staging_slot_bytes: int
    transport: str = "mooncake"  # its transport's kind (`kvxfer.transport.factory.KINDS`)


# ---- KV connector: session messages (in the session layer's signed frames) ----------------


class TransferRequest(_Message, tag="transfer", frozen=True):
    """Consumer -> producer: make tokens `[token_start, token_end)` of global layers
    `[layer_start, layer_end)` of a request readable (once computed: `KVProducer.mark_ready`)."""

    request_id: str
    chunk_id: int
    num_tokens: int
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
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
    # With `staging`: the range stays the chunk's (untouched) for this long after its ask
    # arrived here. The consumer times it from before it sent the ask, so its clock ends the
    # hold no later than mine (docs/connectors.md, "What a request waits for").
    held_seconds: float = 0.0
    # The request's timeline on my side so far (`kvxfer.connector.timeline`: the prefill's
    # events, wall-clock seconds), for the decode engine's per-request record.
    timeline: dict[str, float] = msgspec.field(default_factory=dict)


class ChunkRead(_Message, tag="chunk_read", frozen=True):
    """Consumer -> producer: I have read the chunk from your cache blocks; was the request
    held all along?"""

    request_id: str
    chunk_id: int
    generation: int


class StagingRead(_Message, tag="staging_read", frozen=True):
    """Consumer -> producer: I have read the chunk from your staging within its hold; the range
    is yours again. No answer."""

    request_id: str
    chunk_id: int


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


class RequestsDone(_Message, tag="requests_done", frozen=True):
    """Consumer -> producer: this consumer rank is finished with these requests (ok or not).
    Sent in batches, a few milliseconds after the fetches ended (never after a later ask for
    one of them): the producer frees their blocks once every decode rank reported."""

    request_ids: list[str]


class Abort(_Message, tag="abort", frozen=True):
    """Consumer -> producer: the decode engine will never load this request; free it now."""

    request_id: str


class Ping(_Message, tag="ping", frozen=True):
    """Consumer -> producer: I am alive; are you?"""


class Pong(_Message, tag="pong", frozen=True):
    """Producer -> consumer: alive."""


# ---- encoder cache ------------------------------------------------------------------------
# Pull, as for KV: a consumer asks a producer to pin an item in its pool, reads the bytes with
# its own Mooncake engine into its own memory, then reports the read and learns whether the item
# stayed in the pool throughout. The handshake proves the shared secret both ways without
# sending it (kvxfer.session.auth); every later frame carries a MAC under the session key, and
# every answer echoes the `ref` of its ask.


class ECTerms(msgspec.Struct, frozen=True):
    """Encoder-cache producer -> consumer, in the welcome: where the consumer reads from."""

    endpoint: str  # transport endpoint, opaque but to a transport of `transport`'s kind
    transport: str = "mooncake"  # its transport's kind (`kvxfer.transport.factory.KINDS`)


class ECQuery(_Message, tag="ec_query", frozen=True):
    """Consumer -> producer (session): do you hold this item, and how large is it?"""

    ref: int
    mm_hash: str


class ECInfo(_Message, tag="ec_info", frozen=True):
    """Producer -> consumer: an item's dtype, shape and size, if held."""

    ref: int
    mm_hash: str
    found: bool
    dtype: str = ""
    shape: list[int] = msgspec.field(default_factory=list)
    nbytes: int = 0


class ECPin(_Message, tag="ec_pin", frozen=True):
    """Consumer -> producer (session): keep the item in place while I read it."""

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
    shape: list[int] = msgspec.field(default_factory=list)
    lease_s: float = 0.0


class ECDone(_Message, tag="ec_done", frozen=True):
    """Consumer -> producer (session): my read under `lease` has settled; unpin the item. Did
    it stay in the pool throughout?"""

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

    mm_hash: str


Message = (
    TransferRequest
    | ChunkReady
    | ChunkRead
    | StagingRead
    | ChunkValid
    | ChunkFailed
    | RequestsDone
    | Abort
    | Ping
    | Pong
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


def encode(message: Message | KVClaim | KVTerms | ECTerms) -> bytes:
    """One frame (or a handshake's claim or terms)."""
    return _encoder.encode(message)


def decode(frame: bytes) -> Message:
    """Parse one session message.

    Raises:
        ProtocolError: oversized, not msgpack, another protocol version, or not a known message.
    """
    message: Message = decode_with(_decoder, frame, "a kvxfer message")
    return message


def decode_terms(data: bytes, kind: type[T]) -> T:
    """Parse a handshake's claim or terms (`KVClaim`, `KVTerms`, `ECTerms`).

    Raises:
        ProtocolError: not such a struct.
    """
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{len(data)} bytes of {kind.__name__} exceed the frame limit")
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a valid {kind.__name__}: {exc}") from exc
