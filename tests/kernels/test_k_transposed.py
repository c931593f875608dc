"""vLLM CPU attention's layout (`kv_placement="k_transposed"`): K dim-major and V slot-major
inside each (block, head), behind the strides of HND kv_inner (docs/engine-layouts.md).

Checked against `kvxfer.reference`, which indexes the layout itself, and against raw element
offsets written out by hand below: every strategy that can move it, any pair of block sizes,
partial first and last blocks, and a CPU engine on one side with any GPU layout on the other.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer import KVCacheSpec, reshard
from kvxfer.layout import canonical_view, plane_views
from kvxfer.plan import STRATEGIES, plan_pairs, strategies_for
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.strategies import geometries, geometry_specs

K_T = "k_transposed"


def _cpu_spec(**overrides: object) -> KVCacheSpec:
    fields: dict = dict(
        num_layers=1,
        num_kv_heads=2,
        head_dim=3,
        dtype="float32",
        tp_size=1,
        tp_rank=0,
        block_size=4,
        num_blocks=3,
        layout="HND",
        kv_placement=K_T,
    )
    fields.update(overrides)
    return KVCacheSpec(**fields)


def test_reference_writes_cpu_attention_offsets() -> None:
    """Token t of head h in block b: K element d at `d * block_size + slot`, V element d at
    `block_size * head_dim + slot * head_dim + d`, inside the (b, h) run: what vLLM's
    cpu_attn_reshape_and_cache writes for its vec and vec16 ISAs."""
    spec = _cpu_spec()
    bs, dim = spec.block_size, spec.head_dim
    cache = torch.zeros(spec.layer_shape)
    kv = random_global_kv(spec, 6)
    block_ids = [2, 0]
    write_rank_cells(spec, [cache], block_ids, kv, 0, 6)
    for t in range(6):
        block, slot = block_ids[t // bs], t % bs
        for h in range(2):
            run = cache[block, h].reshape(-1)
            for d in range(dim):
                assert run[d * bs + slot] == kv[0, 0, t, h, d]
                assert run[bs * dim + slot * dim + d] == kv[0, 1, t, h, d]


def test_plane_views_match_the_reference() -> None:
    spec = _cpu_spec(num_kv_heads=4, head_dim=5, block_size=8, num_blocks=4)
    cache = torch.zeros(spec.layer_shape)
    kv = random_global_kv(spec, 20)
    write_rank_cells(spec, [cache], [3, 1, 0], kv, 0, 20)
    k, v = plane_views(cache, "HND", K_T, False)
    assert k.shape == v.shape == (4, 8, 4, 5)
    for t in range(20):
        block, slot = [3, 1, 0][t // 8], t % 8
        assert torch.equal(k[block, slot], kv[0, 0, t])
        assert torch.equal(v[block, slot], kv[0, 1, t])


def test_no_canonical_view_and_no_guess() -> None:
    spec = _cpu_spec()
    tensor = torch.zeros(spec.layer_shape)
    with pytest.raises(ValueError, match="cell_planes"):
        canonical_view(tensor, "HND", K_T, False)
    with pytest.raises(ValueError, match="dense run"):
        plane_views(tensor[:, :, :, :4], "HND", K_T, False)  # a slice: not the engine's tensor
    with pytest.raises(ValueError, match="layout='HND'"):
        _cpu_spec(layout="NHD")


def test_strategies_never_address_a_k_transposed_cache() -> None:
    cpu, gpu = _cpu_spec(), _cpu_spec(kv_placement="kv_inner")
    assert strategies_for(gpu, gpu) == STRATEGIES
    assert strategies_for(cpu, gpu) == ("pack", "pack+unpack")
    assert strategies_for(gpu, cpu) == ("unpack", "pack+unpack")
    assert strategies_for(cpu, cpu) == ("pack+unpack",)
    with pytest.raises(ValueError, match=r"'direct'.*source cache is 'k_transposed'"):
        plan_pairs([cpu], [gpu], strategy="direct")
    with pytest.raises(ValueError, match=r"'pack'.*destination cache is 'k_transposed'"):
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
    src, dst = (specs[0] for specs in geometry_specs(g))
    g["strategy"] = draw(st.sampled_from([None, *strategies_for(src, dst)]))
    return g


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cpu_geometries())
def test_reshard_k_transposed_bit_exact(g: dict) -> None:
    """Any TP pair, block sizes, start token and partial blocks, every allowed strategy:
    every destination byte equals the reference, poisoned cells outside the moved range
    included."""
    specs = geometry_specs(g)
    sc = make_scenario(specs[0], specs[1], g["tokens"], g["start"], g["seed"], g["contiguous"])
    reshard(sc.src, sc.dst, g["tokens"], g["start"], strategy=g["strategy"], backend="torch")
    sc.assert_exact()


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
