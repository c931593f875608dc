"""kvxfer's SGLang control messages (`kvxfer.integrations.sglang.control`): each round-trips
under the secret it was signed with, and a wrong secret, an altered field, a swapped tag or a
malformed payload is refused, naming why. SGLang itself is not needed: the messages are
kvxfer's; `make test-sglang` runs them between SGLang's own managers."""

from __future__ import annotations

import msgspec
import pytest

from kvxfer.integrations.sglang import control

MESSAGES = [
    control.Register(group="10.0.0.1:8998/dp0", ip="10.0.0.2", port=17001, nonce="ab" * 16),
    control.Registered(
        group="10.0.0.1:8998/dp0", rank=3, addresses=["a:1", "a:2"], nonce="ab" * 16
    ),
    control.Reading(room=77, ip="10.0.0.2", port=17001, readers=4, prefix=32),
    control.Abandoned(room=77),
    control.Published(room=77, tokens=1000, aux=b"\x00\x01first token"),
]


@pytest.mark.parametrize("secret", ["s3cret", None])
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_signed_message_reads_back_under_its_secret(message, secret):
    frames = control.frames_of(message, secret)
    assert control.is_control(frames) and frames[0] == control.TAGS[type(message)]
    got = control.message_of(frames, secret)
    assert msgspec.structs.replace(got, proof="") == message and got.proof


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_under_another_secret_is_refused_naming_the_secret(message):
    with pytest.raises(control.ControlError, match="secrets differ"):
        control.message_of(control.frames_of(message, "guess"), "s3cret")
    with pytest.raises(control.ControlError, match="secrets differ"):  # signed without one
        control.message_of(control.frames_of(message, None), "s3cret")


def test_an_altered_field_breaks_the_proof():
    frames = control.frames_of(MESSAGES[4], "s3cret")
    forged = msgspec.structs.replace(
        control.message_of(frames, "s3cret"), aux=b"\x00\x02other token"
    )
    with pytest.raises(control.ControlError, match="proof does not hold"):
        control.message_of([frames[0], msgspec.msgpack.encode(forged)], "s3cret")


def test_a_payload_under_another_tag_or_malformed_is_refused():
    registered = control.frames_of(MESSAGES[1], "s3cret")
    with pytest.raises(control.ControlError, match="carries a Registered"):
        control.message_of([control.TAGS[control.Register], registered[1]], "s3cret")
    with pytest.raises(control.ControlError, match="malformed"):
        control.message_of([control.TAGS[control.Reading], b"\xc1"], "s3cret")
    with pytest.raises(control.ControlError, match="not a kvxfer control message"):
        control.message_of([b"ABORT", b""], "s3cret")
    assert not control.is_control([b"ABORT", b""])


def test_a_refused_registration_is_answered_where_it_asked_and_unsigned():
    frames = control.frames_of(MESSAGES[0], "guess")
    where, answer = control.refused_registration(frames, "its proof does not hold")
    assert where == "tcp://10.0.0.2:17001"
    refused = control.message_of(answer, "anything")  # a refusal carries no proof to check
    assert refused == control.Refused(group="10.0.0.1:8998/dp0", reason="its proof does not hold")
    assert (
        control.refused_registration(control.frames_of(MESSAGES[2], "guess"), "x") is None
    )  # no Register


def test_an_unproven_abandon_names_its_room_and_nothing_else_does():
    """The prefill honours an `Abandoned` whose proof fails only for a request no decode rank
    proved it reads: it needs the room of one, and of nothing else."""
    assert control.unproven_abandon(control.frames_of(control.Abandoned(room=9), "guess")) == 9
    assert control.unproven_abandon(control.frames_of(MESSAGES[2], "guess")) is None  # Reading
    assert control.unproven_abandon([control.TAGS[control.Abandoned], b"\xc1"]) is None
    assert control.unproven_abandon([b"ABORT", b"9"]) is None


STATUS = [control.STATUS_TAG, b"77", b"4", b"3", b"the prefill failed"]


@pytest.mark.parametrize("secret", ["s3cret", None])
def test_a_signed_status_reads_back_under_its_secret_only(secret):
    """SGLang's status message (a prefill's failure of a request) carries a proof frame."""
    frames = control.signed_status(STATUS, secret)
    assert frames[:-1] == STATUS and control.verified_status(frames, secret) == STATUS
    with pytest.raises(control.ControlError, match="secrets differ"):
        control.verified_status(frames, "guess")


@pytest.mark.parametrize(
    "frames",
    [
        STATUS,  # unsigned, as SGLang's own backends send it
        [*STATUS[:4], b"another reason", control.signed_status(STATUS, "s3cret")[-1]],
        [control.signed_status(STATUS, "s3cret")[-1]],
        [],
    ],
    ids=["unsigned", "altered", "proof-alone", "empty"],
)
def test_an_unsigned_altered_or_empty_status_is_refused(frames):
    with pytest.raises(control.ControlError, match="proof does not hold"):
        control.verified_status(frames, "s3cret")
