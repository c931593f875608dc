"""SGLang's status message (a prefill rank failed a request: to its decode ranks, with the
reason) as kvxfer's manager sends and reads it, through SGLang's own `CommonKVManager`
encoding and parsing: signed with the secret, and one whose proof does not hold (SGLang's
unsigned form, another secret's, an altered reason) is dropped, so a forged status cannot fail
a decode's request."""

from __future__ import annotations

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll

from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.sglang.manager import KvxferKVManager


def _manager(secret: str | None, tp_rank: int = 1) -> KvxferKVManager:
    """The fields SGLang's status encoding reads, on a manager that starts nothing."""
    manager = KvxferKVManager.__new__(KvxferKVManager)
    manager.settings = ConnectorSettings(secret=secret)
    manager.attn_tp_rank, manager.attn_cp_rank, manager.attn_cp_size = tp_rank, 0, 1
    manager.pp_rank, manager.pp_size = 0, 1
    return manager


def _failed(manager: KvxferKVManager) -> list[bytes]:
    return manager._encode_kv_status_message(
        bootstrap_room=77, status=KVPoll.Failed, failure_reason="prefill rank 1 died"
    )


@pytest.mark.parametrize("secret", ["s3cret", None])
def test_a_status_reads_back_between_managers_of_one_secret(secret):
    got = _manager(secret).parse_kv_status_message(_failed(_manager(secret)))
    assert got == (77, int(KVPoll.Failed), 1, "prefill rank 1 died")


def test_a_status_without_a_proof_that_holds_is_dropped(caplog):
    decode = _manager("s3cret")
    signed = _failed(_manager("s3cret"))
    forged = [
        signed[:-1],  # SGLang's own, unsigned
        _failed(_manager("guess")),
        [*signed[:4], b"another reason", signed[-1]],
    ]
    for frames in forged:
        assert decode.parse_kv_status_message(frames) is None
    assert caplog.text.count("dropped a status message") == len(forged)
    assert decode.parse_kv_status_message([b"KVXFER_READY", b"x"]) is None  # not a status
