"""What kvxfer's SGLang backend does not move is refused at start, naming the model kind and
the way out, before anything is allocated or registered."""

from __future__ import annotations

import pytest
from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from kvxfer.integrations.sglang.manager.model import load_settings, model_of


def _kv_args(**fields: object) -> KVArgs:
    args = KVArgs()
    args.state_types = []
    args.num_draft_entries = 0
    for name, value in fields.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    "kinds",
    [
        [StateType.SWA, StateType.MAMBA],
        [StateType.SWA, StateType.SWA],
        [StateType.MAMBA, StateType.MAMBA],
    ],
    ids=["window-and-mamba", "target-and-draft-windows", "target-and-draft-mamba"],
)
def test_hybrid_state_but_one_window_pool_or_mamba_state_is_refused_naming_its_kinds(kinds):
    named = ", ".join(kind.value for kind in kinds)
    with pytest.raises(ValueError, match=f"hybrid state \\({named}\\).*another transfer"):
        model_of(None, _kv_args(state_types=kinds), is_mla=False)


def test_an_fp8_sliding_window_model_is_refused_naming_the_fix():
    """(An fp8 Mamba model moves: its pool's layer ids name its layers' scales.)"""
    args = _kv_args(state_types=[StateType.SWA], kv_cache_dtype_str="fp8_e4m3")
    with pytest.raises(ValueError, match=r"fp8 hybrid model \(swa\).*window layers.*auto"):
        model_of(None, args, is_mla=False)


def test_settings_come_from_kvxfer_config_and_bad_json_names_it(monkeypatch):
    monkeypatch.setenv("KVXFER_CONFIG", '{"secret": "s", "request_timeout_s": 5}')
    settings = load_settings()
    assert (settings.secret, settings.request_timeout_s) == ("s", 5)
    monkeypatch.setenv("KVXFER_CONFIG", "{secret}")
    with pytest.raises(ValueError, match="KVXFER_CONFIG: not JSON"):
        load_settings()


@pytest.mark.parametrize(
    ("kinds", "pp_size", "drafts", "kv", "reason"),
    [
        (["mamba"], 1, False, False, "keeps no attention layers, only mamba state"),
        (["swa"], 2, False, True, r"hybrid model \(swa state\) with prefill pipeline"),
        (["mamba"], 1, True, True, "speculative decoding with a Mamba model"),
    ],
    ids=["state-without-kv", "window-with-pp", "mamba-with-draft"],
)
def test_hybrid_ranks_the_backend_does_not_move_are_refused_before_any_pool(
    kinds, pp_size, drafts, kv, reason
):
    from kvxfer.integrations.sglang.manager import KvxferKVManager

    manager = KvxferKVManager.__new__(KvxferKVManager)  # the checks read only its PP size
    manager.pp_size = pp_size
    with pytest.raises(ValueError, match=reason):
        manager._check_hybrid(kinds, drafts=drafts, kv=kv)
    manager.pp_size = 1
    manager._check_hybrid(["mamba"], drafts=False, kv=True)  # a Mamba model beside its KV
    manager.pp_size = 2
    manager._check_hybrid(["mamba"], drafts=False, kv=True)  # on pipeline stages too
