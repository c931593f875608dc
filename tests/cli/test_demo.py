"""`kvxfer demo`: differently sharded prefill and decode groups, in processes, generate exactly
what one unsharded model generates; quietly, with a progress bar on a terminal only."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time

import numpy as np
import pytest
import torch

from kvxfer.cli.native_logs import is_harmless
from kvxfer.examples.pd_demo import DemoOptions, _report, reference

# A demo small enough to run in a few seconds: for the output checks, not the transfer's.
SMALL = ["--prefill-tp", "1", "--decode-tp", "2", "--prompt-tokens", "40", "--decode-tokens", "2"]
HARMLESS = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "E1130 18:11:41.097067 15688 transfer_metadata.cpp:1098] Local segment descriptor not found",
)


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    env.pop("TRITON_INTERPRET", None)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_demo(*args: str) -> tuple[int, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    return done.returncode, json.loads(done.stdout)


def run_in_terminal(*args: str, timeout: float = 600.0) -> tuple[int, str]:
    """Run `kvxfer demo` with stdout and stderr on a pseudo-terminal (100 columns)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli", "demo", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=_env(),
    )
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer of the terminal closed it
                break
            if not data:
                break
            out += data
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return code, out.decode(errors="replace")


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="default-P2-D4-bs16-bs32-NHD-HND"),
        pytest.param(
            [
                "--prefill-tp",
                "3",
                "--decode-tp",
                "4",
                "--prefill-block-size",
                "32",
                "--decode-block-size",
                "16",
                "--prefill-placement",
                "kv_inner",
                "--decode-placement",
                "blocks_first",
                "--prompt-tokens",
                "120",
                "--decode-tokens",
                "6",
            ],
            id="P3-D4-bs32-bs16-kv_inner-blocks_first",
        ),
        pytest.param(
            [
                "--model",
                "mla",
                "--prefill-tp",
                "4",
                "--decode-tp",
                "2",
                "--prompt-tokens",
                "90",
                "--decode-tokens",
                "6",
            ],
            id="MLA-P4-D2",
        ),
        pytest.param(
            [
                "--kv-heads",
                "2",
                "--prefill-tp",
                "1",
                "--decode-tp",
                "4",
                "--prompt-tokens",
                "70",
                "--decode-tokens",
                "4",
                "--strategy",
                "pack",
            ],
            id="P1-D4-replicated-pack",
        ),
    ],
)
def test_demo_matches_the_unsharded_model(args):
    code, report = run_demo(*args)
    assert report["match"], report
    assert code == 0
    assert report["tokens"] == report["reference_tokens"]
    assert report["logits_max_abs_diff"] == 0
    assert report["bytes"] > 0 and report["num_ops"] > 0 and report["transfer_seconds"] > 0
    assert report["strategies"]
    assert all(r == ["demo-request"] for r in report["released"])


@pytest.mark.parametrize(
    ("dtype", "extra"),
    [("float8_e4m3fn", []), ("float8_e5m2", ["--model", "mla", "--prefill-tp", "2"])],
    ids=["gqa-e4m3", "mla-e5m2"],
)
def test_an_fp8_decode_matches_the_unsharded_model_over_an_fp8_cache(dtype, extra):
    base = ["--prompt-tokens", "60", "--decode-tokens", "4", *extra]
    code, report = run_demo(*base, "--decode-dtype", dtype)
    assert code == 0 and report["match"], report
    assert report["logits_max_abs_diff"] == 0
    assert report["options"]["decode_dtype"] == dtype
    _, plain = run_demo(*base)
    assert plain["match"]
    assert report["bytes"] * 4 == plain["bytes"]  # fp8 on the wire, not float32
    # The fp8 cache changes the decode's logits (its reference's too): the verdict saw the
    # conversion, and the decode ranks generated what the unsharded fp8 model does.
    options = DemoOptions(**report["options"])
    fp8_tokens, fp8_logits = reference(options)
    _, fp32_logits = reference(dataclasses.replace(options, decode_dtype="float32"))
    assert report["tokens"] == fp8_tokens
    assert not torch.equal(fp8_logits, fp32_logits)


def test_a_different_last_logit_is_a_mismatch():
    logits = np.zeros(8, dtype=np.float32)
    reports = [
        {
            "rank": 0,
            "result": {"ok": True, "bytes": 1, "num_ops": 1, "seconds": 0.1, "errors": []},
            "plans": [],
            "tokens": [1, 2],
            "logits": logits,
        }
    ]
    import torch

    want = torch.from_numpy(logits.copy())
    assert _report(DemoOptions(), reports, [], [1, 2], want)["match"]
    want[3] = 1e-7
    assert not _report(DemoOptions(), reports, [], [1, 2], want)["match"]
    assert not _report(DemoOptions(), reports, [], [1, 3], torch.from_numpy(logits))["match"]


def test_bad_geometry_is_refused_with_the_field_named():
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--decode-tp", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "num_kv_heads" in done.stderr


def test_demo_is_quiet_by_default():
    """What `make demo` prints: the plan, the transfer and the verdict, and nothing of
    Mooncake's known-harmless lines, with MC_LOG_LEVEL left to kvxfer."""
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env=_env(MC_LOG_LEVEL=None),
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout
    assert lines[-1] == "MATCH", done.stdout
    assert len(lines) < 30, done.stdout
    assert "Local segment descriptor" not in done.stdout
    assert "InitGoogleLogging" not in done.stdout
    assert not [line for line in lines if line[:1] in "IWE" and ".cpp:" in line], done.stdout
    assert "/5 [" not in done.stdout  # no progress bar when not on a terminal


def test_verbose_shows_mooncake_logs():
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--verbose", *SMALL],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(MC_LOG_LEVEL=None),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == "MATCH"
    assert "transfer_engine" in done.stderr  # Mooncake's INFO lines, unfiltered


def test_progress_bar_on_a_terminal_only_and_never_with_json():
    code, out = run_in_terminal(*SMALL)
    assert code == 0, out
    assert "/5 [" in out and "transfer and decode" in out, out  # the tqdm bar, on stderr
    assert out.rstrip().endswith("MATCH"), out
    assert "Local segment descriptor" not in out and "InitGoogleLogging" not in out

    code, out = run_in_terminal("--json", *SMALL)
    assert code == 0, out
    assert "/5 [" not in out, out
    assert json.loads(out)["match"]  # nothing but the JSON object, even on a terminal


@pytest.mark.parametrize("line", HARMLESS)
def test_known_harmless_lines_are_recognized(line):
    assert is_harmless(line.encode())
    assert is_harmless(line.encode() + b"\r")


@pytest.mark.parametrize(
    "line",
    [
        "E1130 18:11:41.097067 15688 transfer_metadata.cpp:1098] Local segment descriptor lost",
        "E1130 18:11:41.097067 15688 transfer_engine.cpp:12] Failed to open segment",
        "W1130 18:11:41.097067 15688 transfer_metadata.cpp:1098] "
        "Local segment descriptor not found",
        "Traceback (most recent call last):",
        "",
    ],
)
def test_other_lines_are_not_harmless(line):
    assert not is_harmless(line.encode())


FILTER_SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from kvxfer.cli.native_logs import filtered_stderr
    harmless = [line + "\\n" for line in json.loads(sys.argv[1])]
    child = "import os, sys; os.write(2, sys.argv[1].encode())"
    with filtered_stderr() as console:
        for line in harmless:
            os.write(2, line.encode())
        os.write(2, b"E1130 18:11:41.097067 1 transfer_engine.cpp:12] a real error\\n")
        print("from python", file=sys.stderr)
        subprocess.run([sys.executable, "-c", child, harmless[1]], check=True)
        subprocess.run([sys.executable, "-c", child, "from the child\\n"], check=True)
        console.write("to the terminal\\n")
        os.write(2, b"no newline")
    print("after", file=sys.stderr)
    """
)


def test_stderr_filter_drops_only_the_harmless_lines(tmp_path):
    """Written to fd 2 by this process and by children it starts, as glog does from C++."""
    script = tmp_path / "filter.py"
    script.write_text(FILTER_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(HARMLESS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "Local segment descriptor" not in err and "InitGoogleLogging" not in err, err
    for kept in ("a real error", "from python", "from the child", "to the terminal"):
        assert kept in err, err
    assert "no newline" in err and err.rstrip().endswith("after"), err
