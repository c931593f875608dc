"""Producer and consumer ranks in separate processes move KV through Mooncake TCP on
127.0.0.1, every destination rank checked bit for bit (and every other block untouched)."""

from __future__ import annotations

import pytest

from kvxfer.testing import Geometry, Request, run_cluster

# Small staging so that requests go in several chunks and pools are reused.
STAGING = {"staging_bytes": 8192, "staging_slots": 2}


def assert_exact(run, request: Request, dst: Geometry) -> None:
    for rank in range(dst.ranks):
        r = run.result(request.request_id, rank)
        assert r["ok"], (rank, r["errors"])
        assert r["failed_block_ids"] == []
        assert r["bad_blocks"] == [], (rank, r["bad_blocks"][:5])
        assert r["untouched_ok"], f"rank {rank} wrote outside the request's blocks"


def assert_pools_whole_and_released(run, requests, src: Geometry, dst: Geometry) -> None:
    for report in run.producers:
        released = sorted(rid for _, rid in report["releases"])
        ranks = {rank for rank, _ in report["releases"]} | set(report["pending"])
        assert released == sorted(r.request_id for r in requests for _ in ranks)  # once each
        assert all(p == [] for p in report["pending"].values())
        for pools in report["free_slots"].values():
            assert all(free == report["slots"] for free in pools.values())
    for rank in range(dst.ranks):
        assert all(
            free == STAGING["staging_slots"]
            for free in run.consumers[f"free_slots/{rank}"].values()
        )


PAIRS = [
    pytest.param(Geometry(2, heads=4), Geometry(4, heads=4, layout="HND"), id="P2-D4"),
    pytest.param(
        Geometry(4, heads=4, layout="HND"),
        Geometry(2, heads=4, placement="blocks_first"),
        id="P4-D2",
    ),
    pytest.param(
        Geometry(3, heads=12, block_size=16),
        Geometry(4, heads=12, block_size=48, layout="HND"),
        id="P3-D4-bs16-bs48",
    ),
    pytest.param(Geometry(1, heads=2), Geometry(8, heads=2, block_size=8), id="P1-D8-replicated"),
    pytest.param(
        Geometry(2, heads=4, block_size=16),
        Geometry(2, heads=4, block_size=64, num_blocks=32),
        id="P2-D2-bs16-bs64",
    ),
    pytest.param(
        Geometry(4, mla=True, head_dim=16),
        Geometry(2, mla=True, head_dim=16, block_size=32),
        id="MLA-P4-D2",
    ),
    pytest.param(  # fp8 caches move as bytes; 5-byte heads leave no wider word
        Geometry(2, heads=4, head_dim=5, dtype="float8_e4m3fn"),
        Geometry(4, heads=4, head_dim=5, block_size=32, layout="HND", dtype="float8_e4m3fn"),
        id="P2-D4-fp8-e4m3-d5",
    ),
    # vLLM CPU attention's layout (K dim-major) on either side and on both, block sizes changed
    pytest.param(
        Geometry(1, heads=4, block_size=32, layout="HND", placement="k_transposed", num_blocks=32),
        Geometry(2, heads=4, block_size=64, layout="HND", placement="k_transposed", num_blocks=16),
        id="CPU-P1-D2-bs32-bs64",
    ),
    pytest.param(
        Geometry(2, heads=4, block_size=64, layout="HND", placement="k_transposed", num_blocks=16),
        Geometry(4, heads=4, block_size=16),
        id="CPU-P2-GPU-D4-bs64-bs16",
    ),
    pytest.param(
        Geometry(4, heads=4, block_size=16, layout="HND", placement="kv_inner"),
        Geometry(1, heads=4, block_size=32, layout="HND", placement="k_transposed", num_blocks=32),
        id="GPU-P4-CPU-D1-bs16-bs32",
    ),
]


@pytest.mark.parametrize("src,dst", PAIRS)
def test_hetero_tp_transfer_is_exact(src, dst):
    requests = [Request("r-full", 200, seed=1), Request("r-prefix", 173, start_token=37, seed=2)]
    run = run_cluster(src, dst, requests, producer_options=STAGING, consumer_options=STAGING)
    for request in requests:
        assert_exact(run, request, dst)
    assert_pools_whole_and_released(run, requests, src, dst)
    stats = run.consumers["stats/0"]
    assert stats["count"] == 2 and stats["failures"] == 0 and stats["bytes"] > 0


@pytest.mark.parametrize("strategy", ["direct", "pack", "unpack", "pack+unpack"])
def test_every_strategy_forced(strategy):
    src, dst = (
        Geometry(3, heads=12, block_size=16),
        Geometry(4, heads=12, block_size=32, layout="HND"),
    )
    requests = [Request("r", 150, start_token=9, seed=3)]
    # Mirrors of 32-token blocks need whole blocks: 16 KiB slots hold two (a 33-token chunk).
    staging = {"staging_bytes": 32768, "staging_slots": 2}
    run = run_cluster(
        src,
        dst,
        requests,
        producer_options=staging,
        consumer_options={**staging, "strategy": strategy},
    )
    assert_exact(run, requests[0], dst)
    assert {run.result("r", rank)["strategy"] for rank in range(dst.ranks)} == {strategy}


# Pipeline parallelism on either side (ranks are engine ranks, pp-major).
PIPELINES = [
    pytest.param(  # each decode rank fetches its heads of every layer from both prefill stages
        Geometry(2, heads=4, pp=2, layers=3),
        Geometry(4, heads=4, layout="HND", layers=3),
        {r: {(0, 0), (2, 2)} if r < 2 else {(1, 0), (3, 2)} for r in range(4)},
        id="P-PP2xTP2-D-PP1xTP4",
    ),
    pytest.param(  # each decode stage fetches its own layers only, from both prefill ranks
        Geometry(2, heads=4, layers=3),
        Geometry(1, heads=4, pp=2, block_size=32, placement="blocks_first", layers=3),
        {0: {(0, 0), (1, 0)}, 1: {(0, 2), (1, 2)}},
        id="P-PP1xTP2-D-PP2xTP1",
    ),
]


@pytest.mark.parametrize("src,dst,sources", PIPELINES)
def test_hetero_pipeline_transfer_is_exact(src, dst, sources):
    requests = [Request("r-full", 150, seed=6), Request("r-prefix", 120, start_token=23, seed=7)]
    run = run_cluster(src, dst, requests, producer_options=STAGING, consumer_options=STAGING)
    for request in requests:
        assert_exact(run, request, dst)
    assert_pools_whole_and_released(run, requests, src, dst)
    for rank, want in sources.items():  # (source rank, first layer) of each pair
        assert {(s, layer) for s, layer, _ in run.consumers[f"pairs/{rank}"]} == want


def test_every_rank_in_its_own_process():
    src, dst = Geometry(2, heads=4), Geometry(4, heads=4, block_size=32, layout="HND")
    requests = [Request("r", 120, seed=4)]
    run = run_cluster(
        src,
        dst,
        requests,
        producer_options=STAGING,
        consumer_options=STAGING,
        process_per_rank=True,
    )
    assert_exact(run, requests[0], dst)


def test_producer_killed_mid_transfer_reports_the_missing_blocks():
    src, dst = (
        Geometry(1, heads=2, layers=2, num_blocks=300),
        Geometry(1, heads=2, block_size=16, num_blocks=300),
    )
    request = Request("big", 4096, seed=5)
    tiny = {"staging_bytes": 1024, "staging_slots": 1}  # 8 tokens a chunk: hundreds of chunks
    run = run_cluster(
        src,
        dst,
        [request],
        producer_options=tiny,
        consumer_options={**tiny, "fetch_timeout": 3.0, "strategy": "pack+unpack"},
        kill_producers_mid_transfer=True,
    )
    r = run.result("big", 0)
    assert not r["ok"]
    assert r["failed_block_ids"], "a killed producer must surface as failed blocks"
    assert set(r["failed_block_ids"]) <= set(r["request_blocks"])
    assert len(r["failed_block_ids"]) < len(r["request_blocks"])  # some chunks did land
    assert r["bad_blocks"] == []  # every block not reported failed is exact
    assert r["untouched_ok"]
