"""`KvxferECConnector` created by vLLM's own EC connector factory in both roles: an encoder
instance's worker saves an item's output, a prefill instance's scheduler finds it and its
worker loads it bit for bit through kvxfer's Mooncake encoder-cache connector (TCP loopback).

The fault tests drive vLLM's real `Scheduler` (its encoder-cache connector made by vLLM from
the config) with a stand-in model runner that does what vLLM's does around the encoder: bind
the metadata, `start_load_caches`, encode what the scheduler scheduled, and raise "Encoder cache
miss" when a scheduled position's encoder output is missing (which ends a real engine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, ClassVar

import pytest
import torch
from pd_engines import MULTIMODAL_MODEL, write_model

from kvxfer.addresses import free_port_run, unused_address
from kvxfer.ec import ECConnectorFactory
from kvxfer.ec.shared_storage import SharedStorageECConnector
from kvxfer.testing import wait_until
from kvxfer.testing.signals import freeze

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
HIDDEN = 192  # the text model's hidden size: one row per image token
EMBEDS = 8  # image tokens per item in these requests


def _config(model_dir: str, role: str, extra: dict):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ECTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
        ),
        cache_config=CacheConfig(block_size=16),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=1024,
            max_num_seqs=16,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        ec_transfer_config=ECTransferConfig(
            ec_connector="KvxferECConnector",
            ec_connector_module_path="kvxfer.integrations.vllm",
            ec_role=role,
            ec_connector_extra_config=extra,
        ),
    )
    config.cache_config.num_gpu_blocks = 256
    config.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves
    return config


def _request(request_id: str, identifiers: list[str], block_hasher=None):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=2 + 10 * i, length=EMBEDS),
        )
        for i, identifier in enumerate(identifiers)
    ]
    prompt = list(range(2 + 10 * len(identifiers)))
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=1, ignore_eos=True),
        None,
        mm_features=features,
        block_hasher=block_hasher,
    )


def _output(seed: int) -> torch.Tensor:
    return torch.randn(EMBEDS, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), MULTIMODAL_MODEL)


def test_encoder_output_moves_from_encoder_to_prefill_instance(model_dir):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory as VF

    port = free_port_run(1)
    secret = "encoder-cache secret"  # proved by challenge-response, never sent
    producer_cfg = _config(
        model_dir,
        "ec_producer",
        {"backend": "PoolECConnector", "port": port, "secret": secret},
    )
    consumer_cfg = _config(
        model_dir,
        "ec_consumer",
        {
            "backend": "PoolECConnector",
            "producer_addresses": [f"tcp://127.0.0.1:{port}"],
            "secret": secret,
        },
    )
    encoder_worker = VF.create_connector(producer_cfg, ECConnectorRole.WORKER)
    scheduler = VF.create_connector(consumer_cfg, ECConnectorRole.SCHEDULER)
    prefill_worker = VF.create_connector(consumer_cfg, ECConnectorRole.WORKER)
    try:
        output, lora = _output(5), _output(6)
        encoder_worker.save_caches({"img-1": output}, "img-1")
        # a LoRA-prefixed identifier (vLLM's "name:hash") is not a file-safe hash: mapped
        encoder_worker.save_caches({"lora1:img-3": lora}, "lora1:img-3")

        request = _request("req-1", ["img-1", "img-2", "lora1:img-3"])
        assert scheduler.has_cache_item("img-1") is False  # nothing fetched yet
        assert scheduler.ensure_cache_available(request, 0) is False  # fetching
        wait_until(lambda: scheduler.ensure_cache_available(request, 0), 10.0, "the cache")
        assert scheduler.has_cache_item("img-1") is True
        assert scheduler.has_cache_item("img-2") is False  # never encoded: computed locally
        assert scheduler.take_unavailable_requests() == set()
        for index in range(3):
            scheduler.update_state_after_alloc(request, index)
        metadata = scheduler.build_connector_meta(None)
        assert metadata.mm_hashes == ["img-1", "lora1:img-3"]
        assert os.path.isdir(metadata.relay_dir)

        encoder_cache: dict[str, torch.Tensor] = {}
        prefill_worker.bind_connector_metadata(metadata)
        prefill_worker.start_load_caches(encoder_cache)
        prefill_worker.clear_connector_metadata()
        assert set(encoder_cache) == {"img-1", "lora1:img-3"}
        assert _same(encoder_cache["img-1"], output)
        assert _same(encoder_cache["lora1:img-3"], lora)

        # a worker that cannot see the relay (another host) loads from the producer
        from kvxfer.integrations.vllm import KvxferECConnectorMetadata

        elsewhere: dict[str, torch.Tensor] = {}
        prefill_worker.bind_connector_metadata(
            KvxferECConnectorMetadata(mm_hashes=["img-1"], relay_dir="/nonexistent/relay")
        )
        prefill_worker.start_load_caches(elsewhere)
        prefill_worker.clear_connector_metadata()
        assert _same(elsewhere["img-1"], output)

        assert scheduler.request_finished(request) == (False, None)
        assert os.listdir(metadata.relay_dir) == []  # relay files go with their requests
    finally:
        for connector in (prefill_worker, scheduler, encoder_worker):
            connector.shutdown()
    assert not os.path.exists(metadata.relay_dir)


def test_ec_both_is_refused_with_the_fix(model_dir):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory as VF

    config = _config(model_dir, "ec_both", {"backend": "SharedStorageECConnector"})
    with pytest.raises(ValueError, match=r"'ec_producer'.*'ec_consumer'"):
        VF.create_connector(config, ECConnectorRole.SCHEDULER)


# ---- vLLM's Scheduler, faults ---------------------------------------------------------------


class VanishingStore(SharedStorageECConnector):
    """Shared storage where some items disappear right after `has` said they are there."""

    VANISH: ClassVar[set[str]] = set()

    def _has(self, mm_hash: str) -> bool:
        held = super()._has(mm_hash)
        if held and mm_hash in self.VANISH:
            self.file_of(mm_hash).unlink()  # evicted, deleted by another consumer, ...
        return held


class _Budget:
    """vLLM's MultiModalBudget without the HF processor (it needs a tokenizer on disk)."""

    def __init__(self, vllm_config: Any, mm_registry: Any) -> None:
        self.encoder_compute_budget = 1024
        self.encoder_cache_size = 1024
        self.mm_max_toks_per_item = {"image": EMBEDS}


class Prefill:
    """vLLM's Scheduler for a prefill instance and a stand-in model runner (one rank)."""

    def __init__(self, model_dir: str, extra: dict, monkeypatch: pytest.MonkeyPatch) -> None:
        import vllm.v1.core.sched.scheduler as sched
        from pd_engines import EngineSpec, kv_cache_config
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory as VF
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        monkeypatch.setattr(sched, "MultiModalBudget", _Budget)
        config = _config(model_dir, "ec_consumer", extra)
        spec = EngineSpec("prefill", 1, 16, "kv_consumer", 256, "LBNHC")
        self.scheduler = sched.Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config(spec, config),
            structured_output_manager=StructuredOutputManager(config),
            block_size=16,
            log_stats=False,
        )
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(16, hash_fn, 0)
        self.worker = VF.create_connector(config, ECConnectorRole.WORKER)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.used: dict[str, torch.Tensor] = {}  # identifier -> what the forward pass saw
        self.encoded_locally: set[str] = set()
        self.finished: dict[str, Any] = {}
        self.schedule_seconds: list[float] = []

    def add(self, request_id: str, identifiers: list[str]) -> None:
        self.scheduler.add_request(_request(request_id, identifiers, self.block_hasher))

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        t0 = time.monotonic()
        out = self.scheduler.schedule()
        self.schedule_seconds.append(time.monotonic() - t0)
        sampled: dict[str, list[int]] = {}
        if out.total_num_scheduled_tokens:  # vLLM runs no EC hooks on an empty step
            self.worker.bind_connector_metadata(out.ec_connector_metadata)
            self.worker.start_load_caches(self.encoder_cache)
            for req_id, inputs in out.scheduled_encoder_inputs.items():
                request = self.scheduler.requests[req_id]
                for i in inputs:  # "encode" locally what the scheduler scheduled
                    identifier = request.mm_features[i].identifier
                    self.encoder_cache[identifier] = torch.full((EMBEDS, HIDDEN), -1.0)
                    self.encoded_locally.add(identifier)
            started = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
            cached = out.scheduled_cached_reqs
            started.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for req_id, count in out.num_scheduled_tokens.items():
                request = self.scheduler.requests[req_id]
                start = started[req_id]
                for feature in request.mm_features:  # _gather_mm_embeddings
                    pos = feature.mm_position
                    if pos.offset < start + count and start < pos.offset + pos.length:
                        got = self.encoder_cache.get(feature.identifier)
                        if got is None:
                            raise RuntimeError(f"Encoder cache miss for {feature.identifier}.")
                        self.used[feature.identifier] = got
                if start + count >= request.num_prompt_tokens:
                    sampled[req_id] = [7]
            self.worker.clear_connector_metadata()
        for identifier in out.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        req_ids = list(sampled)
        result = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
        )
        for group in self.scheduler.update_from_output(out, result).values():
            for output in group.outputs:
                if output.finish_reason is not None:
                    self.finished[output.request_id] = output.finish_reason

    def run(self, request_ids: set[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not request_ids <= set(self.finished):
            assert time.monotonic() < deadline, f"unfinished: {request_ids - set(self.finished)}"
            self.step()
            time.sleep(0.002)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def test_an_item_gone_between_check_and_load_fails_only_its_requests(
    model_dir, tmp_path, monkeypatch
):
    from vllm.v1.engine import FinishReason

    store = str(tmp_path / "store")
    encoder = SharedStorageECConnector("producer", {"path": store})
    ok, gone = _output(1), _output(2)
    encoder.save("img-ok", ok)
    encoder.save("img-gone", gone)
    VanishingStore.VANISH = {"img-gone"}
    extra = {"backend": "VanishingStore", "backend_module_path": __name__, "path": store}
    prefill = Prefill(model_dir, extra, monkeypatch)
    try:
        prefill.add("r-ok", ["img-ok"])
        prefill.add("r-gone", ["img-gone"])
        prefill.add("r-both", ["img-ok", "img-gone"])
        prefill.add("r-local", ["img-local"])  # no producer has it: encoded here
        prefill.run({"r-ok", "r-gone", "r-both", "r-local"})
        assert prefill.finished == {
            "r-ok": FinishReason.LENGTH,
            "r-gone": FinishReason.ERROR,  # vLLM's retryable per-request error
            "r-both": FinishReason.ERROR,
            "r-local": FinishReason.LENGTH,
        }
        assert _same(prefill.used["img-ok"], ok)  # bit for bit from the encoder instance
        assert prefill.encoded_locally == {"img-local"}
        assert "img-gone" not in prefill.used  # no forward pass ever saw a stand-in

        VanishingStore.VANISH = set()  # re-issued once the encoder stored it again
        encoder.save("img-gone", gone)
        prefill.add("r-retry", ["img-gone"])
        prefill.run({"r-retry"})
        assert prefill.finished["r-retry"] == FinishReason.LENGTH
        assert _same(prefill.used["img-gone"], gone)
        relay_dir = prefill.scheduler.ec_connector._relay_dir
        assert os.listdir(relay_dir) == []  # every relay file went with its requests
    finally:
        prefill.close()
    assert not os.path.exists(relay_dir)


def _producer_main(items: dict[str, torch.Tensor], conn) -> None:
    """A kvxfer Mooncake encoder-cache producer (what an encoder instance's rank 0 runs)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    producer = ECConnectorFactory.create("PoolECConnector", "producer", {"pool_bytes": 1 << 20})
    for mm_hash, tensor in items.items():
        producer.save(mm_hash, tensor)
    conn.send(producer.address)
    conn.recv()
    producer.close()


def test_a_frozen_producer_never_stalls_the_scheduler(model_dir, monkeypatch):
    """Producer A (SIGSTOPped) holds img-a, producer B holds img-b, a third address has no
    process: every `schedule()` returns at once, img-b is loaded bit for bit from B, img-a is
    encoded locally, nothing raises and no request fails."""
    from vllm.v1.engine import FinishReason

    ctx = mp.get_context("spawn")
    a, b = _output(11), _output(12)
    procs = []
    try:
        addresses = []
        for items in ({"img-a": a}, {"img-b": b}):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_producer_main, args=(items, child), daemon=True)
            proc.start()
            assert parent.poll(120)
            addresses.append(parent.recv())
            procs.append((proc, parent))
        freeze(procs[0][0].pid)  # every thread stopped, not only the signal queued
        # The bounds tell "never waits on a peer" from waiting out the frozen producer's query
        # (10 s) or a load's timeout (120 s), not by this machine's speed.
        query_s, load_s = 10.0, 120.0
        extra = {
            "backend": "PoolECConnector",
            "producer_addresses": [unused_address(), *addresses],
            "recv_bytes": 1 << 20,
            "query_timeout_s": query_s,
            "timeout_s": load_s,
        }
        prefill = Prefill(model_dir, extra, monkeypatch)
        try:
            t0 = time.monotonic()
            assert prefill.scheduler.ec_connector.has_cache_item("img-a") is False
            assert time.monotonic() - t0 < query_s / 2  # no network call
            prefill.add("r-a", ["img-a"])
            prefill.add("r-b", ["img-b"])
            t0 = time.monotonic()
            prefill.run({"r-a", "r-b"}, timeout=load_s)
            assert time.monotonic() - t0 < load_s / 2  # about one query timeout, not a load's
            assert prefill.finished == {"r-a": FinishReason.LENGTH, "r-b": FinishReason.LENGTH}
            assert max(prefill.schedule_seconds) < query_s / 2  # never waits on a peer
            assert _same(prefill.used["img-b"], b)
            assert prefill.encoded_locally == {"img-a"}
        finally:
            prefill.close()
    finally:
        for proc, parent in procs:
            os.kill(proc.pid, signal.SIGCONT)
            parent.send("stop")
            proc.join(15)
            if proc.is_alive():
                proc.kill()


def test_an_unusable_relay_means_encoding_locally_not_failing(model_dir, tmp_path, monkeypatch):
    from vllm.v1.engine import FinishReason

    store = str(tmp_path / "store")
    SharedStorageECConnector("producer", {"path": store}).save("img-1", _output(3))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    extra = {"backend": "SharedStorageECConnector", "path": store, "relay_dir": str(not_a_dir)}
    prefill = Prefill(model_dir, extra, monkeypatch)
    try:
        prefill.add("r", ["img-1"])
        prefill.run({"r"})
        assert prefill.finished == {"r": FinishReason.LENGTH}
        assert prefill.encoded_locally == {"img-1"}
    finally:
        prefill.close()
