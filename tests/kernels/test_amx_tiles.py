"""vLLM CPU attention's AMX layout (`kv_placement="amx_tiles"`, ISA `amx`: bf16 and fp8 caches
on CPUs with AMX tiles): K in groups of 16 slots with pairs of dims side by side, V in groups of
16 dims with pairs of slots side by side, inside each (block, head), behind the strides of HND
kv_inner (docs/engine-layouts.md; the probe against the op itself is in tests/e2e).

Checked against `kvxfer.reference`, which computes the offsets itself, and against the offsets
written out by hand below: every strategy that can move it, block sizes both ways, partial
blocks, the AMX layout on one side and CPU attention's `vec` layout or a GPU layout on the
other.
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
from kvxfer.layout import canonical_shape, cell_planes, plane_views
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.strategies import geometries, movable_strategy, reshard_random_geometry

AMX = "amx_tiles"


def _amx_spec(**changes: Any) -> KVCacheSpec:
    return replace(cpu_attention_rank(AMX), **changes).spec()


def test_reference_writes_the_amx_offsets() -> None:
    """Token t of head h in block b: K element d at `(s // 16) * 16 * D + (d // 2) * 32 +
    (s % 16) * 2 + d % 2`, V element d at `bs * D + (d // 16) * 16 * bs + (s // 2) * 32 +
    (d % 16) * 2 + s % 2` inside the (b, h) run: what vLLM 0.32's cpu_attn_amx.hpp writes."""
    spec = _amx_spec()
    bs, dim = spec.block_size, spec.head_dim
    assert_run_offsets(
        spec,
        40,
        k_at=lambda s, d: (s // 16) * 16 * dim + (d // 2) * 32 + (s % 16) * 2 + d % 2,
        v_at=lambda s, d: bs * dim + (d // 16) * 16 * bs + (s // 2) * 32 + (d % 16) * 2 + s % 2,
    )


def test_cell_planes_match_the_reference() -> None:
    spec = _amx_spec(heads=4, head_dim=48, block_size=16, num_blocks=4)
    cache = torch.zeros(spec.layer_shape, dtype=torch.bfloat16)
    kv = random_global_kv(spec, 40)
    ids = [3, 1, 0]
    write_rank_cells(spec, [cache], ids, kv, 0, 40)
    planes = cell_planes(cache, "HND", AMX, False)
    blocks = torch.tensor([ids[t // 16] for t in range(40)])
    slots = torch.arange(40) % 16
    for plane, cells in enumerate(planes):
        assert torch.equal(cells.read(blocks, slots, slice(0, 4)), kv[0, plane])
    assert canonical_shape(cache, "HND", AMX, False) == (2, 4, 16, 4, 48)


def test_no_plane_view_and_no_guess() -> None:
    """No K and V planes to view (tests/kernels/test_k_transposed.py checks that there is no
    canonical view and that the layout is HND only, for both CPU attention layouts)."""
    tensor = torch.zeros(_amx_spec().layer_shape)
    with pytest.raises(ValueError, match="cell_planes"):
        plane_views(tensor, "HND", AMX, False)
    with pytest.raises(ValueError, match="dense run"):
        cell_planes(tensor[:, :, :, :32], "HND", AMX, False)  # a slice: not the engine's tensor
    for field, value in (("block_size", 24), ("head_dim", 40)):
        with pytest.raises(ValueError, match="groups of 16"):
            _amx_spec(**{field: value})


@st.composite
def amx_geometries(draw: st.DrawFn) -> dict:
    """`geometries()` without MLA, with one side or both on the AMX layout (the other on
    CPU attention's `vec` layout or any GPU one), blocks and head_dim in its groups of 16, and
    a strategy that can move it (or the cost model's)."""
    g = draw(geometries())
    g["mla"] = False
    g["head_dim"] = draw(st.sampled_from([16, 32]))
    g["tokens"] = draw(st.integers(1, 70))
    g["start"] = draw(st.integers(0, g["tokens"]))
    which = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    for side, amx in zip(g["sides"], which, strict=True):
        if amx:
            side["layout"], side["placement"] = "HND", AMX
            side["block_size"] = draw(st.sampled_from([16, 32, 48]))
        elif draw(st.booleans()):
            side["layout"], side["placement"] = "HND", "k_transposed"
    g["strategy"] = movable_strategy(draw, g)
    return g


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(amx_geometries())
def test_reshard_amx_tiles_bit_exact(g: dict) -> None:
    """AMX on one side or both with any TP pair, block sizes in its groups of 16, start token
    and partial blocks, every allowed strategy: byte-exact, poison outside the moved range
    intact (`reshard_random_geometry`)."""
    reshard_random_geometry(g, "torch")


@pytest.mark.parametrize(("src", "dst"), [(AMX, "k_transposed"), ("k_transposed", AMX)])
def test_an_amx_engine_and_a_vec_engine_pair_both_ways(src: str, dst: str) -> None:
    """bf16 TP 1 on AMX (blocks of 32) and TP 2 on `vec` (blocks of 64), the e2e's tiny model's
    4 KV heads of 32, and the reverse."""
    kw = dict(heads=4, head_dim=32, dtype="bfloat16", num_layers=2, layout="HND")
    src_specs = side_specs(1, block_size=32, placement=src, num_blocks=12, **kw)
    dst_specs = side_specs(2, block_size=64, placement=dst, num_blocks=12, **kw)
    sc = make_scenario(src_specs, dst_specs, 209, 0, seed=3)
    reshard(sc.src, sc.dst, 209, backend="torch")
    sc.assert_exact()
