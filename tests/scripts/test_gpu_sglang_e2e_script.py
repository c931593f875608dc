"""scripts/gpu_sglang_e2e.sh on a CPU machine.

The script runs real `sglang.launch_server` engines and `sglang-router` on a GPU, which CI has
not. Here it runs whole against stand-ins on 127.0.0.1 (real processes, real sockets, real
HTTP): an `sglang.launch_server` whose greedy completion is a pure function of the prompt, and
whose decode answers only requests that carry the bootstrap fields; an
`sglang_router.launch_router` that injects them and sends each request to both engines, as
SGLang's router does. So the order of steps, each engine's arguments, the comparison, the
failure messages and the clean-up run as they would on a GPU machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import REPO

from kvxfer.addresses import free_ports

ROOT = REPO
SCRIPT = ROOT / "scripts" / "gpu_sglang_e2e.sh"

# What both stand-ins serve alike: JSON replies, and /health.
FAKE_HTTP = textwrap.dedent(
    """
    import json
    from http.server import BaseHTTPRequestHandler


    class JsonHandler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self):
            return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

        def do_GET(self):
            self.reply(200 if self.path == "/health" else 404, {})
    """
)

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, json, os, sys
    from http.server import ThreadingHTTPServer
    from fake_http import JsonHandler

    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
    p.add_argument("--mem-fraction-static"); p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--disaggregation-mode", default="null")
    p.add_argument("--disaggregation-transfer-backend")
    p.add_argument("--disaggregation-bootstrap-port", type=int)
    p.add_argument("--base-gpu-id", type=int); p.add_argument("--kv-cache-dtype")
    args, speculative = p.parse_known_args()  # SPEC_ARGS: recorded in argv
    assert all(a.startswith("--speculative-") for a in speculative[::2]), speculative
    mode = args.disaggregation_mode
    with open(os.path.join(os.environ["FAKE_SGLANG_RECORD"], f"{mode}.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "pid": os.getpid()}, f)
    print(f"fake sglang {args.model_path}: mode {mode}", flush=True)
    if os.environ.get("FAKE_SGLANG_CRASH") == mode:
        sys.exit("fake crash at start")
    if os.environ.get("FAKE_SGLANG_HANG") == mode:
        import time
        time.sleep(3600)

    def greedy(prompt, n):
        text = " ".join(reversed(prompt.split()))[: 4 * n]
        if mode == "decode" and os.environ.get("FAKE_SGLANG_DIVERGE"):
            text = text.replace("France", "Spain")
        return text

    class Handler(JsonHandler):
        def do_POST(self):
            body = self.body()
            if mode != "null" and not {"bootstrap_host", "bootstrap_room"} <= set(body):
                return self.reply(400, {"error": "no bootstrap fields"})
            if os.environ.get("FAKE_SGLANG_FAIL") == mode:
                print("fake transfer failure", flush=True)
                return self.reply(500, {"error": "fake transfer failure"})
            params = body["sampling_params"]
            assert params["temperature"] == 0
            self.reply(200, {"text": greedy(body["text"], params["max_new_tokens"])})

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    """
)

FAKE_ROUTER = textwrap.dedent(
    """
    import argparse, json, os, random, threading, urllib.request
    from http.server import ThreadingHTTPServer
    from fake_http import JsonHandler

    p = argparse.ArgumentParser()
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--prefill", nargs=2); p.add_argument("--decode")
    p.add_argument("--host"); p.add_argument("--port", type=int)
    args = p.parse_args()
    with open(os.path.join(os.environ["FAKE_SGLANG_RECORD"], "router.json"), "w") as f:
        json.dump({"args": vars(args), "pid": os.getpid()}, f)
    prefill_url, bootstrap_port = args.prefill

    def post(url, body):
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as response:
            return json.load(response)

    class Handler(JsonHandler):
        def do_POST(self):
            body = self.body()
            body.update(bootstrap_host="127.0.0.1", bootstrap_port=int(bootstrap_port),
                        bootstrap_room=random.getrandbits(63))
            prefill = threading.Thread(target=post, args=(prefill_url, body))
            prefill.start()
            answer = post(args.decode, body)
            prefill.join()
            self.reply(200, answer)

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    """
)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    site = tmp_path / "site"
    for package, module, text in (
        ("sglang", "launch_server", FAKE_SERVER),
        ("sglang_router", "launch_router", FAKE_ROUTER),
    ):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        (site / package / f"{module}.py").write_text(text)
    (site / "fake_http.py").write_text(FAKE_HTTP)
    (tmp_path / "record").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_SGLANG", "KVXFER"))}
    names = ("BASELINE_PORT", "PREFILL_PORT", "DECODE_PORT", "ROUTER_PORT", "BOOTSTRAP_PORT")
    env.update(zip(names, map(str, free_ports(len(names))), strict=True))
    env.update(
        PYTHON=sys.executable,
        PYTHONPATH=str(site),
        OUT_DIR=str(tmp_path / "out"),
        FAKE_SGLANG_RECORD=str(tmp_path / "record"),
        START_TIMEOUT="180",  # bounds a hang only: a stand-in answers in a second when idle
        **extra,
    )
    return env


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )


def _records(tmp_path: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (tmp_path / "record").glob("*.json")}


def _all_stopped(records: dict[str, dict]) -> bool:
    """Whether every recorded process is gone (each killed, even when the test fails)."""
    pids = [r["pid"] for r in records.values()]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [p for p in pids if _alive(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return not alive


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie left to a parent that does not reap does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_script_compares_pd_through_the_router_with_one_engine(tmp_path):
    env = _env(tmp_path)
    done = _run(env)
    assert done.returncode == 0, done.stderr
    assert "MATCH: every greedy output" in done.stdout
    out = tmp_path / "out"
    baseline = (out / "baseline.jsonl").read_text().splitlines()
    assert len(baseline) == 5 and json.loads(baseline[0]) == "is France of capital The"
    assert (out / "disaggregated.jsonl").read_text().splitlines() == baseline
    records = _records(tmp_path)
    assert set(records) == {"null", "prefill", "decode", "router"}
    prefill, decode = records["prefill"]["argv"], records["decode"]["argv"]
    for argv, page in ((prefill, "16"), (decode, "64")):
        assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "kvxfer"
        assert argv[argv.index("--page-size") + 1] == page
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == env["BOOTSTRAP_PORT"]
    router = records["router"]["args"]
    assert router["pd_disaggregation"] and router["prefill"][1] == env["BOOTSTRAP_PORT"]
    assert router["decode"] == f"http://127.0.0.1:{env['DECODE_PORT']}"
    assert _all_stopped(records)


def test_each_engine_gets_its_kv_dtype_and_every_engine_the_speculative_arguments(tmp_path):
    # A bf16 prefill feeding an fp8 decode: the one engine alone runs the decode's dtype.
    spec = "--speculative-algorithm EAGLE --speculative-draft-model-path D"
    env = _env(tmp_path, DECODE_KV_DTYPE="fp8_e4m3", SPEC_ARGS=spec)
    done = _run(env)
    assert done.returncode == 0, done.stderr
    records = _records(tmp_path)
    for name, dtype in (("null", "fp8_e4m3"), ("prefill", "auto"), ("decode", "fp8_e4m3")):
        argv = records[name]["argv"]
        assert argv[argv.index("--kv-cache-dtype") + 1] == dtype, name
        assert " ".join(argv[argv.index("--speculative-algorithm") :][:4]) == spec, name
    assert _all_stopped(records)


def test_a_different_output_fails_with_the_diff_and_the_decodes_log(tmp_path):
    done = _run(_env(tmp_path, FAKE_SGLANG_DIVERGE="1"))
    assert done.returncode == 1
    assert "MISMATCH" in done.stderr and "Spain" in done.stderr
    assert "fake sglang" in done.stderr and "mode decode" in done.stderr  # the log's tail
    assert _all_stopped(_records(tmp_path))


def test_a_failed_generation_fails_with_the_decodes_log(tmp_path):
    done = _run(_env(tmp_path, FAKE_SGLANG_FAIL="decode"))
    assert done.returncode == 1
    assert "generating through port" in done.stderr and "fake transfer failure" in done.stderr
    assert _all_stopped(_records(tmp_path))


def test_an_engine_that_dies_at_start_stops_everything_with_its_log(tmp_path):
    done = _run(_env(tmp_path, FAKE_SGLANG_CRASH="decode"))
    assert done.returncode == 1
    assert "decode exited before it answered /health" in done.stderr
    assert "fake crash at start" in done.stderr
    records = _records(tmp_path)
    assert "router" not in records and _all_stopped(records)


def test_a_signal_while_an_engine_starts_stops_everything(tmp_path):
    env = _env(tmp_path, FAKE_SGLANG_HANG="decode")
    script = subprocess.Popen(
        ["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        decode = tmp_path / "record" / "decode.json"
        prefill_up = False
        # Both engines started, and the script waits on them (the prefill answers /health).
        while not (decode.exists() and prefill_up) and script.poll() is None:
            time.sleep(0.05)
            prefill_up = _answers(int(env["PREFILL_PORT"]))
        assert decode.exists(), f"the decode never started: {script.communicate()[1]}"
        script.send_signal(signal.SIGTERM)
        script.communicate(timeout=60)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 143
    records = _records(tmp_path)
    assert set(records) == {"null", "prefill", "decode"} and _all_stopped(records)


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
