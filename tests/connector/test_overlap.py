"""The connector's pipeline: with several staging slots per peer, the producer's pack of chunk
i+1, the read of chunk i and the consumer's copy of chunk i-1 into its cache are in flight at
once; with one slot they run strictly one after another. One producer rank and one consumer rank
over real Mooncake TCP on 127.0.0.1, every stage recorded by instrumented hooks (an order of
events, never a timing), every destination byte checked. Also the `CopyStream` logic, on CPU and,
with a stand-in for `torch.cuda`, the calls the CUDA side stream makes."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

import kvxfer.connector.consumer.copies as copies_mod
import kvxfer.connector.producer.packing as producer_mod
import kvxfer.connector.streams as streams_mod
from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.connector.streams import CudaCopyStream, InlineCopyStream, copy_stream_for
from kvxfer.plan.sizing import chunk_bounds
from kvxfer.testing import make_scenario, side_specs

NUM_TOKENS = 512
SLOT_BYTES = 16 << 10  # 64 tokens of this geometry's wire buffer: 8 chunks


class Timeline:
    """Stages of chunks, in the order they happened (a global sequence number, not a clock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self.at: dict[tuple[str, int], int] = {}  # (event, chunk) -> sequence number

    def mark(self, event: str, chunk: int) -> None:
        with self._lock:
            assert (event, chunk) not in self.at, f"{event} of chunk {chunk} happened twice"
            self.at[event, chunk] = next(self._seq)

    def __getitem__(self, key: tuple[str, int]) -> int:
        return self.at[key]


STAGES = ("pack_start", "pack_end", "read_start", "read_end", "unpack_start", "unpack_end")


def run_instrumented(monkeypatch, slots: int, meet=None):
    """Move one request (pack+unpack, 16 -> 32 tokens a block) with `slots` staging slots on
    both sides; `meet(stage, chunk)` runs inside every stage (before its work). Returns the
    timeline, the number of chunks and the scenario (destination filled)."""
    src = side_specs(1, heads=4, block_size=16, num_blocks=40)
    dst = side_specs(1, heads=4, block_size=32, layout="HND", num_blocks=20)
    scenario = make_scenario(src, dst, NUM_TOKENS)
    (src_spec, src_caches, src_ids), (dst_spec, dst_caches, dst_ids) = scenario.src + scenario.dst
    staging = {"staging_bytes": SLOT_BYTES * slots, "staging_slots": slots}
    timeline = Timeline()
    chunk_of: dict[int, int] = {}  # token start -> chunk index
    meet = meet or (lambda stage, chunk: None)

    def hooked(real, stage):
        def copy(cell_copy, src_tensors, dst_tensors, backend):
            chunk = chunk_of[cell_copy.token_start]
            timeline.mark(f"{stage}_start", chunk)
            meet(stage, chunk)
            real(cell_copy, src_tensors, dst_tensors, backend)
            timeline.mark(f"{stage}_end", chunk)

        return copy

    # Every pack on the session's worker and every unpack on the copy pool, as on CUDA: this
    # measures those pipelines (a small CPU chunk is otherwise packed on the side-channel
    # thread and unpacked on the consumer's loop, where a copy that waits inside would hold
    # their messages; tests/connector/test_inline_copies.py).
    monkeypatch.setattr(streams_mod, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(producer_mod, "run_cell_copy", hooked(producer_mod.run_cell_copy, "pack"))
    monkeypatch.setattr(copies_mod, "run_cell_copy", hooked(copies_mod.run_cell_copy, "unpack"))
    producer = KVProducer(src_spec, src_caches, "prefill", **staging)
    consumer = KVConsumer(dst_spec, dst_caches, "decode", strategy="pack+unpack", **staging)
    try:
        consumer.connect([producer.address])
        (pair,) = consumer._pairs
        bounds = chunk_bounds(0, NUM_TOKENS, pair.chunk_tokens)
        chunk_of.update({lo: i for i, (lo, _) in enumerate(bounds)})

        # A read is in flight from its start until the consumer learns it completed; the hook
        # learns which chunk a read is for from the fetch machine's `_start_read`, which calls
        # `read` at once.
        reading: list[int] = []
        machine = consumer._machine
        start_read, read = machine._start_read, consumer.transport.read

        def start_read_hook(chunk):
            reading.append(chunk_of[chunk.start])
            start_read(chunk)

        def read_hook(segments, peer):
            chunk = reading[-1]
            timeline.mark("read_start", chunk)
            outer: Future[None] = Future()

            def landed(inner: Future[None]) -> None:
                def settle() -> None:  # off the transport's thread: `meet` may block
                    meet("read", chunk)
                    timeline.mark("read_end", chunk)
                    error = inner.exception()
                    if error is not None:
                        outer.set_exception(error)
                    else:
                        outer.set_result(None)

                threading.Thread(target=settle, daemon=True).start()

            read(segments, peer).add_done_callback(landed)
            return outer

        monkeypatch.setattr(machine, "_start_read", start_read_hook)
        monkeypatch.setattr(consumer.transport, "read", read_hook)
        producer.publish("req", src_ids, NUM_TOKENS)
        result = consumer.fetch("req", dst_ids, NUM_TOKENS, timeout=60).wait()
        assert result.ok, result.errors
    finally:
        consumer.close()
        producer.close()
    scenario.assert_exact()
    assert len(bounds) >= 4
    for chunk in range(len(bounds)):  # every stage of every chunk, once (`mark` checks)
        assert all((stage, chunk) in timeline.at for stage in STAGES), chunk
    return timeline, len(bounds), scenario


def assert_stages_in_order(t: Timeline, chunks: int) -> None:
    """Each chunk: packed, then read, then copied into the cache."""
    for i in range(chunks):
        assert [t[s, i] for s in STAGES] == sorted(t[s, i] for s in STAGES), f"chunk {i}"


def test_pack_of_next_read_of_this_and_copy_of_previous_chunk_are_in_flight_at_once(monkeypatch):
    # The pack of chunk 2, the read of chunk 1 and the copy of chunk 0 each wait inside their
    # stage until all three are there: possible only if the pipeline runs them at once.
    meeting = {("pack", 2), ("read", 1), ("unpack", 0)}
    barrier = threading.Barrier(len(meeting), timeout=20)
    met: set[tuple[str, int]] = set()

    def meet(stage: str, chunk: int) -> None:
        if (stage, chunk) in meeting:
            try:
                barrier.wait()
                met.add((stage, chunk))
            except threading.BrokenBarrierError:  # they never were under way together
                pass

    t, chunks, _ = run_instrumented(monkeypatch, slots=4, meet=meet)
    assert met == meeting
    starts = [t["pack_start", 2], t["read_start", 1], t["unpack_start", 0]]
    ends = [t["pack_end", 2], t["read_end", 1], t["unpack_end", 0]]
    assert max(starts) < min(ends)  # one moment when all three were under way
    assert_stages_in_order(t, chunks)
    # Bounded: never more than `staging_slots` chunks between their pack and their copy's end.
    for moment in sorted(t.at.values()):
        under_way = sum(t["pack_start", i] <= moment < t["unpack_end", i] for i in range(chunks))
        assert under_way <= 4


def test_one_slot_moves_chunks_strictly_one_after_another(monkeypatch):
    t, chunks, _ = run_instrumented(monkeypatch, slots=1)
    assert_stages_in_order(t, chunks)
    for i in range(chunks - 1):  # the next pack starts only once this chunk is in the cache
        assert t["unpack_end", i] < t["pack_start", i + 1], f"chunk {i + 1}"


# ---- CopyStream -------------------------------------------------------------------------------


def test_cpu_copies_run_inline_and_are_done_at_once():
    import torch

    stream = copy_stream_for(torch.device("cpu"))
    assert isinstance(stream, InlineCopyStream)
    ran: list[str] = []
    fence = stream.fence()
    assert fence is None
    done = stream.launch(lambda: ran.append("copy"), fence)
    ran.append("after launch")
    assert done.done()
    done.wait()
    assert ran == ["copy", "after launch"]
    with pytest.raises(ZeroDivisionError):
        stream.launch(lambda: 1 / 0)


class FakeCuda:
    """Stand-in for `torch.cuda`, logging what a CUDA copy stream asks of it."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.current = "engine-stream"
        fake = self

        class Event:
            names = itertools.count()

            def __init__(self, blocking: bool = False) -> None:
                self.name = f"event{next(Event.names)}"
                self.blocking = blocking

            def record(self, stream) -> None:
                fake.log.append(("record", self.name, str(stream)))

            def query(self) -> bool:
                fake.log.append(("query", self.name))
                return True

            def synchronize(self) -> None:
                fake.log.append(("synchronize", self.name))

        class Stream:
            def __init__(self, device) -> None:
                fake.log.append(("new stream", str(device)))

            def wait_event(self, event) -> None:
                fake.log.append(("wait_event", event.name))

            def synchronize(self) -> None:  # never called: a stream-wide sync
                fake.log.append(("stream synchronize",))

            def __str__(self) -> str:
                return "side-stream"

        class Context:
            def __init__(self, what: tuple[str, ...]) -> None:
                self.what = what

            def __enter__(self) -> None:
                fake.log.append(("enter", *self.what))

            def __exit__(self, *exc: object) -> None:
                fake.log.append(("exit", *self.what))

        self.Event, self.Stream = Event, Stream
        self.device = lambda device: Context(("device", str(device)))
        self.stream = lambda stream: Context(("stream", str(stream)))
        self.current_stream = lambda device: self.current
        self.synchronize = lambda *a: self.log.append(("device synchronize",))


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(streams_mod, "torch", SimpleNamespace(cuda=fake))
    return fake


def test_cuda_copy_waits_for_the_fence_on_the_side_stream_and_syncs_only_its_event(fake_cuda):
    stream = CudaCopyStream("cuda:1")  # type: ignore[arg-type]
    fence = stream.fence()  # the engine's stream, as the caller left it
    assert fake_cuda.log[-1] == ("record", fence.name, "engine-stream")
    fake_cuda.log.clear()
    done = stream.launch(lambda: fake_cuda.log.append(("copy",)), fence)
    assert done.done()
    done.wait()
    finished = done.event.name  # type: ignore[attr-defined]
    assert done.event.blocking  # type: ignore[attr-defined]  # sleeps, does not spin a core
    assert fake_cuda.log == [
        ("enter", "device", "cuda:1"),
        ("enter", "stream", "side-stream"),
        ("wait_event", fence.name),  # on the GPU: the host does not wait for the engine
        ("copy",),
        ("record", finished, "side-stream"),
        ("exit", "stream", "side-stream"),
        ("exit", "device", "cuda:1"),
        ("query", finished),
        ("synchronize", finished),
    ]


def test_cuda_copy_without_fence_and_a_failed_copy_waits_for_what_it_launched(fake_cuda):
    stream = CudaCopyStream("cuda:0")  # type: ignore[arg-type]
    fake_cuda.log.clear()
    stream.launch(lambda: None)
    assert not any(entry[0] == "wait_event" for entry in fake_cuda.log)
    fake_cuda.log.clear()

    def failing() -> None:
        fake_cuda.log.append(("copy launched a kernel",))
        raise RuntimeError("bad copy")

    with pytest.raises(RuntimeError, match="bad copy"):
        stream.launch(failing)
    recorded = [e for e in fake_cuda.log if e[0] == "record"]
    assert len(recorded) == 1 and recorded[0][2] == "side-stream"
    assert ("synchronize", recorded[0][1]) in fake_cuda.log  # before the caller reuses buffers
    assert ("stream synchronize",) not in fake_cuda.log
    assert ("device synchronize",) not in fake_cuda.log
