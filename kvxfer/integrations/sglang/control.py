"""kvxfer's SGLang control messages: typed, and signed with the connector's secret.

They ride the ZeroMQ PUSH/PULL sockets SGLang's `CommonKVManager` binds on every rank
(`rank_port`), as two frames: the message's tag, which SGLang's dispatch reads first as it
reads its own ABORT and status messages, and the message as msgpack. Each message but a refusal
carries a proof (`kvxfer.session.auth.proof`: HMAC-SHA256 under the connector's `secret`, the
empty key without one, as on the KV session) over its tag, its sender's role and every field:

- `Register` (decode rank -> each rank of a prefill DP group): the group, where to answer, and
  a fresh nonce;
- `Registered` (prefill rank -> the decode rank): its rank and its side channels (one a cache
  group), bound to the registration's nonce: an answer the decode did not ask for, or a
  replayed one, is dropped;
- `Refused` (prefill rank -> the decode rank), unsigned: a registration whose proof failed
  learns that it was refused and why, nothing else;
- `Reading` (decode rank -> each prefill rank, SGLang's metadata): the request, where to
  answer, how many decode ranks read it, the decode's prefix;
- `Abandoned` (decode rank -> each prefill rank, SGLang's ABORT notice): the decode gave the
  request up (its abort, a failure, its waiting timeout);
- `Published` (prefill rank -> the decode ranks): the request's token count and its aux row
  (the first token, its logprobs, the draft's hidden states).

SGLang's own status message (a prefill rank failed a request: to its decode ranks, with the
reason) travels under the tag `STATUS_TAG` with a proof frame appended over all its frames
(`signed_status`), and a decode rank drops one whose proof does not hold (`verified_status`).
A prefill rank ends a request on an `Abandoned` whose proof holds wherever the request stands.
One whose proof does not hold, or SGLang's own unsigned ABORT, ends only a request the rank
has and that no decode rank has proved it reads (no `Reading` held), and is never kept for a
request to come: a request that a decode rank with the secret reads cannot be failed by an
engine without it, and a decode engine refused for its secret still frees the prefill's
request at once rather than at SGLang's bootstrap timeout. Nothing of the request was
published then, so the unproven abort reads or writes no KV. What an engine without the secret
can still do is end a request in the moment between the prefill's taking it and its decode
ranks' `Reading` (it must know the room, a random 63-bit number).

A prefill rank answers only a `Register` whose proof holds, and sends `Published` only to the
decode ranks whose `Reading` held; a decode rank believes only a `Registered` and a `Published`
whose proofs hold. So a decode engine without the secret learns no side channel and no aux row,
and (its KV handshake refused as ever) moves nothing. A replayed `Reading` or `Published` changes
nothing that its first copy did not (the reader is noted once, the aux row kept once).
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvxfer.session import auth

ROLE_DECODE, ROLE_PREFILL = "sglang-decode", "sglang-prefill"


class Control(msgspec.Struct, tag_field="kind", frozen=True, kw_only=True):
    """The fields every control message has: its proof ("" until signed)."""

    proof: str = ""


class Register(Control, tag="register", frozen=True):
    """A decode rank asks a prefill rank for its side channels."""

    group: str  # the prefill DP group, as the decode names it (bootstrap address and DP rank)
    ip: str
    port: int
    nonce: str


class Registered(Control, tag="registered", frozen=True):
    """A prefill rank's side channels, one a cache group, for the registration `nonce`."""

    group: str
    rank: int
    addresses: list[str]
    nonce: str


class Refused(Control, tag="refused", frozen=True):
    """A registration the prefill rank did not accept, and why (unsigned)."""

    group: str
    reason: str


class Reading(Control, tag="reading", frozen=True):
    """A decode rank will read request `room` (`readers` decode ranks will)."""

    room: int
    ip: str
    port: int
    readers: int
    prefix: int


class Abandoned(Control, tag="abandoned", frozen=True):
    """A decode rank gives request `room` up (SGLang's ABORT notice: its abort, a failure, its
    waiting timeout): the prefill stops serving it and fails it."""

    room: int


class Published(Control, tag="published", frozen=True):
    """Request `room` is published: `tokens` tokens, and the aux row (may be empty)."""

    room: int
    tokens: int
    aux: bytes


Message = Register | Registered | Refused | Reading | Abandoned | Published

TAGS: dict[type[Control], bytes] = {
    Register: b"KVXFER_REG",
    Registered: b"KVXFER_HELLO",
    Refused: b"KVXFER_REFUSED",
    Reading: b"KVXFER_META",
    Abandoned: b"KVXFER_ABORT",
    Published: b"KVXFER_READY",
}
_TYPES = {tag: kind for kind, tag in TAGS.items()}
_SENDERS: dict[type[Control], str] = {
    Register: ROLE_DECODE,
    Registered: ROLE_PREFILL,
    Reading: ROLE_DECODE,
    Abandoned: ROLE_DECODE,
    Published: ROLE_PREFILL,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


_M = TypeVar("_M", bound=Control)


class ControlError(ValueError):
    """A control message that is malformed, or whose proof does not hold."""


def is_control(frames: list[bytes]) -> bool:
    """Whether `frames` are one of kvxfer's control messages (else SGLang's own)."""
    return bool(frames) and frames[0] in _TYPES


def _proof(message: Control, secret: str | None) -> str:
    unsigned = _ENCODER.encode(msgspec.structs.replace(message, proof=""))
    return auth.proof(secret or "", _SENDERS[type(message)], TAGS[type(message)], unsigned)


def frames_of(message: Message, secret: str | None) -> list[bytes]:
    """The frames that carry `message`, signed with `secret` (a refusal travels unsigned)."""
    if not isinstance(message, Refused):
        message = msgspec.structs.replace(message, proof=_proof(message, secret))
    return [TAGS[type(message)], _ENCODER.encode(message)]


def message_of(frames: list[bytes], secret: str | None) -> Message:
    """The control message `frames` carry, its proof checked against `secret` (a refusal has
    none).

    Raises:
        ControlError: not two frames, an unknown tag, a payload that is not the tag's message,
            or a proof that does not hold (the engines' secrets differ, or it was altered).
    """
    if len(frames) != 2 or frames[0] not in _TYPES:
        raise ControlError(f"not a kvxfer control message: {len(frames)} frames")
    try:
        message = _DECODER.decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ControlError(f"{frames[0].decode()}: malformed ({exc})") from None
    if type(message) is not _TYPES[frames[0]]:
        raise ControlError(f"{frames[0].decode()}: carries a {type(message).__name__}")
    if not isinstance(message, Refused) and not auth.proof_matches(
        _proof(message, secret), message.proof
    ):
        raise ControlError(
            f"{frames[0].decode()}: its proof does not hold (the engines' kvxfer secrets differ, "
            "or the message was altered): set the same secret in both engines' KVXFER_CONFIG"
        )
    return message


STATUS_TAG = b"KVXFER_STATUS"  # SGLang's status message, as kvxfer's manager tags it


def _status_proof(parts: list[bytes], secret: str | None) -> str:
    return auth.proof(secret or "", ROLE_PREFILL, STATUS_TAG, *parts)


def signed_status(parts: list[bytes], secret: str | None) -> list[bytes]:
    """SGLang's status message frames (`parts`, its tag first), a proof over them appended."""
    return [*parts, _status_proof(parts, secret).encode()]


def verified_status(frames: list[bytes], secret: str | None) -> list[bytes]:
    """A signed status message's frames without their proof.

    Raises:
        ControlError: no proof, or one that does not hold (the engines' secrets differ, the
            message was altered or forged).
    """
    *parts, proof = frames or [b""]
    if not parts or not auth.proof_matches(
        _status_proof(parts, secret), proof.decode("ascii", errors="replace")
    ):
        raise ControlError(
            "a status message whose proof does not hold (the engines' kvxfer secrets differ, "
            "or it was altered): set the same secret in both engines' KVXFER_CONFIG"
        )
    return parts


def _unproven(frames: list[bytes], kind: type[_M]) -> _M | None:
    """The `kind` message `frames` carry, its proof not checked; None where they are no
    readable one (what a refusal answers, or an unproven notice names)."""
    if len(frames) != 2 or frames[0] != TAGS[kind]:
        return None
    try:
        return msgspec.msgpack.decode(frames[1], type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def unproven_abandon(frames: list[bytes]) -> int | None:
    """The room an `Abandoned` whose proof did not hold names; None where `frames` are no
    readable `Abandoned`. The prefill honours it only for a request no decode rank proved it
    reads (the module docstring)."""
    abandoned = _unproven(frames, Abandoned)
    return None if abandoned is None else abandoned.room


def refused_registration(frames: list[bytes], reason: str) -> tuple[str, list[bytes]] | None:
    """Where to answer a registration whose proof failed, and the `Refused` to send there;
    None where `frames` are no readable `Register` (nothing to answer)."""
    register = _unproven(frames, Register)
    if register is None:
        return None
    refused = Refused(group=register.group, reason=reason)
    return f"tcp://{register.ip}:{register.port}", frames_of(refused, None)
