"""The planner's host cost: the kernel strategies plan without enumerating cells, and every
shortcut lists exactly the segments that the general enumeration lists."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.plan import STRATEGIES, Segments, build_program, coalesce, plan_pairs
from kvxfer.plan import segments as segments_module
from kvxfer.plan.paged import (
    BlockGeometry,
    cache_view,
    moved_bytes,
    staging_mirror,
    wire_buffer,
)
from kvxfer.plan.program import (
    CellCopy,
    PairChunk,
    count_program_segments,
)
from kvxfer.plan.segments import (
    LayerTemplate,
    _layer_bases,
    count_segments,
    enumerated_layer_template,
    expand_layers,
    staging_copy_template,
)
from kvxfer.spec import KV_PLACEMENTS
from kvxfer.testing import side_specs


def _assert_same_segments(got: Segments, want: Segments) -> None:
    for field in ("src_region", "src_offset", "dst_region", "dst_offset", "length"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype, field
        assert np.array_equal(a, b), (field, a[:8], b[:8])


def _block_ids(spec, end, rng, contiguous):
    needed = -(-end // spec.block_size)
    if contiguous:
        return np.arange(needed, dtype=np.int64)
    return rng.permutation(spec.num_blocks)[:needed].astype(np.int64)


@st.composite
def _geometries(draw):
    """Two engines of one model: any TP sizes, block sizes, layouts and placements."""
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 3))
    return tuple(
        side_specs(
            draw(st.sampled_from([1, 2, 4])),
            heads=heads,
            block_size=draw(st.sampled_from([1, 2, 3, 4, 16])),
            layout=draw(st.sampled_from(["NHD", "HND"])),
            placement=draw(st.sampled_from(KV_PLACEMENTS)),
            mla=mla,
            num_layers=layers,
            head_dim=4,
            num_blocks=128,  # enough for 80 tokens in blocks of 1
        )
        for _ in range(2)
    )


def _same_copy(a: CellCopy | None, b: CellCopy | None) -> bool:
    """Equal cell copies (their views hold numpy block tables, which `==` cannot compare)."""
    if a is None or b is None:
        return a is b
    if (a.num_heads, a.token_start, a.token_end) != (b.num_heads, b.token_start, b.token_end):
        return False
    return all(
        (x.geometry, x.token_shift, x.head_offset, x.region)
        == (y.geometry, y.token_shift, y.head_offset, y.region)
        and np.array_equal(x.block_ids, y.block_ids)
        for x, y in ((a.src, b.src), (a.dst, b.dst))
    )


@settings(max_examples=300, deadline=None)
@given(
    geometries=_geometries(),
    strategy=st.sampled_from(STRATEGIES),
    landing=st.booleans(),
    start=st.integers(0, 40),
    length=st.integers(1, 40),
    contiguous=st.booleans(),
    pair=st.integers(0, 15),
    seed=st.integers(0, 2**16),
)
def test_programs_list_the_segments_of_the_general_enumeration(
    geometries, strategy, landing, start, length, contiguous, pair, seed
):
    """Whatever the shortcut taken, a program's segments (and their count, which the cost
    model uses) are those of every moved cell enumerated and coalesced: partial first and last
    blocks, a transfer starting after a held prefix, MLA, kv_inner, landing or not."""
    src, dst = geometries
    plans = plan_pairs(src, dst, strategy=strategy, reference_tokens=8)
    plan = plans[pair % len(plans)]
    s, d = src[plan.src_rank], dst[plan.dst_rank]
    end = start + length
    rng = np.random.default_rng(seed)
    src_ids, dst_ids = _block_ids(s, end, rng, contiguous), _block_ids(d, end, rng, contiguous)

    program = build_program(plan.route, strategy, s, d, src_ids, dst_ids, start, end, landing)

    chunk = PairChunk(plan.route, strategy, s, d, start, end, landing)
    src_blocks, dst_blocks = chunk.source_blocks(src_ids), chunk.destination_blocks(dst_ids)
    shape = chunk.shape(src_blocks, dst_blocks)
    n = plan.route.num_heads
    general = enumerated_layer_template(shape.send_from, shape.send_to, n, start, end)
    want = expand_layers(general, shape.send_from, shape.send_to, s.num_layers)
    _assert_same_segments(program.segments, want)
    assert count_program_segments(shape, plan.route, start, end, s.num_layers) == len(want)
    assert program.nbytes == s.num_layers * moved_bytes(BlockGeometry.of_spec(s), n, length)
    # The connectors' halves of the program are the program's.
    assert _same_copy(chunk.pack(src_blocks), program.pack)
    assert _same_copy(chunk.unpack(dst_blocks), program.unpack)
    # The kernel strategies stage in one layout on both sides, and take the shortcut.
    fast = strategy == "pack+unpack" or (strategy == "pack" and landing)
    assert (shape.send_from is shape.send_to) == fast
    shortcut = staging_copy_template(shape.send_from, shape.send_to, n, start, end)
    assert (shortcut is not None) == fast


@settings(max_examples=300, deadline=None)
@given(
    layout=st.sampled_from(["NHD", "HND"]),
    placement=st.sampled_from(KV_PLACEMENTS),
    mla=st.booleans(),
    block_size=st.sampled_from([1, 2, 3, 5, 8, 16]),
    num_heads=st.integers(1, 3),
    start=st.integers(0, 60),
    length=st.integers(1, 60),
    wire=st.booleans(),
)
def test_staging_copy_matches_the_enumeration_on_partial_blocks(
    layout, placement, mla, block_size, num_heads, start, length, wire
):
    """Copies between staging buffers laid out the same: the shortcut lists exactly the moved
    cells' runs, including a first and a last block that the tokens fill only in part."""
    like = BlockGeometry(layout, placement, mla, 64, block_size, 8, 4, 2)
    heads = 1 if mla else num_heads
    end = start + length
    build = wire_buffer if wire else staging_mirror
    view = build(like, heads, start, end)
    fast = staging_copy_template(view, view, heads, start, end)
    assert fast is not None
    general = enumerated_layer_template(view, view, heads, start, end)
    for got, want in zip(
        (fast.src_offset, fast.dst_offset, fast.length),
        (general.src_offset, general.dst_offset, general.length),
        strict=True,
    ):
        assert got.dtype == want.dtype
        assert np.array_equal(got, want)
    assert int(fast.length.sum()) == moved_bytes(view.geometry, heads, length)
    # Exact coverage (whole blocks, or the wire buffer) is one run over the whole layer.
    whole = wire or (start % block_size == 0 and end % block_size == 0)
    assert (len(fast) == 1 and int(fast.length[0]) == view.geometry.layer_bytes) == whole


def test_staging_copy_shortcut_only_where_it_is_exact():
    """Not taken when the buffers differ in any way, or the copy leaves heads or whole blocks
    out: then only the enumeration knows the segments."""
    like = BlockGeometry("HND", "kv_first", False, 64, 4, 2, 4, 2)
    mirror = staging_mirror(like, 2, 3, 13)
    assert staging_copy_template(mirror, mirror, 2, 3, 13) is not None
    twin = staging_mirror(like, 2, 3, 13)  # equal, but its own block table
    assert staging_copy_template(mirror, twin, 2, 3, 13) is None
    assert staging_copy_template(mirror, mirror, 1, 3, 13) is None  # one of two heads
    assert staging_copy_template(mirror, mirror, 2, 5, 13) is None  # leaves block 0 out
    assert staging_copy_template(mirror, mirror, 2, 3, 8) is None  # leaves the last block out
    cache = cache_view(side_specs(1, heads=2, block_size=4)[0], np.arange(4), 0)
    assert staging_copy_template(cache, cache, 2, 0, 16) is None  # a cache is not staging


def test_layer_bases_are_those_of_every_layer():
    spec = side_specs(1, heads=2, block_size=4, num_layers=5)[0]
    for view in (
        cache_view(spec, np.arange(3), 0),
        staging_mirror(BlockGeometry.of_spec(spec), 2, 1, 10),
        wire_buffer(BlockGeometry.of_spec(spec), 2, 1, 10),
    ):
        for layers in (1, 2, 5):
            keys, bases = _layer_bases(view, layers)
            want = [view.layer_base(layer) for layer in range(layers)]
            assert list(zip(keys.tolist(), bases.tolist(), strict=True)) == want


@pytest.mark.parametrize("layers", [1, 2, 5])
@pytest.mark.parametrize(
    "runs",
    [[(0, 4)], [(0, 4), (8, 56)], [(2, 4), (8, 56)], [(0, 4), (8, 50)], [(4, 60)]],
    ids=["one-partial", "wraps", "starts-late", "ends-early", "one-to-the-end"],
)
def test_layers_merge_exactly_where_coalescing_merges_them(runs, layers):
    """Layers back to back in one staging region: a layer's last run and the next layer's
    first merge when they touch, as coalescing every segment would merge them."""
    geometry = BlockGeometry("NHD", "kv_first", True, 1, 8, 1, 4, 2)  # 64 bytes a layer
    view = wire_buffer(geometry, 1, 0, 8)
    assert view.geometry.layer_bytes == 64
    offsets = np.array([r[0] for r in runs], dtype=np.int64)
    template = LayerTemplate(offsets, offsets, np.array([r[1] for r in runs], dtype=np.int64))
    keys, bases = _layer_bases(view, layers)
    naive = Segments(
        np.repeat(keys, len(runs)),
        np.concatenate([offsets + b for b in bases]),
        np.repeat(keys, len(runs)),
        np.concatenate([offsets + b for b in bases]),
        np.tile(template.length, layers),
    )
    expanded = expand_layers(template, view, view, layers)
    _assert_same_segments(expanded, coalesce(naive))
    assert count_segments(template, view, view, layers) == len(expanded)


@pytest.mark.parametrize(
    "strategy,landing",
    [("pack+unpack", False), ("pack+unpack", True), ("pack", True)],
    ids=["pack+unpack", "pack+unpack-landing", "pack-landing"],
)
def test_kernel_strategies_plan_without_enumerating_cells(monkeypatch, strategy, landing):
    """A 32k-token request over 8 + 8 ranks: the kernel strategies' programs, the connectors'
    halves of them and the cost model's counts never enumerate tokens, and each pair's
    program is one segment. (Host time: benchmarks/test_bench_plan.py.)"""

    def enumerating(*args, **kwargs):
        raise AssertionError("the kernel strategies must not enumerate cells or blocks")

    tokens, layers = 32768, 32
    src = side_specs(8, heads=8, block_size=16, num_layers=layers, head_dim=128, num_blocks=4096)
    dst = side_specs(
        8, heads=8, block_size=64, layout="HND", num_layers=layers, head_dim=128, num_blocks=1024
    )
    plans = plan_pairs(src, dst, strategy=strategy, landing=landing)  # estimates every strategy
    for name in ("cell_offsets_in_address_order", "_offsets_in_address_order"):
        monkeypatch.setattr(segments_module, name, enumerating)
    rng = np.random.default_rng(0)
    for plan in plans:
        s, d = src[plan.src_rank], dst[plan.dst_rank]
        src_ids = rng.permutation(s.num_blocks)[: tokens // 16].astype(np.int64)
        dst_ids = rng.permutation(d.num_blocks)[: tokens // 64].astype(np.int64)
        program = build_program(plan.route, strategy, s, d, src_ids, dst_ids, 0, tokens, landing)
        assert len(program.segments) == 1
        assert program.nbytes == layers * 2 * tokens * 128 * 2
        chunk = PairChunk(plan.route, strategy, s, d, 0, tokens, landing)
        assert _same_copy(chunk.pack(src_ids), program.pack)
        assert _same_copy(chunk.unpack(dst_ids), program.unpack)
        shape = chunk.shape(src_ids, dst_ids)
        assert count_program_segments(shape, plan.route, 0, tokens, layers) == 1
        # A partial last block: a handful of runs per layer, still no enumeration.
        partial = build_program(plan.route, strategy, s, d, src_ids, dst_ids, 5, tokens - 3, True)
        assert partial.nbytes == layers * 2 * (tokens - 8) * 128 * 2
