"""vLLM's KV cache configuration as kvxfer's groups (`kvxfer.integrations.vllm.cache_groups`),
function by function, with no engine: vLLM's own spec classes (`FullAttentionSpec`,
`SlidingWindowSpec`, `MambaSpec`, `KVCacheConfig`) over layer tensors made here. Runs in the
vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvxfer.integrations.kv_tensors import EngineGeometry
from kvxfer.integrations.vllm.cache_groups import (
    TableSource,
    attention_geometry,
    cache_groups,
    group_tables,
    layer_indices,
    layer_positions,
    mamba_state_layout,
    window_of,
)
from kvxfer.state import StateComponent

BLOCKS, KV_HEADS, HEAD_DIM = 6, 4, 8
# Mamba2 as tests/integration_vllm/pd_engines.py builds it: x = heads x head_dim conv channels,
# then B and C, a conv window of 3 tokens; SSM state per head [head_dim, d_state] in fp32.
HEADS, M_HEAD_DIM, D_STATE, BC, STATE_LEN = 6, 4, 8, 12, 3
X = HEADS * M_HEAD_DIM


def _geometry(tp: int = 1, rank: int = 0, **changes) -> EngineGeometry:
    base = EngineGeometry(
        total_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=16, tp_size=tp, tp_rank=rank
    )
    return dataclasses.replace(base, **changes)


def _attention_layer(block_size: int = 16, tp: int = 1) -> torch.Tensor:
    """A layer as CPU attention registers it (LBHNC): `[blocks, heads, block_size, 2d]`."""
    return torch.zeros(BLOCKS, KV_HEADS // tp, block_size, 2 * HEAD_DIM, dtype=torch.bfloat16)


def _attention(block_size: int = 16, tp: int = 1, **extra) -> FullAttentionSpec:
    shape = {"num_kv_heads": KV_HEADS // tp, "head_size": HEAD_DIM, "dtype": torch.bfloat16}
    if "sliding_window" in extra:
        return SlidingWindowSpec(block_size=block_size, **shape, **extra)
    return FullAttentionSpec(block_size=block_size, **shape)


def _mamba(tp: int = 1, page: int = 2048, **changes) -> MambaSpec:
    fields = {
        "block_size": 16,
        "shapes": (((X + 2 * BC) // tp, STATE_LEN), (HEADS // tp, M_HEAD_DIM, D_STATE)),
        "dtypes": (torch.bfloat16, torch.float32),
        "page_size_padded": page,
        "mamba_type": MambaAttentionBackendEnum.MAMBA2,
        **changes,
    }
    return MambaSpec(**fields)


def _config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def _cpu(names) -> dict[str, tuple[str, str | None]]:
    return {name: ("CPU_ATTN", "vec") for name in names}


ATTN = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
MIXERS = [f"model.layers.{i}.mixer" for i in (1, 3)]


def test_full_attention_and_a_window_are_a_group_each_with_their_own_block_size() -> None:
    caches = {
        ATTN[0]: _attention_layer(16),
        ATTN[2]: _attention_layer(16),
        ATTN[1]: _attention_layer(32),
        ATTN[3]: _attention_layer(32),
    }
    config = _config(
        ([ATTN[0], ATTN[2]], _attention(16)),
        ([ATTN[1], ATTN[3]], _attention(32, sliding_window=24)),
    )
    groups, tables = cache_groups(caches, config, _geometry(), _cpu(caches))
    assert tables == [TableSource(0), TableSource(1)]
    assert [g.sliding_window for g in groups] == [None, 24]
    assert [g.spec.block_size for g in groups] == [16, 32]
    assert [g.spec.num_layers for g in groups] == [2, 2]
    assert not any(g.state for g in groups)
    # Views of the registered tensors, in the group's layer order: nothing is copied.
    assert [c.data_ptr() for c in groups[1].caches] == [
        caches[ATTN[1]].data_ptr(),
        caches[ATTN[3]].data_ptr(),
    ]


def test_layer_positions_say_which_group_and_local_layer_a_saved_layer_is() -> None:
    """What a worker marks ready when vLLM's forward pass saves a layer: the layer's group and
    its index there, in the order the group's caches are in (model-layer order)."""
    caches = {name: _attention_layer(16 if i % 2 == 0 else 32) for i, name in enumerate(ATTN)}
    config = _config(
        ([ATTN[2], ATTN[0]], _attention(16)),  # vLLM's order; the group's caches are sorted
        ([ATTN[1], ATTN[3]], _attention(32, sliding_window=24)),
    )
    groups, _ = cache_groups(caches, config, _geometry(), _cpu(caches))
    positions = layer_positions(caches, config, pp_size=1)
    assert positions == {ATTN[0]: (0, 0), ATTN[2]: (0, 1), ATTN[1]: (1, 0), ATTN[3]: (1, 1)}
    for name, (group, local) in positions.items():
        assert groups[group].caches[local].data_ptr() == caches[name].data_ptr()
    reversed_order = {name: _attention_layer() for name in reversed(ATTN)}
    assert layer_positions(reversed_order, None, pp_size=1) == {
        name: (0, i) for i, name in enumerate(ATTN)
    }
    page = _attention().page_size_bytes
    hybrid = {ATTN[0]: _attention_layer(), MIXERS[0]: torch.zeros(BLOCKS, page, dtype=torch.uint8)}
    mamba = _config(([ATTN[0]], _attention()), ([MIXERS[0]], _mamba(page=page)))
    assert layer_positions(hybrid, mamba, pp_size=1) == {}  # state is never streamed


def test_one_group_takes_every_registered_layer_and_keeps_its_window() -> None:
    caches = {name: _attention_layer() for name in ATTN[:2]}
    config = _config((ATTN[:2], _attention(sliding_window=24)))
    (group,), tables = cache_groups(caches, config, _geometry(), _cpu(caches))
    assert tables == [TableSource(0)]
    assert (group.sliding_window, group.spec.num_layers) == (24, 2)
    (group,), _ = cache_groups(caches, None, _geometry(), _cpu(caches))
    assert group.sliding_window is None


def test_a_mamba_group_becomes_one_state_group_per_sub_projection() -> None:
    """TP rank 1 of 2: the attention layers hold 2 of 4 heads; each Mamba2 layer's page holds
    its conv slices of x, B and C, then its SSM heads, each a state group over the rows of the
    whole model, whose table is the block holding the state."""
    caches = {name: _attention_layer(tp=2) for name in (ATTN[0], ATTN[2])}
    page = _attention(tp=2).page_size_bytes
    caches |= {name: torch.zeros(BLOCKS, page, dtype=torch.uint8) for name in MIXERS}
    config = _config(([ATTN[0], ATTN[2]], _attention(tp=2)), (MIXERS, _mamba(tp=2, page=page)))
    groups, tables = cache_groups(
        caches, config, _geometry(2, 1), _cpu(caches), conv_state_dim_first=True
    )
    assert tables == [TableSource(0)] + [TableSource(1, 16)] * 4
    assert [g.state for g in groups] == [False, True, True, True, True]
    assert [g.spec.num_kv_heads for g in groups] == [KV_HEADS, X, BC, BC, HEADS]
    assert {g.spec.tp_rank for g in groups} == {1}
    # A state group's table is the one block of the last token; attention keeps its table.
    vllm_tables = [[5, 6, 7], [0, 0, 4]]
    assert group_tables(tables, vllm_tables, 40) == [[5, 6, 7]] + [[4]] * 4


@pytest.mark.parametrize(
    ("num_tokens", "block"),
    [(1, 0), (16, 0), (17, 1), (48, 2)],
)
def test_a_state_table_is_the_block_of_the_last_token(num_tokens: int, block: int) -> None:
    tables = group_tables([TableSource(0), TableSource(1, 16)], [[1, 2], [7, 8, 9]], num_tokens)
    assert tables == [[1, 2], [[7, 8, 9][block]]]


def test_groups_kvxfer_cannot_move_are_refused_naming_the_group() -> None:
    caches = {name: _attention_layer() for name in ATTN[:2]}
    unregistered = _config(([ATTN[0]], _attention()), (["model.layers.9.attn"], _attention()))
    with pytest.raises(ValueError, match=r"none of KV cache group 1's layers.*register every"):
        cache_groups(caches, unregistered, _geometry(), _cpu(caches))
    chunked = ChunkedLocalAttentionSpec(
        block_size=16,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_DIM,
        dtype=torch.bfloat16,
        attention_chunk_size=32,
    )
    with pytest.raises(ValueError, match="group 1 is a ChunkedLocalAttentionSpec"):
        cache_groups(
            caches,
            _config(([ATTN[0]], _attention()), ([ATTN[1]], chunked)),
            _geometry(),
            _cpu(caches),
        )
    two = _config(([ATTN[0]], _attention()), ([ATTN[1]], _attention(sliding_window=8)))
    with pytest.raises(ValueError, match="2 KV cache groups with pipeline parallelism"):
        cache_groups(caches, two, _geometry(pp_size=2, kv_layers=(0, 1, 2, 3)), _cpu(caches))


def test_mamba_layouts_split_their_conv_state_by_type() -> None:
    mamba2 = mamba_state_layout(_mamba(tp=2), 2, 1, conv_state_dim_first=True)
    conv, ssm = mamba2.components
    assert conv == StateComponent(X + 2 * BC, (STATE_LEN,), torch.bfloat16, (X, BC, BC))
    assert ssm == StateComponent(HEADS, (M_HEAD_DIM, D_STATE), torch.float32)
    assert (mamba2.page_bytes, mamba2.tp_size, mamba2.tp_rank) == (2048, 2, 1)
    mamba1 = _mamba(mamba_type=MambaAttentionBackendEnum.MAMBA1)
    assert mamba_state_layout(mamba1, 1, 0, conv_state_dim_first=True).components[0].segments == (
        X + 2 * BC,
    )
    # Gated delta net: Q and K share what V (value heads x value head dim) leaves.
    gdn = _mamba(mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    assert mamba_state_layout(gdn, 1, 0, conv_state_dim_first=True).components[0].segments == (
        BC,
        BC,
        X,
    )


@pytest.mark.parametrize(
    ("changes", "dim_first", "problem"),
    [
        pytest.param({}, False, "VLLM_SSM_CONV_STATE_LAYOUT=DS on both engines", id="conv-SD"),
        pytest.param({"mamba_cache_mode": "all"}, True, "mamba_cache_mode 'all'", id="cache-all"),
        pytest.param({"num_speculative_blocks": 2}, True, "2 speculative blocks", id="spec"),
        pytest.param(
            {"shapes": ((X + 2 * BC, STATE_LEN),)}, True, "1 states per layer", id="one-state"
        ),
        pytest.param(
            {"mamba_type": MambaAttentionBackendEnum.SHORT_CONV},
            True,
            "is not supported",
            id="short-conv",
        ),
        pytest.param(
            {"shapes": ((X, STATE_LEN), (HEADS, M_HEAD_DIM, D_STATE))},
            True,
            r"do not split into sub-projections \(24, 0, 0\)",
            id="no-B-C",
        ),
    ],
)
def test_mamba_layouts_kvxfer_cannot_move_are_refused_with_the_fix(changes, dim_first, problem):
    with pytest.raises(ValueError, match=rf"KV cache group 3 \(Mamba\): .*{problem}"):
        mamba_state_layout(_mamba(**changes), 1, 0, 3, conv_state_dim_first=dim_first)


def test_the_conv_state_layout_is_vllms_setting_unless_given(monkeypatch) -> None:
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: False)
    with pytest.raises(ValueError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
        mamba_state_layout(_mamba(), 1, 0)
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: True)
    assert mamba_state_layout(_mamba(), 1, 0).components[0].segments == (X, BC, BC)


def test_windows_and_layer_indices_are_read_from_vllms_names_and_specs() -> None:
    assert window_of(_attention()) is None
    assert window_of(_attention(sliding_window=24)) == 24
    assert window_of(_mamba()) is None
    assert layer_indices(ATTN, 1) == [0, 1, 2, 3]
    assert layer_indices(["model.layers.7.self_attn.attn"], 2) == [7]
    # Without pipeline parallelism, names without one index each keep vLLM's order.
    assert layer_indices(["attn"], 1) is None
    assert layer_indices(["model.layers.1.a", "model.layers.1.b"], 1) is None
    with pytest.raises(ValueError, match="pipeline parallelism needs each KV cache's layer"):
        layer_indices(["attn"], 2)


def test_the_attention_backend_names_the_layout_never_the_strides() -> None:
    assert attention_geometry(_geometry(), ATTN[:1], _cpu(ATTN[:1])).cpu_placement == "k_transposed"
    flash = {ATTN[0]: ("FLASH_ATTN", None)}
    assert attention_geometry(_geometry(), ATTN[:1], flash).cpu_placement is None
    with pytest.raises(ValueError, match="cannot tell the attention backend"):
        attention_geometry(_geometry(), ATTN[:1], {})
    with pytest.raises(ValueError, match="FLASH_ATTN keeps a rows cache, but the model uses MLA"):
        attention_geometry(_geometry(mla=True), ATTN[:1], flash)
