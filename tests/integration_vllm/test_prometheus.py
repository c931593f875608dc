"""kvxfer's metrics on vLLM's Prometheus endpoint, built and fed the way vLLM does it: vLLM's
`PrometheusStatLogger` (the frontend's logger behind `/metrics`) creates them through
`KvxferConnector.build_prom_metrics` and records every `SchedulerStats` the engine core sends;
the values are read back from prometheus_client's default registry, the one vLLM exposes.

The stats come from the real paths: `KvxferConnectorStats.record` of `TransferResult`s, and a
real prefill (TP 1) -> decode (TP 2) transfer under vLLM's Scheduler (`pd_engines`), whose
`SchedulerStats` go through vLLM's msgpack IPC encoding first, with one more request that no
decode engine fetches and that expires on the prefill side. Also: the transport the worker
connector chooses (`protocol: auto`) and says it chose."""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

import pytest
from pd_engines import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    VOCAB,
    Engine,
    EngineSpec,
    kv_cache_config,
    run_until,
    vllm_config,
    write_model,
)
from prometheus_client import REGISTRY

from kvxfer.addresses import free_port_run
from kvxfer.connector import TransferResult
from kvxfer.connector.timeline import PHASES
from kvxfer.integrations.vllm import KvxferConnector, KvxferConnectorStats

# The longest wait for the engines in this module.
_run_until = functools.partial(run_until, timeout=90.0)

COUNTERS = {
    "transfers": "vllm:kvxfer_transfers_total",
    "failures": "vllm:kvxfer_failed_transfers_total",
    "bytes": "vllm:kvxfer_transferred_bytes_total",
    "expired": "vllm:kvxfer_expired_requests_total",
    "streamed": "vllm:kvxfer_streamed_requests_total",
}
SECONDS = "vllm:kvxfer_transfer_time_seconds"
DESCRIPTORS = "vllm:kvxfer_num_descriptors"
PHASE_SECONDS = "vllm:kvxfer_request_phase_seconds"
DECODE_TP = 2
REQUEST_TIMEOUT_S = 6  # the prefill side expires a request nobody loads after this
# What vLLM's toy proxy, vllm-router's NIXL mode and llm-d's nixlv2 sidecar send a prefill
# engine (docs/vllm.md, "Routers"): kvxfer reads `do_remote_decode` and ignores the rest.
NIXL_ROUTER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("model"))


def _spec(role: str = "kv_consumer", extra: dict[str, Any] | None = None) -> EngineSpec:
    return EngineSpec("prom-engine", 1, 16, role, 16, "LBNHC", extra or {})


def _frontend(config: Any, engine_indexes: list[int]) -> Any:
    """vLLM's Prometheus logger for an API server over `engine_indexes`."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    return PrometheusStatLogger(config, engine_indexes)


def _value(name: str, labels: dict[str, str]) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _series(labels: dict[str, str]) -> dict[str, float | None]:
    """Every kvxfer sample of one engine: the counters, the histograms' counts and sums."""
    names = [*COUNTERS.values()]
    names += [f"{h}_{part}" for h in (SECONDS, DESCRIPTORS) for part in ("count", "sum")]
    return {name: _value(name, labels) for name in names}


@pytest.fixture
def clean_registry():
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    yield
    unregister_vllm_metrics()


def test_recorded_results_reach_the_registry_with_vllm_labels(model, clean_registry):
    config = vllm_config(model, _spec())
    # Two decode workers' intervals, from TransferResults as WorkerSide records them.
    first, second = KvxferConnectorStats(), KvxferConnectorStats()
    timeline = {"fetch_asked": 10.0, "fetch_done": 10.004}
    first.record(TransferResult(True, [], 4096, 3, "pack+unpack", 0.004, [], timeline), "r1")
    first.record(TransferResult(False, [7, 8], 0, 0, "", 0.0, ["peer gone"]))
    second.record(TransferResult(True, [], 1 << 20, 40, "direct", 0.3))
    second.record_expired(2)
    second.record_streamed()
    second.record_phases({"kvxfer": 0.002, "total": 0.03})  # the decode scheduler's
    # vLLM's KVOutputAggregator merges the workers; the frontend rebuilds from the dict.
    payload = KvxferConnector.build_kv_connector_stats(first.aggregate(second).to_dict())
    assert payload is not None
    data = payload.to_dict()
    assert data == {
        "transfers": 3,
        "failures": 1,
        "bytes": 4096 + (1 << 20),
        "expired": 2,
        "streamed": 1,
        "transfer_seconds": [0.004, 0.3],
        "descriptors": [3, 40],
        "timelines": [["r1", timeline]],
        "phases": [["kvxfer", 0.002], ["total", 0.03]],
    }
    assert payload.reduce() == {
        "Transfers": 3,
        "Failed transfers": 1,
        "Expired requests": 2,
        "Streamed requests": 1,
        "MB moved": 1.053,
        "Avg transfer ms": 152.0,
        "P90 transfer ms": 270.4,
        "Avg descriptors": 21.5,
        "Throughput MB/s": 3.463,
        "Avg kvxfer share ms": 2.0,
    }

    from vllm.v1.metrics.stats import SchedulerStats

    logger = _frontend(config, [0, 1])
    logger.record(SchedulerStats(kv_connector_stats=data), None, engine_idx=1)
    logger.record(SchedulerStats(kv_connector_stats=data), None, engine_idx=1)  # twice
    served = config.model_config.served_model_name
    engine1 = {"model_name": served, "engine": "1"}
    assert _series(engine1) == {
        COUNTERS["transfers"]: 6.0,
        COUNTERS["failures"]: 2.0,
        COUNTERS["bytes"]: 2.0 * (4096 + (1 << 20)),
        COUNTERS["expired"]: 4.0,
        COUNTERS["streamed"]: 2.0,
        f"{SECONDS}_count": 4.0,
        f"{SECONDS}_sum": pytest.approx(2 * 0.304),
        f"{DESCRIPTORS}_count": 4.0,
        f"{DESCRIPTORS}_sum": 86.0,
    }
    # Buckets: 4 ms lies in (2.5 ms, 5 ms], 300 ms in (250 ms, 500 ms].
    for le, count in (("0.0025", 0), ("0.005", 2), ("0.25", 2), ("0.5", 4), ("+Inf", 4)):
        assert _value(f"{SECONDS}_bucket", {**engine1, "le": le}) == count, le
    for le, count in (("2.0", 0), ("4.0", 2), ("32.0", 2), ("64.0", 4), ("+Inf", 4)):
        assert _value(f"{DESCRIPTORS}_bucket", {**engine1, "le": le}) == count, le
    # Phases: one series per phase; 2 ms lies in (1 ms, 2.5 ms].
    kvxfer = {**engine1, "phase": "kvxfer"}
    assert _value(f"{PHASE_SECONDS}_count", kvxfer) == 2.0
    assert _value(f"{PHASE_SECONDS}_bucket", {**kvxfer, "le": "0.001"}) == 0.0
    assert _value(f"{PHASE_SECONDS}_bucket", {**kvxfer, "le": "0.0025"}) == 2.0
    assert _value(f"{PHASE_SECONDS}_sum", {**engine1, "phase": "total"}) == pytest.approx(0.06)
    assert _value(f"{PHASE_SECONDS}_count", {**engine1, "phase": "read"}) == 0.0
    # Engine 0's series exist (created per engine, as vLLM's own) and stay at zero.
    engine0 = {"model_name": served, "engine": "0"}
    assert set(_series(engine0).values()) == {0.0}


def test_an_empty_interval_is_empty_and_adds_nothing(model, clean_registry):
    stats = KvxferConnectorStats()
    assert stats.is_empty()
    stats.record_expired(0)
    assert stats.is_empty()
    stats.record_expired(1)
    assert not stats.is_empty()
    config = vllm_config(model, _spec())
    logger = _frontend(config, [0])
    from vllm.v1.metrics.stats import SchedulerStats

    empty = SchedulerStats(kv_connector_stats=KvxferConnectorStats().data)
    logger.record(empty, None, engine_idx=0)
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}
    assert set(_series(labels).values()) == {0.0}


@pytest.mark.parametrize("machine", ["rdma", "none"])
def test_the_worker_connector_says_which_transport_auto_chose(
    model, machine, tmp_path, monkeypatch, caplog
):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    sysfs = tmp_path / "infiniband"
    if machine == "rdma":
        (sysfs / "mlx5_0").mkdir(parents=True)
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(sysfs))
    spec = _spec()
    config = vllm_config(model, spec)
    with caplog.at_level(logging.INFO, logger="kvxfer"):
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config(spec, config)
        )
    # Nothing registered, so no transport was started: the choice alone is checked here.
    want = "rdma" if machine == "rdma" else "tcp"
    assert connector._worker.protocol == want
    lines = [r.getMessage() for r in caplog.records if "transport" in r.getMessage()]
    why = "RDMA devices mlx5_0" if machine == "rdma" else f"no RDMA device in {sysfs}"
    assert lines == [f"kvxfer rank 0: transport {want} (protocol: auto; {why})"]
    # An explicit protocol is kept, whatever the machine has.
    explicit = vllm_config(model, _spec(extra={"protocol": "tcp"}))
    connector = KVConnectorFactory.create_connector(
        explicit, KVConnectorRole.WORKER, kv_cache_config(spec, explicit)
    )
    assert connector._worker.protocol == "tcp"


# ---- a real transfer -------------------------------------------------------------------------


def _capture_scheduler_stats(engine: Engine) -> list[Any]:
    """Every `SchedulerStats` the engine's Scheduler hands the frontend, sent through vLLM's
    msgpack encoding of `EngineCoreOutputs` as between the engine core and the API server."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    captured: list[Any] = []
    update = engine.scheduler.update_from_output

    def update_and_capture(*args: Any, **kwargs: Any) -> Any:
        outputs = update(*args, **kwargs)
        for core_outputs in outputs.values():
            if core_outputs.scheduler_stats is not None:
                received = decoder.decode(encoder.encode(core_outputs))
                captured.append(received.scheduler_stats)
        return outputs

    engine.scheduler.update_from_output = update_and_capture
    return captured


def test_a_real_transfer_and_an_expired_request_on_vllms_endpoint(model, clean_registry):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    common = {"cost_model": "tcp_loopback", "secret": "prom", "protocol": "tcp"}
    port = free_port_run(1)
    prefill_extra = {**common, "side_channel_port": port, "request_timeout_s": REQUEST_TIMEOUT_S}
    prefill_spec = EngineSpec("prom-prefill", 1, 16, "kv_producer", 32, "LBNHC", prefill_extra)
    decode_spec = EngineSpec("prom-decode", DECODE_TP, 32, "kv_consumer", 32, "LBHNC", common)
    prefill, decode = Engine(model, prefill_spec), Engine(model, decode_spec)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        prefill_stats = _capture_scheduler_stats(prefill)
        decode_stats = _capture_scheduler_stats(decode)
        rng = random.Random(7)
        prompts = {r: [rng.randrange(VOCAB) for _ in range(n)] for r, n in (("a", 70), ("b", 20))}
        for request_id, prompt in prompts.items():
            prefill.add(request_id, prompt, max_tokens=1, params=dict(NIXL_ROUTER_PARAMS))
        params: dict[str, dict] = {}

        def collect(engine, outputs):
            for o in outputs:
                if o.finish_reason is not None:
                    params[o.request_id] = o.kv_transfer_params

        _run_until(lambda: len(params) == 2, [prefill], on_step=collect)
        # "a" goes on to the decode engine; "b" is never loaded and expires on the prefill side.
        decode.add("a", prompts["a"], max_tokens=2, params=params["a"])
        decoded: set[str] = set()

        def decode_done(engine, outputs):
            decoded.update(o.request_id for o in outputs if o.finish_reason is not None)

        _run_until(lambda: "a" in decoded, [decode, prefill], on_step=decode_done)
        assert "a" in decode.finished_recving
        assert decode.invalid_block_ids == []
        _run_until(lambda: {"a", "b"} <= prefill.finished_sending, [decode, prefill], timeout=60)
    finally:
        decode.close()
        prefill.close()

    nbytes = len(prompts["a"]) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # bf16, every head
    decode_payloads = [s.kv_connector_stats for s in decode_stats if s.kv_connector_stats]
    seconds = [v for p in decode_payloads for v in p["transfer_seconds"]]
    descriptors = [v for p in decode_payloads for v in p["descriptors"]]
    assert len(seconds) == len(descriptors) == DECODE_TP  # one load per decode rank
    assert all(s > 0 for s in seconds) and all(d >= 1 for d in descriptors)

    # The decode instance's API server: its /metrics, and its log line.
    config = vllm_config(model, decode_spec)
    logger = _frontend(config, [0])
    logging_side = KVConnectorLogging(config.kv_transfer_config)
    for stats in decode_stats:
        logger.record(stats, None, engine_idx=0)
        if stats.kv_connector_stats is not None:
            logging_side.observe(stats.kv_connector_stats)
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}
    assert _series(labels) == {
        COUNTERS["transfers"]: DECODE_TP,
        COUNTERS["failures"]: 0.0,
        COUNTERS["bytes"]: nbytes,
        COUNTERS["expired"]: 0.0,
        COUNTERS["streamed"]: 0.0,
        f"{SECONDS}_count": DECODE_TP,
        f"{SECONDS}_sum": pytest.approx(sum(seconds)),
        f"{DESCRIPTORS}_count": DECODE_TP,
        f"{DESCRIPTORS}_sum": sum(descriptors),
    }
    assert _value(f"{SECONDS}_bucket", {**labels, "le": "60.0"}) == DECODE_TP
    # Request "a"'s timeline: every event seen (both engines', both decode ranks'), so every
    # phase counted once, at its first token.
    for phase in PHASES:
        assert _value(f"{PHASE_SECONDS}_count", {**labels, "phase": phase}) == 1.0, phase
    total = _value(f"{PHASE_SECONDS}_sum", {**labels, "phase": "total"})
    kvxfer = _value(f"{PHASE_SECONDS}_sum", {**labels, "phase": "kvxfer"})
    assert total is not None and kvxfer is not None and 0 < kvxfer < total
    logged: list[str] = []
    logging_side.log(log_fn=lambda fmt, *args: logged.append(fmt % args))
    (line,) = logged
    assert line.startswith(f"KV Transfer metrics: Transfers={DECODE_TP}, Failed transfers=0, ")
    assert f"MB moved={round(nbytes / 1e6, 3)}" in line

    # The prefill instance's API server: the request nobody loaded, and no loads.
    config = vllm_config(model, prefill_spec)
    logger = _frontend(config, [0])
    for stats in prefill_stats:
        logger.record(stats, None, engine_idx=0)
    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}
    got = _series(labels)
    assert got[COUNTERS["expired"]] == 1.0
    assert {v for k, v in got.items() if k != COUNTERS["expired"]} == {0.0}
