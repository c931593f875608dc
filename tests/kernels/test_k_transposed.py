"""vLLM CPU attention's layout (`kv_placement="k_transposed"`): K dim-major and V slot-major
inside each (block, head), behind the strides of HND kv_inner (docs/engine-layouts.md).

Checked against `kvxfer.reference`, which indexes the layout itself, and against raw element
offsets written out by hand below: every strategy that can move it, any pair of block sizes,
partial first and last blocks, and a CPU engine on one side with any GPU layout on the other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import assert_run_offsets, cpu_attention_rank
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer import KVCacheSpec, reshard
from kvxfer.layout import canonical_view, plane_views
from kvxfer.plan import STRATEGIES, plan_pairs, strategies_for
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.strategies import geometries, movable_strategy, reshard_random_geometry

K_T = "k_transposed"


def _cpu_spec(**changes: Any) -> KVCacheSpec:
    return replace(cpu_attention_rank(K_T), **changes).spec()


def test_reference_writes_cpu_attention_offsets() -> None:
    """Token t of head h in block b: K element d at `d * block_size + slot`, V element d at
    `block_size * head_dim + slot * head_dim + d`, inside the (b, h) run: what vLLM's
    cpu_attn_reshape_and_cache writes for its vec and vec16 ISAs."""
    spec = _cpu_spec()
    bs, dim = spec.block_size, spec.head_dim
    assert_run_offsets(
        spec, 6, k_at=lambda s, d: d * bs + s, v_at=lambda s, d: bs * dim + s * dim + d
    )


def test_plane_views_match_the_reference() -> None:
    spec = _cpu_spec(heads=4, head_dim=5, block_size=8, num_blocks=4)
    cache = torch.zeros(spec.layer_shape)
    kv = random_global_kv(spec, 20)
    write_rank_cells(spec, [cache], [3, 1, 0], kv, 0, 20)
    k, v = plane_views(cache, "HND", K_T, False)
    assert k.shape == v.shape == (4, 8, 4, 5)
    for t in range(20):
        block, slot = [3, 1, 0][t // 8], t % 8
        assert torch.equal(k[block, slot], kv[0, 0, t])
        assert torch.equal(v[block, slot], kv[0, 1, t])


def test_no_guess_at_a_slice() -> None:
    tensor = torch.zeros(_cpu_spec().layer_shape)
    with pytest.raises(ValueError, match="dense run"):
        plane_views(tensor[:, :, :, :4], "HND", K_T, False)  # a slice: not the engine's tensor


# Both of vLLM CPU attention's layouts: its `vec` ISAs' (k_transposed) and AMX's.
CPU_ATTENTION = [K_T, "amx_tiles"]


@pytest.mark.parametrize("placement", CPU_ATTENTION)
def test_no_canonical_view_and_hnd_only(placement: str) -> None:
    rank = cpu_attention_rank(placement)
    with pytest.raises(ValueError, match="cell_planes"):
        canonical_view(torch.zeros(rank.spec().layer_shape), "HND", placement, False)
    with pytest.raises(ValueError, match="layout='HND'"):
        replace(rank, layout="NHD").spec()


@pytest.mark.parametrize("placement", CPU_ATTENTION)
def test_strategies_never_address_a_cpu_attention_cache(placement: str) -> None:
    """Only pack and unpack address a CPU attention cache: no strategy reads a source or
    writes a destination on one in place."""
    rank = cpu_attention_rank(placement)
    cpu, gpu = rank.spec(), replace(rank, placement="kv_inner").spec()
    assert strategies_for(gpu, gpu) == STRATEGIES
    assert strategies_for(cpu, gpu) == ("pack", "pack+unpack")
    assert strategies_for(gpu, cpu) == ("unpack", "pack+unpack")
    assert strategies_for(cpu, cpu) == ("pack+unpack",)
    with pytest.raises(ValueError, match=rf"'direct'.*source cache is '{placement}'"):
        plan_pairs([cpu], [gpu], strategy="direct")
    with pytest.raises(ValueError, match=rf"'pack'.*destination cache is '{placement}'"):
        plan_pairs([gpu], [cpu], strategy="pack")


@st.composite
def cpu_geometries(draw: st.DrawFn) -> dict:
    """`geometries()` without MLA, with one side or both on vLLM CPU attention's layout and a
    strategy that can move it (or the cost model's)."""
    g = draw(geometries())
    g["mla"] = False
    if g["heads"] == 1 and draw(st.booleans()):
        g["heads"] = 4
        for side in g["sides"]:
            side["tp"] = draw(st.sampled_from([1, 2, 4, 8]))
    which = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    for side, cpu in zip(g["sides"], which, strict=True):
        if cpu:
            side["layout"], side["placement"] = "HND", K_T
    g["strategy"] = movable_strategy(draw, g)
    return g


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cpu_geometries())
def test_reshard_k_transposed_bit_exact(g: dict) -> None:
    """Any TP pair, block sizes, start token and partial blocks, every allowed strategy, CPU
    attention on one side or both: every destination byte equals the reference, poisoned
    cells outside the moved range included (`reshard_random_geometry`)."""
    reshard_random_geometry(g, "torch")


@pytest.mark.parametrize(
    ("src_block", "dst_block", "tokens"),
    [
        pytest.param(32, 64, 1, id="1-token"),
        pytest.param(32, 64, 31, id="under-a-block"),
        pytest.param(32, 64, 32, id="one-block"),
        pytest.param(64, 32, 200, id="blocks-plus-partial"),
    ],
)
def test_cpu_engine_pair_of_the_e2e(src_block: int, dst_block: int, tokens: int) -> None:
    """The e2e's geometries: prefill TP 1 -> decode TP 2 and back, both on CPU attention,
    the tiny model's 4 KV heads of 32, float32."""
    for src_tp, dst_tp in ((1, 2), (2, 1)):
        kw = dict(heads=4, head_dim=32, dtype="float32", num_layers=2, layout="HND")
        src = side_specs(src_tp, block_size=src_block, placement=K_T, num_blocks=12, **kw)
        dst = side_specs(dst_tp, block_size=dst_block, placement=K_T, num_blocks=12, **kw)
        sc = make_scenario(src, dst, tokens, 0, seed=tokens)
        reshard(sc.src, sc.dst, tokens, backend="torch")
        sc.assert_exact()
