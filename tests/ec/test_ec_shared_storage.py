"""`SharedStorageECConnector` under damage: an edited header, truncated or half-written files,
0-d tensors, the umask, a writer killed mid-write."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import stat
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from ec_cases import big, same_bits, zero_dim_items

from kvxfer.ec import ECConnectorFactory, ECLoadError
from kvxfer.testing.processes import start_child


def _pair(path):
    producer = ECConnectorFactory.create("SharedStorageECConnector", "producer", {"path": path})
    consumer = ECConnectorFactory.create("SharedStorageECConnector", "consumer", {"path": path})
    return producer, consumer


def _rewrite_header(path, edit) -> None:
    """Apply `edit` to a safetensors file's header JSON, keeping the file's length."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw.ljust(n, b" ") + data[8 + n :])


def test_an_edited_header_is_never_served(tmp_path):
    producer, consumer = _pair(str(tmp_path))
    tensor = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    producer.save("item", tensor)
    path = producer.file_of("item")
    size = path.stat().st_size

    def to_i32(header):
        assert header["encoder_output"]["dtype"] == "F32"
        header["encoder_output"]["dtype"] = "I32"
        header["encoder_output"]["shape"] = [32, 64]

    _rewrite_header(path, to_i32)
    assert path.stat().st_size == size  # the same bytes, described differently
    with pytest.raises(ECLoadError, match=r"corrupt.*dtype, shape or bytes"):
        consumer.load("item")

    producer.save("item", tensor)  # saving again repairs it
    _rewrite_header(path, lambda h: h["encoder_output"].update(shape=[2048]))
    with pytest.raises(ECLoadError, match="corrupt"):
        consumer.load("item")

    producer.save("item", tensor)
    _rewrite_header(path, lambda h: h.pop("__metadata__"))  # no checksum at all
    with pytest.raises(ECLoadError, match="no kvxfer-ec/2 checksum"):
        consumer.load("item")
    producer.save("item", tensor)
    assert same_bits(consumer.load("item"), tensor)


@pytest.mark.parametrize("cut", ["empty", "4", "8", "mid-header", "header", "mid-data", "-1"])
def test_a_truncated_file_is_never_announced_nor_served(tmp_path, cut):
    producer, consumer = _pair(str(tmp_path))
    tensor = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    producer.save("item", tensor)
    path = producer.file_of("item")
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    keep = {
        "empty": 0,
        "4": 4,
        "8": 8,
        "mid-header": 8 + n // 2,
        "header": 8 + n,
        "mid-data": 8 + n + (len(data) - 8 - n) // 2,
        "-1": len(data) - 1,
    }[cut]
    path.write_bytes(data[:keep])
    assert consumer.has("item") is False
    with pytest.raises(ECLoadError, match="unreadable"):
        consumer.load("item")


def test_a_file_with_trailing_bytes_is_not_announced(tmp_path):
    producer, consumer = _pair(str(tmp_path))
    producer.save("item", torch.ones(8))
    path = producer.file_of("item")
    path.write_bytes(path.read_bytes() + b"\0")
    assert consumer.has("item") is False
    with pytest.raises(ECLoadError, match="unreadable"):
        consumer.load("item")


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_created_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        producer, _ = _pair(str(tmp_path / "shared"))
        producer.save("item", torch.ones(4))
    finally:
        os.umask(old)
    assert stat.S_IMODE(producer.file_of("item").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o777 & ~umask


def test_zero_dim_and_empty_tensors_round_trip_exactly(tmp_path):
    producer, consumer = _pair(str(tmp_path))
    for mm_hash, tensor in zero_dim_items().items():
        producer.save(mm_hash, tensor)
    for mm_hash, tensor in zero_dim_items().items():
        assert consumer.has(mm_hash)
        got = consumer.load(mm_hash)
        assert got.shape == tensor.shape and got.dtype == tensor.dtype, mm_hash
        assert same_bits(got, tensor), mm_hash


def _write_forever(path: str, conn) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    producer = ECConnectorFactory.create("SharedStorageECConnector", "producer", {"path": path})
    conn.send("ready")
    for i in range(10_000):
        producer.save(f"item-{i}", big((4 << 20,), i))  # 16 MiB each


def _being_written(folder: Path) -> list[Path]:
    """The temporary files in `folder` that hold bytes now; one renamed between the listing
    and its size (its write ended: a slow listing on a loaded machine) is not among them."""
    found = []
    for path in folder.iterdir():
        try:
            if path.name.endswith(".tmp") and path.stat().st_size > 0:
                found.append(path)
        except FileNotFoundError:
            continue
    return found


def test_a_writer_killed_mid_write_leaves_nothing_announced_that_is_not_whole(tmp_path):
    """While a writer process saves 16 MiB files, every item `has` announces loads bit for bit;
    after it is SIGKILLed mid-write, the same holds and the partial file is not announced."""
    ctx = mp.get_context("spawn")
    proc, _, ready = start_child(ctx, _write_forever, (str(tmp_path),), "the writer")
    try:
        assert ready == "ready"
        consumer = ECConnectorFactory.create(
            "SharedStorageECConnector", "consumer", {"path": str(tmp_path)}
        )
        seen: set[int] = set()
        failures: list[str] = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                for i in range(len(seen), len(seen) + 3):
                    if consumer.has(f"item-{i}"):
                        if not same_bits(consumer.load(f"item-{i}"), big((4 << 20,), i)):
                            failures.append(f"item-{i}")
                        seen.add(i)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        temps = []
        for _ in range(200):  # kill it while a temporary file is being written
            temps = _being_written(tmp_path)
            if temps:
                break
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert temps, "the writer was not caught in the middle of a write"
        stop.set()
        reader.join()
        assert failures == []
        assert len(seen) >= 3
        announced = [p for p in tmp_path.iterdir() if p.name.endswith(".safetensors")]
        for p in announced:
            i = int(p.name.removesuffix(".safetensors").split("-")[1])
            assert consumer.has(f"item-{i}")
            assert same_bits(consumer.load(f"item-{i}"), big((4 << 20,), i))
        # what the kill interrupted is a temporary file, never announced under a final name
        assert all(consumer.has(p.name.split(".")[1]) is False for p in temps if p.exists())
    finally:
        if proc.is_alive():
            proc.kill()
