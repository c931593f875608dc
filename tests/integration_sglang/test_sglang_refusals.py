"""What kvxfer's SGLang backend does not move is refused at start, naming the model kind and
the way out, before anything is allocated or registered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from kvxfer.integrations.sglang.loaded import forget_model_scales, record_model_scales
from kvxfer.integrations.sglang.manager.model import (
    latent_scales,
    load_settings,
    model_of,
    window_split,
)


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


def _window_kv_args(full: int, window: int, pp_rank: int = 0, draft: int = 0) -> KVArgs:
    """A sliding-window pool's `KVArgs` on pipeline stage `pp_rank`: `full` and `window`
    layers (K and V buffers each), and `draft` layers of a draft's pool after the full pool's;
    `prefill_start_layer` 0, as SGLang fills it for a `SWAKVPool` on every stage."""
    return _kv_args(
        state_types=[StateType.SWA], kv_data_ptrs=[0] * 2 * (full + draft),
        num_draft_entries=2 * draft, state_data_ptrs=[[0] * 2 * window], pp_rank=pp_rank,
        prefill_start_layer=0,
    )  # fmt: skip


def test_a_window_pool_is_placed_by_the_models_split_or_refused_naming_it():
    """The layers of a sliding-window pool's two pools come from SGLang's split of the model's
    layers, cut to the stage as SGLang's `get_pp_indices` cuts the model; a model without one,
    or pools the stage's split does not fill, are refused before anything is read."""
    config = SimpleNamespace(
        num_hidden_layers=8, full_attention_layer_ids=[3, 7],
        swa_attention_layer_ids=[0, 1, 2, 4, 5, 6],
    )  # fmt: skip
    split = window_split(config, _window_kv_args(1, 3, pp_rank=1), mla=False, pp_size=2)
    assert (split.stage_full, split.stage_window) == ([7], [4, 5, 6])
    whole = window_split(config, _window_kv_args(2, 6, draft=1), mla=False, pp_size=1)
    assert whole.stage_window == config.swa_attention_layer_ids  # the draft's layers not counted
    none = SimpleNamespace(
        num_hidden_layers=4, full_attention_layer_ids=None, swa_attention_layer_ids=None
    )
    with pytest.raises(ValueError, match=r"splits the model's layers as full \[\] and window"):
        window_split(none, _window_kv_args(2, 2), mla=False, pp_size=1)
    with pytest.raises(ValueError, match="2 full and 2 window layers on pipeline stage 0 of 2"):
        window_split(config, _window_kv_args(2, 2), mla=False, pp_size=2)
    only_full = SimpleNamespace(
        num_hidden_layers=4, full_attention_layer_ids=[0, 1], swa_attention_layer_ids=[2, 3]
    )
    with pytest.raises(ValueError, match="keeps no window layer"):
        window_split(only_full, _window_kv_args(2, 0), mla=False, pp_size=2)


def test_settings_come_from_kvxfer_config_and_bad_json_names_it(monkeypatch):
    monkeypatch.setenv("KVXFER_CONFIG", '{"secret": "s", "request_timeout_s": 5}')
    settings = load_settings()
    assert (settings.secret, settings.request_timeout_s) == ("s", 5)
    monkeypatch.setenv("KVXFER_CONFIG", "{secret}")
    with pytest.raises(ValueError, match="KVXFER_CONFIG: not JSON"):
        load_settings()


def test_a_rank_with_state_and_no_kv_layers_is_refused_before_any_pool():
    from kvxfer.integrations.sglang.manager import KvxferKVManager

    with pytest.raises(ValueError, match="keeps no attention layers, only mamba state"):
        KvxferKVManager._check_hybrid(["mamba"], kv=False)
    KvxferKVManager._check_hybrid(["mamba"], kv=True)  # a Mamba model beside its KV
    KvxferKVManager._check_hybrid(["swa"], kv=True)  # a window pool beside its full layers


def test_an_fp8_mla_latent_moves_unscaled_and_other_kv_scales_are_refused():
    """SGLang's MLA backends agree on a latent only where its scale is 1.0 (Triton divides by
    k_scale, the others cast): a model whose MLA layers have other scales is refused."""
    import torch

    def model(scales: list[float]) -> torch.nn.Module:
        layers = torch.nn.ModuleList()
        for layer, scale in enumerate(scales):
            attention = torch.nn.Module()
            attention.layer_id, attention.k_scale, attention.v_scale = layer, scale, None
            layers.append(attention)
        return layers

    try:
        record_model_scales(model([1.0, 1.0, 1.0]))
        assert latent_scales([1, 2]) == ((1.0, 1.0), ())
        record_model_scales(model([1.0, 2.0, 1.0]))
        with pytest.raises(ValueError, match=r"other than 1\.0 \(k_scale by layer: \{1: 2\.0\}\)"):
            latent_scales([0, 1])
    finally:
        forget_model_scales()
