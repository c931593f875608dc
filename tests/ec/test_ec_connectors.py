"""Encoder-cache connectors move encoder outputs across processes exactly and fail clearly."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import ClassVar

import pytest
import torch
from ec_cases import items, producer_process, same_bits

from kvxfer.ec import ECConnectorBase, ECConnectorFactory, ECLoadError, check_hash, item_key
from kvxfer.testing.processes import start_child
from kvxfer.transport import TransferError
from kvxfer.transport.factory import KINDS

ITEMS = items()


@pytest.fixture
def producer_in_a_process(tmp_path):
    """Start a producer process for a connector name; yield its address (or None)."""
    ctx = mp.get_context("spawn")
    started = []

    def start(name, config):
        proc, parent, address = start_child(ctx, producer_process, (name, config), "a producer")
        started.append((proc, parent))
        return address

    yield start
    for proc, parent in started:
        parent.send("stop")
        parent.poll(30)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def consumers(name, tmp_path, address):
    if name == "SharedStorageECConnector":
        return ECConnectorFactory.create(name, "consumer", {"path": str(tmp_path)})
    # A producer slow to answer on a loaded machine is waited for, never skipped: these tests
    # are about what is loaded (test_ec_pool_faults.py checks how fast).
    config = {
        "producer_addresses": [address],
        "recv_bytes": 1 << 20,
        "query_timeout_s": 30.0,
        "retry_after_s": 0.0,
    }
    return ECConnectorFactory.create(name, "consumer", config)


def producer_config(name, tmp_path):
    if name == "SharedStorageECConnector":
        return {"path": str(tmp_path)}
    return {"pool_bytes": 4 << 20}


NAMES = ["SharedStorageECConnector", "PoolECConnector"]


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_across_processes(name, tmp_path, producer_in_a_process):
    address = producer_in_a_process(name, producer_config(name, tmp_path))
    with consumers(name, tmp_path, address) as consumer:
        for mm_hash, tensor in ITEMS.items():
            assert consumer.has(mm_hash)
            assert same_bits(consumer.load(mm_hash), tensor), mm_hash
        batch = consumer.start_load(list(ITEMS))
        loaded = batch.wait(timeout=60)
        assert batch.done() and sorted(batch.finished()) == sorted(ITEMS)
        assert all(same_bits(loaded[h], t) for h, t in ITEMS.items())
        for mm_hash in ITEMS:
            consumer.release(mm_hash)


@pytest.mark.parametrize("name", NAMES)
def test_missing_hash(name, tmp_path, producer_in_a_process):
    address = producer_in_a_process(name, producer_config(name, tmp_path))
    with consumers(name, tmp_path, address) as consumer:
        assert not consumer.has("0" * 32)
        with pytest.raises(ECLoadError, match=r"0{32}"):
            consumer.load("0" * 32)


@pytest.mark.parametrize("name", NAMES)
def test_concurrent_loads(name, tmp_path, producer_in_a_process):
    address = producer_in_a_process(name, producer_config(name, tmp_path))
    with consumers(name, tmp_path, address) as consumer:
        errors = []

        def load_all():
            try:
                got = consumer.start_load(list(ITEMS)).wait(timeout=60)
                assert all(same_bits(got[h], t) for h, t in ITEMS.items())
            except Exception as exc:  # collected for the main thread
                errors.append(exc)

        threads = [threading.Thread(target=load_all) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_corrupt_and_truncated_files_are_never_served(tmp_path):
    producer = ECConnectorFactory.create(
        "SharedStorageECConnector", "producer", {"path": str(tmp_path)}
    )
    consumer = ECConnectorFactory.create(
        "SharedStorageECConnector", "consumer", {"path": str(tmp_path)}
    )
    (a, ta), (b, tb) = list(ITEMS.items())[4:6]
    producer.save(a, ta)
    producer.save(b, tb)
    path_a, path_b = producer.file_of(a), producer.file_of(b)
    data = bytearray(path_a.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the tensor's bytes
    path_a.write_bytes(bytes(data))
    path_b.write_bytes(path_b.read_bytes()[:-10])  # truncated
    with pytest.raises(ECLoadError, match="corrupt"):
        consumer.load(a)
    with pytest.raises(ECLoadError, match="unreadable"):
        consumer.load(b)
    producer.save(a, ta)  # a writer repairs it by saving the same hash again
    assert same_bits(consumer.load(a), ta)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []  # no temporary file survives a write


def test_concurrent_writers_and_readers_of_one_hash(tmp_path):
    (mm_hash, tensor) = next(iter(ITEMS.items()))
    producers = [
        ECConnectorFactory.create("SharedStorageECConnector", "producer", {"path": str(tmp_path)})
        for _ in range(3)
    ]
    consumer = ECConnectorFactory.create(
        "SharedStorageECConnector", "consumer", {"path": str(tmp_path)}
    )
    producers[0].save(mm_hash, tensor)
    failures = []

    def write():
        for _ in range(30):
            for p in producers:
                p.save(mm_hash, tensor)

    def read():
        for _ in range(60):
            try:
                assert same_bits(consumer.load(mm_hash), tensor)
            except Exception as exc:
                failures.append(exc)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_lru_eviction_under_pressure_spares_outputs_being_fetched():
    producer = ECConnectorFactory.create("PoolECConnector", "producer", {"pool_bytes": 8192})
    try:
        t = torch.arange(1024, dtype=torch.int16)  # 2 KiB each: four fit
        for i in range(4):
            producer.save(f"item-{i}", t + i)
        producer.save("item-0", t)  # a touch: item-0 is now the most recent
        pool = producer.producer.pool
        entry = pool.pin("item-1")  # item-1 is being read by a fetch...
        assert entry is not None
        pool.demote("item-1")  # ...and is the least recently used (its consumer released it)
        producer.save("item-4", t + 4)
        producer.save("item-5", t + 5)
        assert producer.stored == ["item-1", "item-0", "item-4", "item-5"]  # 2 and 3 evicted
        pool.unpin(entry)
        producer.save("item-6", t + 6)
        assert "item-1" not in producer.stored
        with pytest.raises(ValueError, match="exceed the pool"):
            producer.save("huge", torch.zeros(8192, dtype=torch.int16))
    finally:
        producer.close()


def test_a_save_that_pinned_items_leave_no_room_for_fails_and_evicts_nothing():
    producer = ECConnectorFactory.create("PoolECConnector", "producer", {"pool_bytes": 8192})
    try:
        t = torch.arange(1024, dtype=torch.int16)  # 2 KiB each: four fit, one after another
        for i in range(4):
            producer.save(f"item-{i}", t + i)
        pool = producer.producer.pool
        pins = [pool.pin("item-1"), pool.pin("item-3")]  # being read: 2 KiB free runs between
        stored = producer.stored
        wide = torch.arange(2048, dtype=torch.int16)  # 4 KiB: room in total, in no single run
        with pytest.raises(RuntimeError, match="full of outputs being read"):
            producer.save("wide", wide)
        assert producer.stored == stored  # item-0 and item-2 were not evicted for nothing
        config = {"producer_addresses": [producer.address], "recv_bytes": 1 << 20}
        with ECConnectorFactory.create("PoolECConnector", "consumer", config) as consumer:
            assert all(same_bits(consumer.load(f"item-{i}"), t + i) for i in (0, 2))
        for entry in pins:
            assert entry is not None
            pool.unpin(entry)
        producer.save("wide", wide)  # now evicting makes room, so it evicts
        assert "wide" in producer.stored and len(producer.stored) < len(stored)
    finally:
        producer.close()


@pytest.mark.parametrize("transport", sorted(KINDS))
def test_the_pool_moves_items_exactly_over_every_transport(transport):
    """In one process, the pool over each kind of `kvxfer.transport.factory.KINDS`."""
    common = {"transport": transport}
    producer = ECConnectorFactory.create(
        "PoolECConnector", "producer", {**common, "pool_bytes": 4 << 20}
    )
    config = {**common, "producer_addresses": [producer.address], "recv_bytes": 1 << 20}
    try:
        with ECConnectorFactory.create("PoolECConnector", "consumer", config) as consumer:
            for mm_hash, tensor in ITEMS.items():
                producer.save(mm_hash, tensor)
            loaded = consumer.start_load(list(ITEMS)).wait(timeout=60)
            assert all(same_bits(loaded[h], t) for h, t in ITEMS.items())
            assert consumer.stats_snapshot()["transport"] == producer.stats_snapshot()["transport"]
    finally:
        producer.close()


def test_a_consumer_of_another_transport_is_refused_naming_both():
    producer = ECConnectorFactory.create(
        "PoolECConnector", "producer", {"transport": "local", "pool_bytes": 1 << 20}
    )
    config = {"producer_addresses": [producer.address], "recv_bytes": 1 << 20}
    try:
        producer.save("item", torch.ones(4))
        refused = pytest.raises(ECLoadError, match="its transport is 'local' and this side's is ")
        with ECConnectorFactory.create("PoolECConnector", "consumer", config) as consumer, refused:
            consumer.load("item")
    finally:
        producer.close()
    with pytest.raises(ValueError, match=r"\['transport'\] = 'nixl'; expected one of"):
        ECConnectorFactory.create("PoolECConnector", "producer", {"transport": "nixl"})


def test_a_consumer_without_the_rdma_device_it_asks_for_fails_at_start(tmp_path, monkeypatch):
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(tmp_path))  # a machine with no device
    config = {"producer_addresses": ["tcp://127.0.0.1:5999"], "protocol": "rdma"}
    with pytest.raises(TransferError, match='protocol="rdma": no RDMA device found'):
        ECConnectorFactory.create("PoolECConnector", "consumer", config)
    with ECConnectorFactory.create(
        "PoolECConnector", "consumer", {**config, "rdma_fallback": True}
    ) as consumer:
        assert not consumer.has("0" * 32)  # nobody answers at that address: not held


def test_roles_and_hashes_are_checked(tmp_path):
    consumer = ECConnectorFactory.create(
        "SharedStorageECConnector", "consumer", {"path": str(tmp_path)}
    )
    with pytest.raises(RuntimeError, match="save needs the producer role"):
        consumer.save("abc", torch.zeros(1))
    with pytest.raises(ValueError, match="not a valid item hash"):
        consumer.has("../etc/passwd")
    with pytest.raises(ValueError, match="role"):
        ECConnectorFactory.create("SharedStorageECConnector", "encoder", {"path": str(tmp_path)})
    with pytest.raises(ValueError, match="needs 'path'"):
        ECConnectorFactory.create("SharedStorageECConnector", "producer", {})


def test_item_keys_map_any_identifier_to_a_valid_hash():
    assert item_key("abc123_.-x") == "abc123_.-x"  # valid hashes are kept
    for identifier in ["lora1:abc", "../etc/passwd", "", "x" * 300, "a b", "..", "ü"]:
        key = item_key(identifier)
        assert check_hash(key) == key and key == item_key(identifier)
    assert item_key("lora1:abc") != item_key("lora2:abc")


class MemoryECConnector(ECConnectorBase):
    """A user's own connector, loaded through a module path."""

    store: ClassVar[dict] = {}

    def _save(self, mm_hash, tensor):
        MemoryECConnector.store[mm_hash] = tensor.clone()

    def _has(self, mm_hash):
        return mm_hash in MemoryECConnector.store

    def _load(self, mm_hash):
        if mm_hash not in MemoryECConnector.store:
            raise ECLoadError(f"no {mm_hash}")
        return MemoryECConnector.store[mm_hash].clone()


def test_factory_registers_lazily_and_loads_user_connectors():
    assert {"SharedStorageECConnector", "PoolECConnector"} <= set(ECConnectorFactory.names())
    former = ECConnectorFactory.create("MooncakeECConnector", "producer", {"pool_bytes": 4096})
    try:  # the pool's former name, in configs written before it took a transport by name
        assert type(former).__name__ == "PoolECConnector"
    finally:
        former.close()
    with pytest.raises(ValueError, match="unknown EC connector 'Nope'"):
        ECConnectorFactory.create("Nope", "producer", {})
    producer = ECConnectorFactory.create("MemoryECConnector", "producer", {}, module_path=__name__)
    producer.save("x1", torch.ones(3))
    ECConnectorFactory.register("Memory", __name__, "MemoryECConnector")
    consumer = ECConnectorFactory.create("Memory", "consumer", {})
    assert same_bits(consumer.load("x1"), torch.ones(3))
    with pytest.raises(ValueError, match="already registered"):
        ECConnectorFactory.register("Memory", __name__, "Other")
    with pytest.raises(ValueError, match="not an ECConnectorBase"):
        ECConnectorFactory.create("ITEMS", "producer", {}, module_path=__name__)
