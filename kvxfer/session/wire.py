"""The session layer's wire: the protocol version, its handshake messages, and the frame shapes.

Every side channel kvxfer speaks (the KV connector's, the encoder cache's) opens a session the
same way, with one message per frame, encoded as msgpack from typed msgspec structs (no pickle):

    client -> server  Hello(service, name, nonce)
    server -> client  Challenge(nonce)
    client -> server  Handshake(nonces, claim, proof)     the client's claim, proven
    server -> client  Welcome(session, terms, proof)      the server's terms, proven

`claim` and `terms` are the application's own bytes (the KV consumer's engine id and geometry;
the producer's geometry, endpoint and regions), bound into the proofs, so the session layer
never decodes them. After the welcome every frame of the session travels as three frames,
`[session id, payload, MAC]`, the MAC under the session key. `Refused` (server -> client, one
frame, unsigned) says why the last frame was refused.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The one protocol version of every kvxfer side channel (the applications' messages carry it
# too). 2: pull transfers, authenticated sessions. 3: `KVCacheSpec` carries pipeline-parallel
# fields (pp_size, pp_rank, layer_start, total_layers) and `num_layers` counts a stage's layers.
# A version-2 peer would drop the new fields when it decodes a spec, so its check of the
# handshake proof (an HMAC over the encoded spec) would fail as if the secret were wrong: the
# version tells it apart clearly instead. 4: `ChunkReady` carries the block ids of its chunk's
# tokens only (none when the chunk is read from staging), not the request's whole table: a
# version-3 consumer would refuse every chunk as "too few block ids". 5: `KVCacheSpec` carries
# `block_stride` (recurrent state groups), which a version-4 peer would drop (as in 3). 6: one
# session layer (kvxfer.session) for the KV connector and the encoder cache: shared handshake
# messages naming their `service`, the applications' claim and terms as proven bytes, session
# frames as `[session, payload, MAC]` (the applications' messages no longer carry the session).
# 7: `TransferRequest` names its chunk's layers (`layer_start`, `layer_end`): a streamed fetch
# asks for fewer layers than its pair moves, which a version-6 producer would pack in full.
# 8: a chunk read from the producer's staging is held for `ChunkReady.held_seconds` from its
# ask and confirmed by that hold (`StagingRead`, no answer, gives the range back early); only a
# chunk read from the cache is confirmed by `ChunkRead` -> `ChunkValid`. A version-7 consumer
# would wait for a confirmation that never comes. `RequestsDone` reports a batch of requests
# (it replaces `RequestDone`). 9: `KVCacheSpec` carries `fp8_rounding` (vLLM CPU attention's
# fp8 write truncates), which a version-8 peer would drop (as in 3). `ChunkReady.timeline` came
# within 9: a record, not an order; a peer without it sends none and ignores it unread.
# 10: `fp8_rounding` "torch_cast" (SGLang's fp8 write), which a version-9 peer would refuse as
# an unknown rounding.
PROTOCOL_VERSION = 10
MAX_FRAME_BYTES = 8 << 20  # a chunk's block ids, even a 128k-token chunk's, under 1 MiB
SESSION_FRAMES = 3  # [session id, payload, MAC]


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class Versioned(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    """The base of every side-channel message: a tag and the protocol version."""

    version: int = PROTOCOL_VERSION


class Hello(Versioned, tag="hello", frozen=True):
    """Client -> server: I want a session of `service`; here is my nonce."""

    service: str  # "kv" or "ec": a proof for one is worthless for the other
    name: str  # the client's name, for logs (an engine id)
    nonce: str  # hex


class Challenge(Versioned, tag="challenge", frozen=True):
    """Server -> client: prove you hold the secret, over both nonces."""

    nonce: str  # hex


class Handshake(Versioned, tag="handshake", frozen=True):
    """Client -> server: my claim (the application's bytes), with the proof of the secret."""

    client_nonce: str
    server_nonce: str
    claim: bytes
    proof: str  # hex HMAC over the service, the nonces, the name and the claim


class Welcome(Versioned, tag="welcome", frozen=True):
    """Server -> client: the session, my terms (the application's bytes), and my own proof."""

    session: str
    terms: bytes
    proof: str  # hex HMAC over the service, the nonces, the session and the terms


class Refused(Versioned, tag="refused", frozen=True):
    """Server -> client, unsigned: the last frame was refused, and why."""

    reason: str
    session_lost: bool = False  # the named session is unknown: shake hands again


HandshakeMessage = Hello | Challenge | Handshake | Welcome | Refused

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(HandshakeMessage)


def encode(message: HandshakeMessage) -> bytes:
    """One handshake frame."""
    return _encoder.encode(message)


def decode(frame: bytes) -> HandshakeMessage:
    """Parse one handshake frame.

    Raises:
        ProtocolError: oversized, not msgpack, another protocol version, or not a handshake
            message.
    """
    return decode_with(_decoder, frame, "a kvxfer handshake message")


def decode_with(decoder: msgspec.msgpack.Decoder[Any], frame: bytes, what: str) -> Any:
    """Parse one frame with `decoder`, refusing what this protocol version cannot read.

    Raises:
        ProtocolError: oversized, not msgpack, another protocol version, or not `what`.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} limit")
    try:
        message = decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raw = _raw(frame)
        if isinstance(raw, dict) and raw.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            raise ProtocolError(version_problem(raw.get("version"))) from exc
        raise ProtocolError(f"not {what}: {exc}") from exc
    if message.version != PROTOCOL_VERSION:
        raise ProtocolError(version_problem(message.version))
    return message


def version_problem(version: object) -> str:
    """What to tell a peer that speaks protocol `version`."""
    return (
        f"protocol version {version!r} is not supported; this peer speaks version "
        f"{PROTOCOL_VERSION}"
    )


def _raw(frame: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
