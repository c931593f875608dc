#!/usr/bin/env bash
# Real SGLang engines on one NVIDIA GPU, one command: greedy outputs through prefill-decode
# disaggregation with kvxfer's transfer backend equal those of one engine alone.
#
#   scripts/gpu_sglang_e2e.sh
#
# 1. starts one `sglang.launch_server` alone, collects greedy completions (temperature 0,
#    MAX_TOKENS new tokens) of a fixed prompt set, stops it;
# 2. starts a prefill engine (pages of PREFILL_PAGE tokens) and a decode engine (pages of
#    DECODE_PAGE tokens) with `--disaggregation-transfer-backend kvxfer` on the same GPU, and
#    `sglang-router` in P/D mode in front of them (it injects bootstrap_host, bootstrap_port and
#    bootstrap_room into both requests);
# 3. sends the same prompts through the router and compares the texts exactly.
# Exits 0 only when every output is equal. Logs stay in OUT_DIR; every engine is stopped.
# A CPU machine cannot run it: SGLang's `serve` needs CUDA kernels (make test-sglang runs
# SGLang's own classes on CPU instead).
#
# Needs: one NVIDIA GPU; pip install 'kvxfer[sglang]' sglang-router mooncake-transfer-engine
# (the CUDA wheel; it needs libibverbs1: scripts/install-system-deps.sh); the model in the
# Hugging Face cache or network access.
#
# Environment (defaults in brackets): PYTHON [python3]  MODEL [Qwen/Qwen2.5-0.5B-Instruct]
#   MAX_TOKENS [32]  PREFILL_PAGE [16]  DECODE_PAGE [64]  MEM_FRACTION [0.3]
#   BASELINE_PORT [30300]  PREFILL_PORT [30100]  DECODE_PORT [30200]  ROUTER_PORT [30000]
#   BOOTSTRAP_PORT [8998]  START_TIMEOUT [900]  OUT_DIR [a new temporary directory]
#   KVXFER_CONFIG []  kvxfer's settings as JSON (docs/sglang.md)
#   PREFILL_KV_DTYPE [auto]  DECODE_KV_DTYPE [auto]  each engine's --kv-cache-dtype; the one
#   engine alone runs the decode's (`DECODE_KV_DTYPE=fp8_e4m3`: a bf16 prefill feeds an fp8
#   decode, which holds what its own fp8 write makes: docs/sglang.md, "Different KV dtypes")
#   SPEC_ARGS []  speculative decoding's arguments for every engine, e.g. "--speculative-algorithm
#   EAGLE --speculative-draft-model-path D --speculative-num-steps 3 --speculative-eagle-topk 1
#   --speculative-num-draft-tokens 4" (the draft's pool moves with the target's)
# The cases: the default model (full attention); DECODE_KV_DTYPE=fp8_e4m3 (dtypes); SPEC_ARGS
# with an EAGLE draft; a sliding-window model SGLang keeps in its SWAKVPool, e.g.
# MODEL=openai/gpt-oss-20b (window 128 on every other layer: the prompts cross it; Gemma 2 and
# 3 are not among SGLang 0.5.23's hybrid-SWA architectures: one pool, windows in attention;
# docs/sglang.md, "Sliding-window models");
# a Mamba hybrid, e.g. MODEL=tiiuae/Falcon-H1-0.5B-Instruct (Mamba2 mixers beside attention:
# each request's conv and temporal state slot moves with its KV; docs/sglang.md, "Mamba and
# linear attention").
set -euo pipefail

PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
MAX_TOKENS="${MAX_TOKENS:-32}"
PREFILL_PAGE="${PREFILL_PAGE:-16}"
DECODE_PAGE="${DECODE_PAGE:-64}"
MEM_FRACTION="${MEM_FRACTION:-0.3}"
BASELINE_PORT="${BASELINE_PORT:-30300}"
PREFILL_PORT="${PREFILL_PORT:-30100}"
DECODE_PORT="${DECODE_PORT:-30200}"
ROUTER_PORT="${ROUTER_PORT:-30000}"
BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-8998}"
START_TIMEOUT="${START_TIMEOUT:-900}"
PREFILL_KV_DTYPE="${PREFILL_KV_DTYPE:-auto}"
DECODE_KV_DTYPE="${DECODE_KV_DTYPE:-auto}"
OUT_DIR="${OUT_DIR:-$(mktemp -d -t kvxfer-sglang-e2e.XXXXXX)}"
mkdir -p "$OUT_DIR"
pids=()
declare -A pid_of=()

stop_all() {  # every process group started, SIGTERM then (after 10 s) SIGKILL
    local pid waited=0
    for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        while kill -0 -- "-$pid" 2>/dev/null && ((waited < 50)); do
            sleep 0.2
            waited=$((waited + 1))
        done
        kill -9 -- "-$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() {  # start NAME ARGS...: a process group of its own, its log in OUT_DIR
    local name="$1"
    shift
    setsid "$@" >"$OUT_DIR/$name.log" 2>&1 &
    pids+=("$!")
    pid_of[$name]=$!
}

fail_with_log() {  # fail_with_log NAME MESSAGE: the message and the tail of NAME's log; exit 1
    echo "$2; the last 50 lines of $OUT_DIR/$1.log:" >&2
    tail -n 50 "$OUT_DIR/$1.log" >&2
    exit 1
}

wait_healthy() {  # wait_healthy PORT NAME: its /health answers, or it died, or START_TIMEOUT
    local deadline=$((SECONDS + START_TIMEOUT))
    until curl -sf "http://127.0.0.1:$1/health" >/dev/null; do
        if ! kill -0 "${pid_of[$2]}" 2>/dev/null; then
            fail_with_log "$2" "$2 exited before it answered /health"
        fi
        if ((SECONDS > deadline)); then
            fail_with_log "$2" "$2 did not start in ${START_TIMEOUT}s"
        fi
        sleep 0.5
    done
}

generate() {  # generate PORT OUT_FILE NAME: greedy completions, one JSON per line; fails with
    # NAME's log. In the background, so that a signal stops the script at once.
    "$PYTHON" - "$1" "$2" "$MAX_TOKENS" <<'PY' &
import json, sys, urllib.request
port, out, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = ["The capital of France is", "Write a haiku about the sea:",
           "List three prime numbers greater than 100:", "def fibonacci(n):" + " #" * 200,
           "Count the tides: " + " ".join(f"tide {i} comes in." for i in range(200))]
with open(out, "w") as f:
    for prompt in prompts:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as response:
            f.write(json.dumps(json.load(response)["text"]) + "\n")
PY
    wait "$!" || fail_with_log "$3" "generating through port $1 failed"
}

read -r -a spec_args <<<"${SPEC_ARGS:-}"
serve=("$PYTHON" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1
       --mem-fraction-static "$MEM_FRACTION" "${spec_args[@]}")

start baseline "${serve[@]}" --port "$BASELINE_PORT" --kv-cache-dtype "$DECODE_KV_DTYPE"
wait_healthy "$BASELINE_PORT" baseline
generate "$BASELINE_PORT" "$OUT_DIR/baseline.jsonl" baseline
stop_all

start prefill "${serve[@]}" --port "$PREFILL_PORT" --page-size "$PREFILL_PAGE" \
    --kv-cache-dtype "$PREFILL_KV_DTYPE" \
    --disaggregation-mode prefill --disaggregation-transfer-backend kvxfer \
    --disaggregation-bootstrap-port "$BOOTSTRAP_PORT"
start decode "${serve[@]}" --port "$DECODE_PORT" --page-size "$DECODE_PAGE" \
    --kv-cache-dtype "$DECODE_KV_DTYPE" \
    --disaggregation-mode decode --disaggregation-transfer-backend kvxfer --base-gpu-id 0
wait_healthy "$PREFILL_PORT" prefill
wait_healthy "$DECODE_PORT" decode
start router "$PYTHON" -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$PREFILL_PORT" "$BOOTSTRAP_PORT" \
    --decode "http://127.0.0.1:$DECODE_PORT" --host 127.0.0.1 --port "$ROUTER_PORT"
wait_healthy "$ROUTER_PORT" router
generate "$ROUTER_PORT" "$OUT_DIR/disaggregated.jsonl" decode

if cmp -s "$OUT_DIR/baseline.jsonl" "$OUT_DIR/disaggregated.jsonl"; then
    echo "MATCH: every greedy output through kvxfer P/D equals one engine's ($OUT_DIR)"
else
    echo "MISMATCH: $OUT_DIR/baseline.jsonl and $OUT_DIR/disaggregated.jsonl differ" >&2
    diff "$OUT_DIR/baseline.jsonl" "$OUT_DIR/disaggregated.jsonl" >&2 || true
    for name in prefill decode; do
        echo "---- the last 40 lines of $OUT_DIR/$name.log" >&2
        tail -n 40 "$OUT_DIR/$name.log" >&2
    done
    exit 1
fi
