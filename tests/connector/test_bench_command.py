"""`kvxfer bench` runs end to end at toy sizes and reports what it promises; its progress bar
shows on a terminal only, never in `--json` output or when an output is not a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from kvxfer.cli import main

TOY = [
    "bench",
    "--pairs",
    "2:4",
    "--tokens",
    "64",
    "--layers",
    "2",
    "--kv-heads",
    "4",
    "--head-dim",
    "16",
    "--repeat",
    "1",
]
ENV = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
ENV.pop("TQDM_DISABLE", None)
PROGRESS = "bench 2->4"  # the bar's description, written only with the bar
ROW_KEYS = {
    "pair",
    "bytes",
    "tokens",
    "layers",
    "kv_heads",
    "strategies",
    "chunk_tokens",
    "chunks_in_flight",
    "protocol",
    "kvxfer_gbps",
    "contiguous_gbps",
    "naive_gbps",
    "naive_ops",
    "ratio_to_contiguous",
    "speedup_over_naive",
    "kvxfer_cpu_s_per_gb",
    "contiguous_cpu_s_per_gb",
    "decode_dtype",
    "source_bytes",
    "kvxfer_source_gbps",
}


def test_bench_json_rows(capsys):
    assert main([*TOY, "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["rows"]
    (row,) = rows
    assert set(row) == ROW_KEYS
    assert row["pair"] == "2->4"
    assert row["bytes"] == 2 * 2 * 64 * 4 * 16 * 2  # layers, K/V, tokens, heads, dim, bf16
    assert row["naive_ops"] == 4 * 2 * 2 * 64  # pairs x layers x K/V x tokens
    assert row["chunk_tokens"] and all(1 <= t <= 64 for t in row["chunk_tokens"])
    assert row["chunks_in_flight"] and all(1 <= n <= 4 for n in row["chunks_in_flight"])
    for key in ("kvxfer_gbps", "contiguous_gbps", "naive_gbps"):
        assert row[key] > 0
    for key in ("kvxfer_cpu_s_per_gb", "contiguous_cpu_s_per_gb"):
        assert row[key] > 0  # a transfer costs CPU on this machine
    assert PROGRESS not in captured.err and "%|" not in captured.err
    reference = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = reference.split("## `kvxfer bench --json`", 1)[1].split("\n## ", 1)[0]
    for key in ["rows", *ROW_KEYS]:
        assert f"`{key}`" in section, key


def test_bench_with_an_fp8_decode_sends_half_the_bytes(capsys):
    assert main([*TOY, "--json", "--decode-dtype", "float8_e4m3fn"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["decode_dtype"] == "float8_e4m3fn"
    assert row["source_bytes"] == 2 * 2 * 64 * 4 * 16 * 2  # layers, K/V, tokens, heads, dim, bf16
    assert row["bytes"] * 2 == row["source_bytes"]  # one byte an element on the wire
    assert row["kvxfer_source_gbps"] == pytest.approx(2 * row["kvxfer_gbps"])
    assert "direct" not in row["strategies"]


def run_on_terminal(argv: list[str], timeout: float = 240) -> tuple[int, str, str]:
    """Run `python -m kvxfer.cli ARGV` with stdout and stderr on two pseudo-terminals."""
    masters, slaves = [], []
    for _ in range(2):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        masters.append(master)
        slaves.append(slave)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli", *argv],
        stdin=subprocess.DEVNULL,
        stdout=slaves[0],
        stderr=slaves[1],
        env=ENV,
    )
    for fd in slaves:
        os.close(fd)
    chunks: dict[int, list[bytes]] = {fd: [] for fd in masters}
    open_fds = set(masters)
    deadline = time.monotonic() + timeout
    try:
        while open_fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(open_fds), [], [], 1.0)
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: the child closed its side
                    data = b""
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.discard(fd)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for fd in masters:
            os.close(fd)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in masters)
    return code, out.replace("\r\n", "\n"), err


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_progress_shows_on_a_terminal_only_without_json(as_json):
    code, out, err = run_on_terminal([*TOY, "--json"] if as_json else TOY)
    assert code == 0, (out, err)
    if as_json:
        assert PROGRESS not in err and "%|" not in err, err
        assert json.loads(out)["rows"][0]["pair"] == "2->4"
    else:
        assert PROGRESS in err and "step" in err, err
        (row,) = [line for line in out.splitlines() if line.strip()]
        assert row.split()[0] == "2->4" and "GB/s" in row


def test_no_progress_and_no_noise_when_not_a_terminal():
    """Quiet by default too: Mooncake's level left to kvxfer, its harmless lines dropped."""
    quiet = {k: v for k, v in ENV.items() if k != "MC_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", *TOY],
        capture_output=True,
        text=True,
        timeout=240,
        env=quiet,
    )
    assert done.returncode == 0, done.stderr
    # A loop held from its sockets for seconds on a loaded machine says so (a warning that
    # explains slow numbers, not noise): any other line is noise.
    stalls = "peers got no answer for that long"
    assert [line for line in done.stderr.splitlines() if stalls not in line] == []
    (row,) = done.stdout.splitlines()
    assert row.split()[0] == "2->4"


def test_verbose_shows_mooncake_logs():
    quiet = {k: v for k, v in ENV.items() if k != "MC_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", *TOY, "--verbose", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env=quiet,
    )
    assert done.returncode == 0, done.stderr
    assert "transfer_engine" in done.stderr  # Mooncake's INFO lines
    assert json.loads(done.stdout)["rows"][0]["pair"] == "2->4"


def test_a_configuration_the_connectors_refuse_is_one_line(capsys):
    code = main([*TOY, "--staging-bytes", "64", "--json"])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("kvxfer bench: error: ")
