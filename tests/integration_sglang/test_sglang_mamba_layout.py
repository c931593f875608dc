"""SGLang's Mamba state as kvxfer reads it (`kvxfer.integrations.sglang.mamba`), on SGLang's own
`Mamba2StateShape`, `MambaPool`, `HybridLinearKVPool` and `setup_state_kv_args`: the conv's
runs each model shards apart (a single Mamba2 group whole on every rank), every group's view
landing on the bytes of the rank's slice in SGLang's pool, and the layouts kvxfer has not
verified refused with their reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.configs.mamba_utils import (
    KimiLinearCacheParams,
    KimiLinearStateShape,
    Mamba2CacheParams,
    Mamba2StateDType,
    Mamba2StateShape,
)
from sglang.srt.disaggregation.base.conn import KVArgs, StateType
from sglang.srt.disaggregation.utils import setup_state_kv_args
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

from kvxfer import reshard
from kvxfer.integrations.sglang.mamba import (
    ConvPart,
    MambaModel,
    conv_parts,
    kda_conv_parts,
    mamba_groups,
)
from kvxfer.testing import POISON

# A tiny gated delta net's conv (q, k, v) and a tiny Mamba2 mixer: 4 heads of 16, N 16, K 4.
QKV = [32, 32, 64]
INNER, STATE, HEADS, HEAD_DIM, KERNEL = 64, 16, 4, 16, 4
MAMBA_LAYERS, FULL_LAYERS = [0, 2], [1, 3]
SLOTS = 8


def _shape(tp: int, n_groups: int = 2, shard_groups: list[int] | None = None) -> Mamba2StateShape:
    return Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=INNER, n_groups=n_groups, num_heads=HEADS,
        head_dim=HEAD_DIM, state_size=STATE, conv_kernel=KERNEL, conv_shard_groups=shard_groups,
    )  # fmt: skip


def _pool_args(shape: Mamba2StateShape | KimiLinearStateShape) -> tuple[MambaPool, KVArgs]:
    """SGLang's pools of a rank and the `KVArgs` its scheduler fills from them."""
    dtype = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    kind = KimiLinearCacheParams if isinstance(shape, KimiLinearStateShape) else Mamba2CacheParams
    params = kind(shape=shape, layers=MAMBA_LAYERS, dtype=dtype)
    mamba = MambaPool(
        size=SLOTS, spec_state_size=4, cache_params=params, mamba_layer_ids=MAMBA_LAYERS,
        device="cpu",
    )  # fmt: skip
    pool = HybridLinearKVPool(
        size=256, dtype=torch.bfloat16, page_size=16, head_num=1, head_dim=32,
        full_attention_layer_ids=FULL_LAYERS, device="cpu", mamba_pool=mamba,
    )  # fmt: skip
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    setup_state_kv_args(args, pool, None, len(MAMBA_LAYERS) + len(FULL_LAYERS))
    assert args.state_types == [StateType.MAMBA]
    return mamba, args


@pytest.mark.parametrize("tp", [1, 2])
def test_each_models_conv_is_split_into_the_runs_it_shards_apart(tp):
    assert conv_parts(_shape(tp, shard_groups=QKV), None, tp) == (ConvPart(128, 1, tuple(QKV)),)
    groups = ConvPart(2, STATE)  # x, then B and C: 2 groups of N channels each
    assert conv_parts(_shape(tp, n_groups=2), 2, tp) == (ConvPart(INNER), groups, groups)
    full_rank = Mamba2StateShape.create_full_rank(
        tp_world_size=tp, intermediate_size=INNER, state_size=STATE, conv_kernel=KERNEL
    )
    assert conv_parts(full_rank, None, tp) == (ConvPart(INNER),)  # Mamba1: x alone


def test_one_mamba2_group_is_held_whole_by_every_rank():
    """n_groups 1 at TP 2: SGLang extends the groups to the TP and gives both ranks all of B
    and C; kvxfer's runs say so (one row of N channels, replicated), the same at any TP."""
    one = ConvPart(1, STATE)
    for tp in (1, 2, 4):
        assert conv_parts(_shape(tp, n_groups=1), 1, tp) == (ConvPart(INNER), one, one)
    with pytest.raises(ValueError, match=r"n_groups=None at TP 2"):
        conv_parts(_shape(2, n_groups=2), None, 2)  # a config that does not say


@pytest.mark.parametrize(
    ("tp", "shard_groups", "n_groups"),
    [(1, QKV, 2), (2, QKV, 2), (2, None, 2), (2, None, 1)],
    ids=["gdn-tp1", "gdn-tp2", "mamba2-tp2", "mamba2-one-group-tp2"],
)
def test_every_group_views_its_rank_slice_of_sglangs_pool(tp, shard_groups, n_groups):
    """Each group's layer tensor is the pool's own memory: a slot's rows of the groups, in
    order, are that slot's conv channels (temporal heads) where SGLang's pool keeps them, and
    together every channel of the rank."""
    shape = _shape(tp, n_groups=n_groups, shard_groups=shard_groups)
    model = MambaModel(conv_parts(shape, n_groups, tp), HEADS)
    mamba, args = _pool_args(shape)
    conv, temporal = mamba.mamba_cache.conv[0], mamba.mamba_cache.temporal
    conv.view(torch.int16).copy_(torch.arange(conv.numel(), dtype=torch.int16).view(conv.shape))
    temporal.view(torch.int32).copy_(
        torch.arange(temporal.numel(), dtype=torch.int32).view(temporal.shape)
    )
    for rank in range(tp):
        groups = mamba_groups(args, 0, model, tp_size=tp, tp_rank=rank, device="cpu")
        assert all(g.state for g in groups)
        first = 0
        for group in groups[:-1]:
            for layer, view in enumerate(group.caches):
                for slot in (0, 3, SLOTS):
                    got = view[slot, 0].contiguous().view(torch.int16).reshape(-1, KERNEL - 1)
                    want = conv[layer, slot, first : first + got.shape[0]].view(torch.int16)
                    assert torch.equal(got, want)
            first += got.shape[0]
        assert first == conv.shape[2]  # the groups tile the rank's channels
        for layer, view in enumerate(groups[-1].caches):
            want = temporal[layer, 5]
            assert torch.equal(view[5, 0].contiguous().view(torch.int32).view(want.shape),
                               want.view(torch.int32))  # fmt: skip


def test_a_pool_sliced_unlike_its_model_or_a_state_held_whole_is_refused():
    shape = _shape(2, shard_groups=QKV)
    model = MambaModel(conv_parts(shape, None, 2), HEADS)
    _, args = _pool_args(shape)
    count = len(args.state_data_ptrs[0])
    args.state_slice_outer_counts = [[3] * count]  # channels last, as KDA's: not this model's
    with pytest.raises(ValueError, match=r"state_slice_outer_counts \[3\]\) are not the model"):
        mamba_groups(args, 0, model, tp_size=2, tp_rank=0, device="cpu")
    args.state_slice_outer_counts = [[1] * count]
    args.state_dim_per_tensor = [[0] * count]
    with pytest.raises(ValueError, match="registered whole on every rank"):
        mamba_groups(args, 0, model, tp_size=2, tp_rank=0, device="cpu")


def test_a_pool_of_another_tp_than_the_model_says_is_refused_naming_both():
    shape = _shape(2, shard_groups=QKV)
    _, args = _pool_args(shape)
    model = MambaModel(conv_parts(shape, None, 2), HEADS)
    with pytest.raises(ValueError, match=r"the conv state: \[64\] rows.*expected 32 rows"):
        mamba_groups(args, 0, model, tp_size=4, tp_rank=0, device="cpu")


# A tiny KDA (Kimi-Linear): q of 4 heads of 16, k and v of 2 heads of 8, channels last.
KDA_HEADS, KDA_DIM, KDA_K_HEADS, KDA_K_DIM = 4, 16, 2, 8
KDA_BLOCKS = [KDA_HEADS * KDA_DIM, KDA_K_HEADS * KDA_K_DIM, KDA_K_HEADS * KDA_K_DIM]


def _kda_shape(tp: int) -> KimiLinearStateShape:
    return KimiLinearStateShape.create(
        tp_world_size=tp, num_heads=KDA_HEADS, head_dim=KDA_DIM, num_k_heads=KDA_K_HEADS,
        head_k_dim=KDA_K_DIM, conv_kernel_size=KERNEL,
    )  # fmt: skip


def _kda_rank(conv: torch.Tensor, temporal: torch.Tensor, tp: int, rank: int):
    """A rank's part of a whole KDA state (conv `[layers, K - 1, channels]`, channels last):
    every window row's r-th slice of each sub-block, back to back; its heads of temporal."""
    starts = [sum(KDA_BLOCKS[:i]) for i in range(len(KDA_BLOCKS))]
    index = torch.cat(
        [
            torch.arange(s + rank * n // tp, s + (rank + 1) * n // tp)
            for s, n in zip(starts, KDA_BLOCKS, strict=True)
        ]
    )
    heads = KDA_HEADS // tp
    return conv[:, :, index], temporal[:, rank * heads : (rank + 1) * heads]


def test_a_kda_conv_is_a_run_of_its_sub_blocks_per_window_row():
    run = ConvPart(sum(KDA_BLOCKS), 1, tuple(KDA_BLOCKS))
    assert kda_conv_parts(_kda_shape(2)) == (run,) * (KERNEL - 1)


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 2)])
def test_a_kda_slot_reshards_bit_exact_between_sglangs_own_pools(src_tp, dst_tp):
    """Kimi's channels-last conv and its temporal state, from slot 3 of every source rank's
    `MambaPool` into slot 5 of every destination rank's (`kvxfer.reshard`, group by group):
    each destination holds its part of the whole state, every other slot its poison."""
    gen = torch.Generator().manual_seed(src_tp * 10 + dst_tp)
    layers, rows = len(MAMBA_LAYERS), KERNEL - 1
    conv = torch.randint(-(2**15), 2**15, (layers, rows, sum(KDA_BLOCKS)), generator=gen)
    temporal = torch.randint(-(2**31), 2**31, (layers, KDA_HEADS, KDA_DIM, KDA_DIM), generator=gen)
    conv, temporal = conv.to(torch.int16), temporal.to(torch.int32)

    def side(tp: int, src: bool):
        ranks = []
        for rank in range(tp):
            shape = _kda_shape(tp)
            mamba, args = _pool_args(shape)
            pool_conv, pool_temporal = mamba.mamba_cache.conv[0], mamba.mamba_cache.temporal
            if src:
                want_conv, want_temporal = _kda_rank(conv, temporal, tp, rank)
                pool_conv.view(torch.int16)[:, 3] = want_conv
                pool_temporal.view(torch.int32)[:, 3] = want_temporal
            else:
                pool_conv.view(torch.uint8).fill_(POISON)
                pool_temporal.view(torch.uint8).fill_(POISON)
            model = MambaModel(kda_conv_parts(shape), KDA_HEADS, channels_last=True)
            groups = mamba_groups(args, 0, model, tp_size=tp, tp_rank=rank, device="cpu")
            ranks.append((mamba, args, groups))  # the args keep the pools' memory alive
        return ranks

    sources, destinations = side(src_tp, True), side(dst_tp, False)
    for g in range(len(sources[0][2])):
        reshard(
            [(gs[g].spec, gs[g].caches, [3]) for _, _, gs in sources],
            [(gs[g].spec, gs[g].caches, [5]) for _, _, gs in destinations],
            1,
            backend="torch",
        )
    for rank, (mamba, _, _) in enumerate(destinations):
        want_conv, want_temporal = _kda_rank(conv, temporal, dst_tp, rank)
        got_conv, got_temporal = mamba.mamba_cache.conv[0], mamba.mamba_cache.temporal
        assert torch.equal(got_conv.view(torch.int16)[:, 5], want_conv), f"rank {rank}: conv"
        assert torch.equal(got_temporal.view(torch.int32)[:, 5], want_temporal), f"rank {rank}"
        for tensor in (got_conv, got_temporal):
            others = torch.cat([tensor[:, :5], tensor[:, 6:]], 1).view(torch.uint8)
            assert bool((others == POISON).all()), f"rank {rank} wrote another slot"


def test_a_state_without_a_conv_or_without_a_temporal_state_is_refused():
    """Lightning attention's `Mamba2StateShape` has no conv (kernel 1, no channels); LFM2's short
    convolutions register a conv alone (SGLang skips an empty temporal state), so its buffers
    are not a conv and a temporal state of every layer."""
    lightning = Mamba2StateShape.create(
        tp_world_size=2, intermediate_size=0, n_groups=0, num_heads=HEADS, head_dim=HEAD_DIM,
        state_size=STATE, conv_kernel=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="without a conv"):
        conv_parts(lightning, None, 2)
    shape = _shape(2, shard_groups=QKV)
    _, args = _pool_args(shape)
    args.state_layer_ids = [[0, 2, 4, 6]]  # four layers' convs, no temporal state
    with pytest.raises(ValueError, match="conv-only state"):
        mamba_groups(args, 0, MambaModel(conv_parts(shape, None, 2), HEADS), tp_size=2,
                     tp_rank=0, device="cpu")  # fmt: skip


def test_a_request_of_other_than_one_mamba_slot_is_refused():
    from kvxfer.integrations.sglang.manager.model import group_tables

    shape = _shape(1, shard_groups=QKV)
    _, args = _pool_args(shape)
    groups = mamba_groups(args, 0, MambaModel(conv_parts(shape, None, 1), HEADS), tp_size=1,
                          tp_rank=0, device="cpu")  # fmt: skip
    kv_pages = np.arange(3)
    for slot in (np.asarray(4), np.asarray([4])):  # SGLang's 0-d form, and one of one
        tables = group_tables(groups, kv_pages, [slot], 40)
        assert all(t.tolist() == [4] for t in tables)
    for slots in ([], [3, 4]):
        with pytest.raises(ValueError, match="expected one slot"):
            group_tables(groups, kv_pages, [np.asarray(slots)], 40)
