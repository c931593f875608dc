"""SGLang's pools read from the pointers SGLang hands a backend (kvxfer.integrations.sglang.
geometry, which imports no SGLang): the layout SGLang 0.5.23 allocates is accepted and moved
through its own memory; what kvxfer has not verified is refused, naming what differs. The pools
themselves (SGLang's classes) are exercised by `make test-sglang`."""

from __future__ import annotations

import pytest
import torch

from kvxfer.integrations.sglang.pools import (
    SGLangModel,
    heads_held,
    kv_dtype_name,
    sglang_cache,
    window_table,
)

LAYERS, HEADS, DIM, PAGE, ROWS = 2, 4, 8, 16, 80
MODEL = SGLangModel(total_kv_heads=8, head_dim=DIM, total_layers=LAYERS, dtype="bfloat16")


def _infos(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> tuple[list, list, list]:
    """`get_contiguous_buf_infos()` of an MHA pool: K of every layer, then V of every layer."""
    bufs = [*ks, *vs]
    return (
        [b.data_ptr() for b in bufs],
        [b.numel() * b.element_size() for b in bufs],
        [PAGE * HEADS * DIM * 2] * len(bufs),
    )


def test_k_and_v_halves_of_one_allocation_are_the_contracts_nhd_kv_first_layer():
    fused = [torch.zeros(2, ROWS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ks, vs = [f[0] for f in fused], [f[1] for f in fused]  # SGLang's k_buffer, v_buffer
    spec, layers = sglang_cache(*_infos(ks, vs), PAGE, MODEL, tp_size=2, tp_rank=1)
    assert (spec.layout, spec.kv_placement, spec.block_size) == ("NHD", "kv_first", PAGE)
    assert spec.num_blocks == ROWS // PAGE and spec.num_kv_heads == 8 and spec.tp_rank == 1
    # The layer tensor is SGLang's memory: token slot page * PAGE + slot of V, head 3.
    layers[1][1, 2, 5, 3] = 7.0
    assert bool((vs[1][2 * PAGE + 5, 3] == 7.0).all())
    layers[0][0, 4, 0, 0, 1] = -3.0
    assert ks[0][4 * PAGE, 0, 1].item() == -3.0


def test_k_and_v_apart_in_memory_are_refused():
    ks = [torch.zeros(ROWS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    vs = [torch.zeros(ROWS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match=r"layer 0: V starts .* not a layout kvxfer has verified"):
        sglang_cache(*_infos(ks, vs), PAGE, MODEL, tp_size=2, tp_rank=0)


def test_a_page_of_another_size_than_the_model_says_is_refused():
    fused = [torch.zeros(2, ROWS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ptrs, lens, items = _infos([f[0] for f in fused], [f[1] for f in fused])
    fp32 = SGLangModel(8, DIM, LAYERS, "float32")  # the pool holds bf16
    with pytest.raises(ValueError, match="bytes per page"):
        sglang_cache(ptrs, lens, items, PAGE, fp32, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="draft"):
        sglang_cache(ptrs[:-1], lens[:-1], items[:-1], PAGE, MODEL, tp_size=2, tp_rank=0)


def test_an_mla_pool_is_one_latent_plane_per_layer():
    bufs = [torch.zeros(ROWS, 1, 24, dtype=torch.bfloat16) for _ in range(LAYERS)]
    mla = SGLangModel(1, 24, LAYERS, "bfloat16", mla=True)
    infos = ([b.data_ptr() for b in bufs], [b.numel() * 2 for b in bufs], [PAGE * 24 * 2] * 2)
    spec, layers = sglang_cache(*infos, PAGE, mla, tp_size=4, tp_rank=3)
    assert spec.mla and layers[1].shape == (ROWS // PAGE, PAGE, 24)
    layers[1][3, 1, 7] = 2.0
    assert bufs[1][3 * PAGE + 1, 0, 7].item() == 2.0


def test_dtypes_and_heads_as_sglang_names_them():
    assert kv_dtype_name("auto", torch.bfloat16) == "bfloat16"
    assert kv_dtype_name("fp8_e4m3", torch.bfloat16) == "float8_e4m3fn"
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp4_e2m1'"):
        kv_dtype_name("fp4_e2m1", torch.bfloat16)
    assert [heads_held(8, t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]


def test_window_pages_sit_at_the_requests_last_pages():
    # 100 tokens in pages of 16: 7 pages; SGLang names the window's (from token 48: 3 to 6).
    assert window_table([9, 4, 7, 2], 100, 16) == [0, 0, 0, 9, 4, 7, 2]
    assert window_table([5], 32, 32) == [5]
    assert window_table([], 10, 16) == [0]


def test_more_window_pages_than_the_request_has_are_refused():
    with pytest.raises(ValueError, match="3 sliding-window pages for a request of 20 tokens"):
        window_table([1, 2, 3], 20, 16)
