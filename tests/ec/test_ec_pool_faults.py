"""`PoolECConnector` under faults, with real processes on Mooncake TCP: frozen (SIGSTOP) and
missing producers, a consumer frozen mid-read (others unaffected, its lease ends), a producer
frozen mid-read and resumed after the load failed (its bytes land only in the quarantined
range: the receive buffer is poisoned and compared byte for byte), items that vanish between
the check and the load, expired sessions, 0-d tensors.

A process counts as frozen once the kernel says every thread of it has stopped (`freeze`),
not when `os.kill(pid, SIGSTOP)` returns: until then it may still answer (issue 22, shown by
`test_a_sigstopped_producer_answers_until_every_thread_has_stopped`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from ec_cases import (
    big,
    holding_producer_process,
    items,
    reader_process,
    same_bits,
    some_items_process,
    zero_dim_items,
)

from kvxfer.addresses import unused_address
from kvxfer.ec import ECConnectorFactory, ECLoadError
from kvxfer.testing import POISON, wait_until
from kvxfer.testing.processes import start_child
from kvxfer.testing.signals import freeze, stopped, thread_states, wait_stopped

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
ITEMS = items()
HASHES = list(ITEMS)
BIG = 16 << 20  # float32 elements: a 64 MiB item, far more than a socket buffer holds
# For tests of what is loaded, not how fast: a producer slow to answer on a loaded machine is
# waited for, never skipped (the timing tests keep the defaults, 0.5 s and 5 s).
PATIENT = {"query_timeout_s": 30.0, "retry_after_s": 0.0}


@pytest.fixture
def processes():
    """Start producer or consumer processes; yield a starter; stop them all afterwards."""
    ctx = mp.get_context("spawn")
    started = []

    def start(target, *args):
        proc, parent, first = start_child(ctx, target, args, target.__name__)
        started.append((proc, parent))
        proc.conn = parent  # the test's end of the pipe
        return proc, first

    yield start
    for proc, parent in started:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            parent.send("stop")
            parent.poll(15)
            proc.join(15)
        if proc.is_alive():
            proc.kill()


def _producer(start, picks=None, extra=None, **config):
    config.setdefault("pool_bytes", 4 << 20)
    return start(some_items_process, "PoolECConnector", config, picks, extra)


def _consumer(addresses, **config):
    config = {"producer_addresses": addresses, "recv_bytes": 1 << 20, **config}
    return ECConnectorFactory.create("PoolECConnector", "consumer", config)


def _timed(fn, *args):
    t0 = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - t0


def test_frozen_and_missing_producers_are_skipped_and_the_others_serve(processes, monkeypatch):
    """Producer A (first half of the items) is SIGSTOPped, another address has no process:
    B's items are found and load bit for bit without waiting for A; `has` of A's items answers
    False at its query timeout (not the load's), never raises, and A is not asked again for
    `retry_after_s`; once resumed, its items are found again. Each bound tells two behaviours
    apart by a timeout one of them would wait out, never by this machine's speed (a loaded
    machine stalls whole processes for seconds)."""
    proc_a, address_a = _producer(processes, picks=range(0, 6))
    _, address_b = _producer(processes, picks=range(6, 12))
    a_item, b_item = HASHES[0], HASHES[6]
    addresses = [unused_address(), address_a, address_b]
    skip_s, load_timeout_s = 10.0, 120.0
    config = {"query_timeout_s": 1.0, "retry_after_s": skip_s, "timeout_s": load_timeout_s}
    with _consumer(addresses, **PATIENT) as patient, _consumer(addresses, **config) as consumer:
        for c in (patient, consumer):
            assert c.has(a_item) and c.has(b_item)
        freeze(proc_a.pid)

        # B's answer ends the query: it does not wait for A (30 s with PATIENT's timeout)
        found, seconds = _timed(patient.has, b_item)
        assert found is True and seconds < PATIENT["query_timeout_s"] / 2, seconds
        loaded, seconds = _timed(patient.load, b_item)
        assert same_bits(loaded, ITEMS[b_item]) and seconds < PATIENT["query_timeout_s"] / 2

        began = time.monotonic()  # A is marked down after this
        found, seconds = _timed(consumer.has, a_item)
        assert found is False and seconds < load_timeout_s / 2, seconds
        assert set(consumer.producers_down) >= {address_a}
        asked: list[tuple[float, str]] = []
        conversations = consumer.consumer.conversations
        ask = conversations.ask

        def recording_ask(address, make, link=None):
            asked.append((time.monotonic(), address))
            return ask(address, make, link)

        monkeypatch.setattr(conversations, "ask", recording_ask)
        for _ in range(5):  # A is skipped now: no more waiting for it
            assert consumer.has(a_item) is False
        assert same_bits(consumer.load(b_item), ITEMS[b_item])
        assert address_b in {address for _, address in asked}  # the live one was asked
        early = [t - began for t, a in asked if a == address_a and t - began < skip_s]
        assert not early, f"A was asked again {early} s after it was marked down"

        got, failed = consumer.start_load([a_item, b_item, HASHES[7]]).results(timeout=30)
        assert set(got) == {b_item, HASHES[7]} and set(failed) == {a_item}
        assert a_item in failed[a_item] or "could serve" in failed[a_item]
        assert all(same_bits(got[h], ITEMS[h]) for h in got)

        os.kill(proc_a.pid, signal.SIGCONT)
        wait_until(lambda: address_a not in consumer.producers_down, skip_s + 60)
        assert consumer.has(a_item) is True
        assert same_bits(consumer.load(a_item), ITEMS[a_item])
        assert address_a not in consumer.producers_down


def test_a_producer_killed_while_a_load_waits_fails_it_at_once_not_at_its_timeout(processes):
    """Producer A holds the item and is frozen, so a load's query to it waits (query timeout
    300 s). Once the query's connection is up (the kernel accepts it for the frozen process), A
    is SIGKILLed: the kernel closes its sockets, and the load fails well before the query's
    timeout, naming the closed connection, with A skipped from then on. Without the watch it
    waited out the timeout. The bound is half the timeout: a loaded machine stalls whole
    processes for tens of seconds (benchmarks/history/2026-12-03.md), never for minutes."""
    query_timeout_s = 300.0
    proc_a, address_a = _producer(processes, picks=range(0, 6))
    item = HASHES[0]
    port = int(address_a.rsplit(":", 1)[1])
    config = {**PATIENT, "query_timeout_s": query_timeout_s, "retry_after_s": 600.0}
    with _consumer([address_a], **config) as consumer:
        assert same_bits(consumer.load(item), ITEMS[item])  # a session with A, all live
        freeze(proc_a.pid)
        before = _connections_to(port)
        loading = consumer.start_load([item])
        wait_until(lambda: _connections_to(port) > before, 120)  # the query's own connection
        os.kill(proc_a.pid, signal.SIGKILL)
        proc_a.join(120)
        (got, failed), seconds = _timed(loading.results, 2 * query_timeout_s)
        assert not got and "closed the connection" in failed[item], failed
        assert seconds < query_timeout_s / 2, seconds
        assert address_a in consumer.producers_down


def _connections_to(port: int) -> int:
    """Established TCP connections (of any process here) whose far end is 127.0.0.1:`port`."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(r[2].endswith(f":{port:04X}") and r[3] == "01" for r in rows)


def test_a_sigstopped_producer_answers_until_every_thread_has_stopped(processes, tmp_path):
    """The cause of issue 22's flake (`has(a_item)` True in 7 ms with A "SIGSTOPped"), made
    deterministic. `os.kill` only queues SIGSTOP: the kernel hands it to one thread (in
    `producer_process`, the main thread, blocked in its pipe's recv), which stops the others
    once it runs; on a loaded machine that thread may wait for a CPU while the threads the
    query woke (ZeroMQ's, the side channel's) answer. Here the main thread waits in the kernel
    where no SIGSTOP can wake it (a vfork), for as long as the test likes: the producer
    answers queries after the kill, and only once every thread has stopped (`freeze`) is it
    frozen. The answer comes from the producer's running threads, not from anything cached or
    queued: each query has a socket of its own and a fresh `ref`
    (`test_ec_pool_conversations.py`)."""
    fifo = tmp_path / "hold"
    os.mkfifo(fifo)
    proc, address = processes(
        holding_producer_process, {"pool_bytes": 4 << 20}, range(6), str(fifo)
    )
    item = HASHES[0]
    with _consumer([address], query_timeout_s=2.0, retry_after_s=60.0) as consumer:
        assert consumer.has(item)
        proc.conn.send("hold")
        assert proc.conn.recv() == "holding"
        wait_until(lambda: thread_states(proc.pid)[proc.pid] == "D", 10)  # in the vfork's wait
        os.kill(proc.pid, signal.SIGSTOP)
        assert not stopped(proc.pid)
        assert consumer.has(item) is True  # "SIGSTOPped", and it answers: the flake
        assert "T" not in thread_states(proc.pid).values()
        with open(fifo, "wb"):  # the vfork's child goes on; the main thread takes the signal
            pass
        wait_stopped(proc.pid)
        assert set(thread_states(proc.pid).values()) == {"T"}
        assert consumer.has(item) is False  # frozen now: no answer
        assert consumer.producers_down == [address]
        os.kill(proc.pid, signal.SIGCONT)


def test_an_item_held_by_a_later_producer_is_found_when_the_first_is_frozen(processes):
    proc_a, address_a = _producer(processes, picks=range(0, 12))
    _, address_b = _producer(processes, picks=range(0, 12))
    with _consumer([address_a, address_b], **PATIENT) as consumer:
        freeze(proc_a.pid)
        for mm_hash in HASHES[:3]:  # B's answer ends the query (A's would take 30 s)
            found, seconds = _timed(consumer.has, mm_hash)
            assert found and seconds < PATIENT["query_timeout_s"] / 2, seconds
            assert same_bits(consumer.load(mm_hash), ITEMS[mm_hash])


def test_only_missing_producers_answer_false_fast_and_loads_fail_clearly():
    config = {"query_timeout_s": 0.3, "timeout_s": 120.0}
    with _consumer([unused_address(), unused_address()], **config) as consumer:
        found, seconds = _timed(consumer.has, HASHES[0])  # at the query's timeout, not the load's
        assert found is False and seconds < config["timeout_s"] / 2, seconds
        with pytest.raises(ECLoadError, match="no producer could serve"):
            consumer.load(HASHES[0])
    with pytest.raises(ValueError, match="tcp://host:port"):
        _consumer(["127.0.0.1:5700"])
    with pytest.raises(ValueError, match="needs producer_addresses"):
        _consumer([])


def test_a_consumer_frozen_mid_read_stalls_no_one_and_its_lease_ends(processes):
    """Consumer A (another process) freezes itself while it reads a 64 MiB item: consumer B's
    queries and loads are answered meanwhile; A's pin holds the item only `lease_s`, after
    which the pool may evict and overwrite it; when A resumes, its load fails (the producer
    says the item did not stay in place) instead of returning torn bytes. The lease is long
    enough that the checks made while it holds outlast a loaded machine's stalls."""
    lease_s = 20.0
    producer = ECConnectorFactory.create(
        "PoolECConnector", "producer", {"pool_bytes": BIG * 4 + (4 << 20), "lease_s": lease_s}
    )
    proc_a = None
    try:
        producer.save("big-item", big((BIG,), 9))
        for mm_hash in HASHES[:10]:
            producer.save(mm_hash, ITEMS[mm_hash])
        config = {"producer_addresses": [producer.address], "recv_bytes": BIG * 4 + (1 << 20)}
        proc_a, ready = processes(reader_process, config, HASHES[9], "big-item", (BIG,), 9)
        assert ready == "ready"
        proc_a.conn.send("go")
        assert proc_a.conn.recv() == "reading"
        wait_stopped(proc_a.pid)  # every thread of it, not only the one that sent the signal
        assert producer.stats_snapshot()["leases"] == 1  # A's read pins the big item
        with pytest.raises(RuntimeError, match="full of outputs being read"):
            producer.save("big-two", big((BIG,), 10))  # A's item is pinned: no room

        # B is served while A is frozen: answered within half its 30 s query timeout (a
        # producer stalled by A would not answer at all)
        bound = PATIENT["query_timeout_s"] / 2
        with _consumer([producer.address], recv_bytes=4 << 20, **PATIENT) as consumer_b:
            for mm_hash in HASHES[:8]:
                found, seconds = _timed(consumer_b.has, mm_hash)
                assert found and seconds < bound, seconds
                loaded, seconds = _timed(consumer_b.load, mm_hash)
                assert same_bits(loaded, ITEMS[mm_hash]) and seconds < bound, seconds
        assert stopped(proc_a.pid)
        wait_until(lambda: producer.stats_snapshot()["leases"] == 0, lease_s + 60)  # it ended
        producer.save("big-two", big((BIG,), 10))  # evicts A's item, overwrites its bytes
        assert "big-item" not in producer.stored
        os.kill(proc_a.pid, signal.SIGCONT)
        assert proc_a.conn.poll(60), "A never finished its load"
        outcome, why = proc_a.conn.recv()
        assert outcome == "failed", outcome
        assert "evicted while being read" in why, why
        assert producer.stats_snapshot()["pinned"] == 0
    finally:
        if proc_a is not None:
            os.kill(proc_a.pid, signal.SIGCONT)
        producer.close()


def test_an_item_evicted_between_check_and_load_fails_only_that_item():
    t = torch.arange(1024, dtype=torch.int16)  # 2 KiB each; the pool holds four
    producer = ECConnectorFactory.create("PoolECConnector", "producer", {"pool_bytes": 8192})
    backup = ECConnectorFactory.create("PoolECConnector", "producer", {"pool_bytes": 8192})
    try:
        for i in range(3):
            producer.save(f"item-{i}", t + i)
        with _consumer([producer.address], **PATIENT) as consumer:
            assert consumer.has("item-0") and consumer.has("item-1")
            for i in range(3, 7):  # evicts item-0 .. item-2
                producer.save(f"item-{i}", t + i)
            got, failed = consumer.start_load(["item-0", "item-5", "item-6"]).results(30)
            assert list(failed) == ["item-0"] and "item-0" in failed["item-0"]
            assert same_bits(got["item-5"], t + 5) and same_bits(got["item-6"], t + 6)
            with pytest.raises(ECLoadError, match="item-1"):
                consumer.load("item-1")
        backup.save("item-1", t + 1)  # held by a second producer too: it is found there
        with _consumer([producer.address, backup.address], **PATIENT) as consumer:
            assert same_bits(consumer.load("item-1"), t + 1)
    finally:
        producer.close()
        backup.close()


def test_a_producer_frozen_mid_read_and_resumed_lands_nothing_after_the_failure(
    processes, monkeypatch
):
    """Producer P freezes while the consumer reads a 64 MiB item from it: the load fails at its
    timeout and its receive range stays out of use; loads from producer Q meanwhile are exact.
    The whole receive buffer is then poisoned; P resumes and its bytes land, but only in the
    quarantined range, which is given back once the read has settled, never on a timer."""
    proc_p, address_p = _producer(
        processes,
        picks=range(0, 4),
        extra={"big-item": ((BIG,), 9)},
        pool_bytes=BIG * 4 + (4 << 20),
    )
    _, address_q = _producer(processes, picks=range(4, 12))
    config = {"timeout_s": 1.5, "retry_after_s": 0.5, "recv_bytes": BIG * 4 + (4 << 20)}
    with _consumer([address_p, address_q], **config) as consumer:
        assert same_bits(consumer.load(HASHES[0]), ITEMS[HASHES[0]])  # P's session is open
        buffer = consumer.consumer.buffer
        recv = buffer.memory
        recv.fill_(POISON)
        read = buffer.read

        def read_then_freeze(address, endpoint, remote, offset, nbytes):
            future = read(address, endpoint, remote, offset, nbytes)
            if address == address_p:  # freeze P once its first bytes have landed
                while bool((recv[offset : offset + 64] == POISON).all()) and not future.done():
                    pass
                freeze(proc_p.pid)
            return future

        monkeypatch.setattr(buffer, "read", read_then_freeze)
        try:
            with pytest.raises(ECLoadError, match="did not deliver"):
                consumer.load("big-item")
            quarantined = buffer.quarantined()
            assert consumer.quarantined_bytes >= BIG * 4 and len(quarantined) == 1
            for mm_hash in HASHES[4:12]:  # Q serves meanwhile, bit for bit
                assert same_bits(consumer.load(mm_hash), ITEMS[mm_hash])
            recv.fill_(POISON)  # every byte, the quarantined range too
            time.sleep(0.5)
            assert consumer.quarantined_bytes >= BIG * 4  # no timer frees it
        finally:
            os.kill(proc_p.pid, signal.SIGCONT)
        wait_until(lambda: consumer.quarantined_bytes == 0, 40)  # the read settled
        ((offset, nbytes),) = quarantined.items()
        outside = torch.cat([recv[:offset], recv[offset + nbytes :]])
        assert bool((outside == POISON).all()), "a byte landed outside the quarantined range"
        inside = recv[offset : offset + nbytes]
        landed = int((inside != POISON).sum())
        assert landed > 0  # the late read did land: in the range kept out of use for it
        wait_until(lambda: address_p not in consumer.producers_down, 10)  # P is asked again
        monkeypatch.setattr(buffer, "read", read)
        assert same_bits(consumer.load("big-item"), big((BIG,), 9))


def test_zero_dim_and_empty_tensors_round_trip_exactly():
    producer = ECConnectorFactory.create("PoolECConnector", "producer", {"pool_bytes": 1 << 20})
    try:
        for mm_hash, tensor in zero_dim_items().items():
            producer.save(mm_hash, tensor)
        with _consumer([producer.address], **PATIENT) as consumer:
            for mm_hash, tensor in zero_dim_items().items():
                assert consumer.has(mm_hash)
                got = consumer.load(mm_hash)
                assert got.shape == tensor.shape and got.dtype == tensor.dtype, mm_hash
                assert same_bits(got, tensor), mm_hash
    finally:
        producer.close()


def test_leases_end_with_their_reads_and_idle_sessions_are_shaken_again():
    producer = ECConnectorFactory.create(
        "PoolECConnector", "producer", {"pool_bytes": 1 << 20, "session_timeout_s": 5.0}
    )
    try:
        producer.save("x", torch.ones(16))
        consumers = [_consumer([producer.address], **PATIENT) for _ in range(2)]
        for c in consumers:
            assert same_bits(c.load("x"), torch.ones(16))
        stats = producer.stats_snapshot()
        assert stats["sessions"] == 2 and stats["leases"] == 0 and stats["pinned"] == 0
        assert stats["threads"] == 2  # no thread per consumer
        wait_until(lambda: producer.stats_snapshot()["sessions"] == 0, 60)  # idle: forgotten
        for c in consumers:  # the consumer shakes hands again, transparently
            assert c.has("x") and same_bits(c.load("x"), torch.ones(16))
            assert c.stats_snapshot()["quarantined_bytes"] == 0
            c.close()
    finally:
        producer.close()
