"""Heterogeneous pipeline parallelism under vLLM's Scheduler: prefill PP 2 x TP 2 -> decode
PP 1 x TP 4, prefill PP 1 x TP 2 -> decode PP 2 x TP 1, PP 2 -> PP 2 (TP 2 -> 1), and prefill
DP 2 x PP 2 x TP 1 -> decode PP 1 x TP 4 (data and pipeline parallelism together), over a
5-layer model that vLLM splits 3 + 2, with 8 KV heads, different block sizes and layouts.

Each engine runs vLLM's Scheduler once, and a worker process per (PP rank, TP rank) that
allocates the KV tensors of its stage's layers only, under their names, with vLLM's parallel
config (`pipeline_parallel_size`) telling its connector its stage. Every worker reports its own
finished transfers; vLLM's `KVOutputAggregator` (expecting the engine's `pp * tp` workers)
lets a request through only once all of them did: on prefill, every stage's workers report a
request finished sending once the decode engine's ranks are done with it; on decode, every
stage's workers report their layers loaded. Checked: every decode worker's KV bit for bit (its
layers, its heads), the aggregation, and every block back on both sides. Runs in the separate
vLLM environment (`make test-vllm`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
from pd_engines import (
    HEAD_DIM,
    MODEL,
    Engine,
    EngineSpec,
    load_and_check,
    prefill_remote,
    random_prompt,
    run_until,
    running,
    write_model,
)

from kvxfer.addresses import free_port_run
from kvxfer.integrations.bootstrap import BootstrapClient

# The longest wait for the engines in this module.
_run_until = functools.partial(run_until, timeout=60.0)

LAYERS, KV_HEADS = 5, 8  # vLLM splits 5 layers over 2 stages as [0, 3) and [3, 5)
PP_MODEL = {
    **MODEL,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 16,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": LAYERS,
}
COMMON = {"cost_model": "tcp_loopback", "secret": "s3cret"}
DECODE_EXTRA = {**COMMON, "fetch_timeout_s": 20, "handshake_timeout_s": 5}


@dataclass
class Engines:
    prefill_pp2: Engine  # PP 2 x TP 2, blocks of 16, LBNHC, fixed side-channel ports
    prefill_pp1: Engine  # PP 1 x TP 2, blocks of 16, LBHNC, free ports
    decode_tp4: Engine  # PP 1 x TP 4, blocks of 32, LBHNC
    decode_pp2: Engine  # PP 2 x TP 1, blocks of 32, LBNHC
    port: int  # prefill_pp2's first side-channel port


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("model"), PP_MODEL)
    port = free_port_run(4)
    fixed = {**COMMON, "side_channel_port": port}
    specs = [
        EngineSpec("prefill-pp2", 2, 16, "kv_producer", 64, "LBNHC", fixed, pp=2),
        EngineSpec("prefill-pp1", 2, 16, "kv_producer", 64, "LBHNC", COMMON),
        EngineSpec("decode-tp4", 4, 32, "kv_consumer", 48, "LBHNC", DECODE_EXTRA),
        EngineSpec("decode-pp2", 1, 32, "kv_consumer", 48, "LBNHC", DECODE_EXTRA, pp=2),
    ]
    started = [Engine(model, spec) for spec in specs]  # every worker imports vLLM at once
    try:
        for engine in started:
            engine.wait_ready()
        yield Engines(*started, port)
    finally:
        for engine in started[::-1]:
            engine.close()


def _prefill(prefill: Engine, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """Prefill prompts for remote decode; their kv_transfer_params once every prefill worker
    (every stage) has published them."""
    params = prefill_remote(prefill, prompts, timeout=60.0)
    prefill.step()  # the step whose metadata publishes them
    for request_id, prompt in prompts.items():
        handed = params[request_id]
        assert handed["remote_engine_id"] == prefill.spec.engine_id
        assert handed["remote_dp_rank"] == prefill.spec.dp_rank
        assert (handed["tp_size"], handed["pp_size"]) == (prefill.spec.tp, prefill.spec.pp)
        assert handed["remote_num_tokens"] == len(prompt)
    return params


def _decode(decode: Engine, prefill: Engine, loads: dict[str, tuple[list, dict]]) -> None:
    """Load requests on a decode engine: KV bit-exact on every decode worker (each stage's
    layers, each rank's heads) as soon as vLLM learns a load finished, no load error; then
    finish them, the prefill engine reports them finished sending, and both give every block
    back. Both aggregations are checked: each of the engine's workers reported each request
    once, and vLLM let it through in the step of the last report, not before."""
    errors = len(decode.invalid_block_ids)
    stats_before = len(decode.stats)
    what = f"(loads {sorted(loads)} on {decode.spec.name} from {prefill.spec.name})"
    seen = load_and_check(decode, [prefill], loads, 60.0, what=what)
    world = decode.spec.world_size
    assert seen.checked == {r: [[]] * world for r in loads}, "KV differs on a decode worker"
    assert decode.invalid_block_ids[errors:] == [], "a load failed"
    for engine, kind in ((decode, "recving"), (prefill, "sending")):
        for request_id in loads:
            reports = engine.worker_reports[kind, request_id]
            assert sorted(rank for _, rank in reports) == list(range(engine.spec.world_size))
            assert engine.aggregated_at[kind, request_id] == max(step for step, _ in reports)
    stats = decode.stats[stats_before:]
    totals = {k: sum(s[k] for s in stats) for k in ("transfers", "failures", "bytes")}
    # One load per request on each decode worker; together they move every head of every
    # layer once (bf16).
    tokens = sum(len(prompt) for prompt, _ in loads.values())
    assert totals == {
        "transfers": len(loads) * world,
        "failures": 0,
        "bytes": tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2,
    }
    for engine in (decode, prefill):
        assert engine.free_blocks() == engine.free_blocks_at_start, engine.spec.name


def test_pp_workers_register_by_stage_at_their_fixed_ports(engines):
    prefill = engines.prefill_pp2
    bootstrap = f"http://127.0.0.1:{prefill.spec.extra['bootstrap_port']}"
    workers = BootstrapClient(bootstrap).lookup("prefill-pp2", 0, timeout_s=30)
    # Every stage's workers, pp-major; each at base + pp * tp_size + tp.
    assert [(w.pp_rank, w.tp_rank) for w in workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [w.address for w in workers] == [
        f"tcp://127.0.0.1:{engines.port + rank}" for rank in range(4)
    ]
    assert all((w.tp_size, w.pp_size) == (2, 2) for w in workers)
    layers = [(w.geometry["layer_start"], w.geometry["num_layers"]) for w in workers]
    assert layers == [(0, 3), (0, 3), (3, 2), (3, 2)]  # vLLM's split of 5 layers
    assert {w.geometry["total_layers"] for w in workers} == {LAYERS}
    # vLLM's executor then expects a report from each of its world_size workers, every stage's.
    for engine in (prefill, engines.decode_pp2):
        assert engine.scheduler.get_kv_connector().get_finished_count() is None


def test_prefill_pp2_tp2_to_decode_pp1_tp4(engines):
    """Each decode rank reads its 2 heads of layers 0-2 from stage 0's rank holding them and of
    layers 3-4 from stage 1's."""
    prompts = {
        "pp2-a": random_prompt(1, 45),
        "pp2-b": random_prompt(2, 100),
        "pp2-c": random_prompt(3, 17),
    }
    params = _prefill(engines.prefill_pp2, prompts)
    loads = {r: (prompts[r], params[r]) for r in prompts}
    _decode(engines.decode_tp4, engines.prefill_pp2, loads)


def test_prefill_pp1_tp2_to_decode_pp2_tp1(engines):
    """Each decode stage reads its layers, every head, from both prefill ranks."""
    prompts = {"pp1-a": random_prompt(4, 70), "pp1-b": random_prompt(5, 33)}
    params = _prefill(engines.prefill_pp1, prompts)
    assert all(p["pp_size"] == 1 for p in params.values())
    _decode(engines.decode_pp2, engines.prefill_pp1, {r: (prompts[r], params[r]) for r in prompts})


def test_prefill_pp2_to_decode_pp2_at_fixed_ports_without_the_bootstrap_service(engines):
    """Parameters without `remote_bootstrap_addr` (built by hand, or by an older kvxfer): the
    decode workers connect to `remote_port + p * tp_size + t` for every prefill stage."""
    prompts = {"fixed-a": random_prompt(6, 64), "fixed-b": random_prompt(7, 29)}
    params = _prefill(engines.prefill_pp2, prompts)
    for handed in params.values():
        assert (handed["remote_host"], handed["remote_port"]) == ("127.0.0.1", engines.port)
        del handed["remote_bootstrap_addr"]
    loads = {r: (prompts[r], params[r]) for r in prompts}
    _decode(engines.decode_pp2, engines.prefill_pp2, loads)


@pytest.fixture(scope="module")
def dp_pp_prefill(tmp_path_factory):
    """A prefill engine with DP 2 x PP 2 x TP 1: one engine per DP rank (as vLLM runs them),
    each with a worker per stage, both DP ranks registering with one bootstrap service."""
    model = write_model(tmp_path_factory.mktemp("dp-pp-model"), PP_MODEL)
    extra = {**COMMON, "bootstrap_port": free_port_run(1)}
    started = [
        Engine(
            model,
            EngineSpec(
                "prefill-dppp",
                1,
                16,
                "kv_producer",
                64,
                "LBNHC",
                extra,
                dp_rank=dp,
                dp_size=2,
                pp=2,
            ),
        )
        for dp in range(2)
    ]
    with running(started) as engines:
        yield engines


def test_prefill_dp2_pp2_to_decode_pp1_tp4(engines, dp_pp_prefill):
    """Data and pipeline parallelism together: each request's parameters name its DP rank; a
    decode rank finds that DP rank's two stages through the bootstrap service and reads layers
    0-2 from stage 0 and 3-4 from stage 1, its 2 heads of 8 from the one TP rank."""
    bootstrap = f"http://127.0.0.1:{dp_pp_prefill[0].spec.extra['bootstrap_port']}"
    client = BootstrapClient(bootstrap)
    for dp, prefill in enumerate(dp_pp_prefill):
        workers = client.lookup(prefill.spec.engine_id, dp, timeout_s=30)
        assert [(w.pp_rank, w.tp_rank) for w in workers] == [(0, 0), (1, 0)]
        prompts = {f"dppp{dp}-a": random_prompt(40 + dp, 52), f"dppp{dp}-b": random_prompt(50, 23)}
        params = _prefill(prefill, prompts)
        assert {p["remote_bootstrap_addr"] for p in params.values()} == {bootstrap}
        _decode(engines.decode_tp4, prefill, {r: (prompts[r], params[r]) for r in prompts})
