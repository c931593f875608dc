#!/usr/bin/env bash
# Real vLLM engines on one NVIDIA GPU, one command: greedy outputs through kvxfer's P/D
# disaggregation equal those of one engine alone.
#
#   scripts/gpu_vllm_e2e.sh [--model NAME_OR_PATH] [--max-tokens N] [--out-dir DIR]
#
# 1. checks the prerequisites (nvidia-smi, setsid; vLLM, Mooncake's CUDA wheel and kvxfer
#    importable by $PYTHON) and that the ports are free, then runs the GPU correctness checks
#    (`pytest -m cuda tests/kernels`: the kernels and kvxfer.reshard, bit for bit on the GPU;
#    they fail, not skip, when torch sees no GPU) and stops if one fails;
# 2. starts a baseline `vllm serve` alone, collects greedy completions (temperature 0, fixed
#    seed and max_tokens, one request at a time) of a fixed prompt set, stops it;
# 3. starts a prefill engine (kv_producer, blocks of 16, layout LBNHC) and then a decode engine
#    (kv_consumer, blocks of 32, layout LBHNC) on the same GPU, each with part of its memory,
#    and kvxfer's P/D proxy in front of them;
# 4. sends the same prompts through the proxy and compares token ids and text exactly, and
#    checks on the decode engine's /metrics that its prompt KV was loaded through the connector.
# Exits 0 only when every output is equal and KV was transferred. On failure it prints the
# tails of the engines' logs. Child processes are always stopped (each runs in its own process
# group). Logs, outputs and report.json stay in the output directory.
#
# Needs: one NVIDIA GPU; pip install 'kvxfer[vllm,test]' mooncake-transfer-engine (the CUDA
# wheel; it needs libibverbs1: scripts/install-system-deps.sh); the model in the Hugging Face
# cache or network access to download it.
#
# Environment (defaults in brackets):
#   PYTHON [python3]  the interpreter with vllm, mooncake and kvxfer
#   MODEL [Qwen/Qwen2.5-0.5B-Instruct]  MAX_TOKENS [32]  SEED [0]  MAX_MODEL_LEN [4096]
#   BASELINE_PORT [8300]  PREFILL_PORT [8100]  DECODE_PORT [8200]  PROXY_PORT [8000]
#   SIDE_CHANNEL_PORT [5700]  prefill TP rank r's side channel listens on SIDE_CHANNEL_PORT + r
#   PREFILL_BLOCK_SIZE [16]  DECODE_BLOCK_SIZE [32]  PREFILL_LAYOUT [LBNHC]  DECODE_LAYOUT [LBHNC]
#   BASELINE_GPU_UTIL [0.4]  PREFILL_GPU_UTIL [0.4]  DECODE_GPU_UTIL [0.4]
#   STRATEGY []  force a kvxfer strategy (direct, pack, unpack, pack+unpack); default: cost model
#   KVXFER_EXTRA_CONFIG []  a JSON object of more kv_connector_extra_config keys, both engines
#   ENGINE_ARGS [--enforce-eager]  more `vllm serve` arguments, for all three engines
#   START_TIMEOUT [900]  seconds for an engine to answer /health (a first run downloads the model)
#   REQUEST_TIMEOUT [300]  STOP_TIMEOUT [30]  OUT_DIR [a new temporary directory]
#   NVIDIA_SMI [nvidia-smi]
#   CUDA_CHECKS [tests/kernels]  what `pytest -m cuda` runs first, relative to the repository ("" skips)
#   PROBE_BACKENDS [FLASH_ATTN TRITON_ATTN]  backends whose own cache write kvxfer's layout
#     table is checked against (kvxfer.testing.backend_probe), before the engines start ("" skips it)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
helper="$here/gpu_vllm_e2e.py"

PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
MAX_TOKENS="${MAX_TOKENS:-32}"
SEED="${SEED:-0}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"
BASELINE_PORT="${BASELINE_PORT:-8300}"
PREFILL_PORT="${PREFILL_PORT:-8100}"
DECODE_PORT="${DECODE_PORT:-8200}"
PROXY_PORT="${PROXY_PORT:-8000}"
SIDE_CHANNEL_PORT="${SIDE_CHANNEL_PORT:-5700}"
PREFILL_BLOCK_SIZE="${PREFILL_BLOCK_SIZE:-16}"
DECODE_BLOCK_SIZE="${DECODE_BLOCK_SIZE:-32}"
PREFILL_LAYOUT="${PREFILL_LAYOUT:-LBNHC}"
DECODE_LAYOUT="${DECODE_LAYOUT:-LBHNC}"
BASELINE_GPU_UTIL="${BASELINE_GPU_UTIL:-0.4}"
PREFILL_GPU_UTIL="${PREFILL_GPU_UTIL:-0.4}"
DECODE_GPU_UTIL="${DECODE_GPU_UTIL:-0.4}"
STRATEGY="${STRATEGY:-}"
KVXFER_EXTRA_CONFIG="${KVXFER_EXTRA_CONFIG:-}"
ENGINE_ARGS="${ENGINE_ARGS---enforce-eager}"
START_TIMEOUT="${START_TIMEOUT:-900}"
REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-300}"
STOP_TIMEOUT="${STOP_TIMEOUT:-30}"
OUT_DIR="${OUT_DIR:-}"
NVIDIA_SMI="${NVIDIA_SMI:-nvidia-smi}"
CUDA_CHECKS="${CUDA_CHECKS-tests/kernels}"
PROBE_BACKENDS="${PROBE_BACKENDS-FLASH_ATTN TRITON_ATTN}"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="${2:?--model needs a model name or path}"; shift 2 ;;
    --max-tokens) MAX_TOKENS="${2:?--max-tokens needs a number}"; shift 2 ;;
    --out-dir) OUT_DIR="${2:?--out-dir needs a directory}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_vllm_e2e: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "gpu_vllm_e2e: $*" >&2; exit 1; }

# --- 1. prerequisites, before anything starts ---------------------------------------------
command -v "$NVIDIA_SMI" >/dev/null 2>&1 ||
  die "nvidia-smi not found: this check runs real vLLM engines and needs an NVIDIA GPU" \
    "with its driver (CI machines have none; its CPU tests: tests/scripts/test_gpu_vllm_e2e_script.py)"
"$NVIDIA_SMI" -L >/dev/null 2>&1 ||
  die "nvidia-smi -L fails: no usable NVIDIA GPU or driver on this machine"
command -v setsid >/dev/null 2>&1 || die "setsid not found: install util-linux"
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON: set PYTHON to the interpreter with vLLM"
"$PYTHON" "$helper" prereqs --ports "$BASELINE_PORT" "$PREFILL_PORT" "$DECODE_PORT" \
  "$PROXY_PORT" "$SIDE_CHANNEL_PORT" "$((SIDE_CHANNEL_PORT + 100))"
if [ -n "$CUDA_CHECKS" ]; then
  "$PYTHON" -c "import pytest" >/dev/null 2>&1 ||
    die "pytest is not importable by $PYTHON: pip install 'kvxfer[test]' (the GPU correctness" \
      "checks run first; CUDA_CHECKS= skips them)"
fi

[ -n "$OUT_DIR" ] || OUT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvxfer-gpu-e2e.XXXXXX")"
mkdir -p "$OUT_DIR"
# A reused directory: only this run's logs and outputs may be shown or compared.
for stale in baseline prefill decode proxy; do rm -f "$OUT_DIR/$stale.log"; done
rm -f "$OUT_DIR/baseline.json" "$OUT_DIR/disaggregated.json" "$OUT_DIR/report.json"
rm -f "$OUT_DIR"/probe-*.jsonl "$OUT_DIR/cuda-checks.log"
read -r -a vllm_args <<<"$ENGINE_ARGS"
secret="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
host=127.0.0.1
# The proxy reaches the engines on this host directly, whatever HTTP proxy the environment sets.
export no_proxy="$host,localhost${no_proxy:+,$no_proxy}"
export NO_PROXY="$host,localhost${NO_PROXY:+,$NO_PROXY}"

# --- process groups: every child this script starts, stopped on any exit ----------------------
groups=()

stop_all() {  # every process group this script started: SIGTERM, then SIGKILL after a while
  local pgid
  [ ${#groups[@]} -gt 0 ] || return 0
  if ! "$PYTHON" "$helper" stop "${groups[@]}" --timeout "$STOP_TIMEOUT"; then
    for pgid in "${groups[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
  fi
  for pgid in "${groups[@]}"; do wait "$pgid" 2>/dev/null || true; done
  groups=()
}

print_log_tails() {
  local log
  for log in "$OUT_DIR"/*.log; do
    [ -f "$log" ] || continue
    echo "---- last 40 lines of $log ----" >&2
    tail -n 40 "$log" >&2 || true
  done
}

helper_pid=""
run_helper() {  # the helper in the background: a signal to this script is acted on at once
  "$PYTHON" "$helper" "$@" &
  helper_pid=$!
  wait "$helper_pid"
}

finish() {
  local status=$?
  trap - EXIT
  [ -z "$helper_pid" ] || kill "$helper_pid" 2>/dev/null || true
  if [ "$status" -ne 0 ] && [ -n "${OUT_DIR:-}" ]; then
    print_log_tails
    echo "gpu_vllm_e2e: FAILED (exit $status); logs and outputs in $OUT_DIR" >&2
  fi
  stop_all
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

launched=""
launch() {  # NAME [VAR=VALUE...] -- COMMAND...: COMMAND in a new process group, logs to NAME.log
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env ${envs[@]+"${envs[@]}"} setsid "$@" >"$OUT_DIR/$name.log" 2>&1 &
  launched=$!
  groups+=("$launched")
}

start_engine() {  # NAME PORT LAYOUT GPU_UTIL [vllm serve arguments...]
  local name=$1 port=$2 layout=$3 util=$4; shift 4
  local envs=()
  [ -z "$layout" ] || envs+=("VLLM_KV_CACHE_LAYOUT=$layout")
  echo "starting the $name engine on port $port${layout:+ (layout $layout)}: log $OUT_DIR/$name.log"
  launch "$name" ${envs[@]+"${envs[@]}"} -- "$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL" \
    --host "$host" --port "$port" --seed "$SEED" --gpu-memory-utilization "$util" \
    --max-model-len "$MAX_MODEL_LEN" --no-enable-prefix-caching \
    ${vllm_args[@]+"${vllm_args[@]}"} "$@"
  run_helper wait "http://$host:$port/health" --timeout "$START_TIMEOUT" --pid "$launched"
}

kv_config() {  # ROLE ENGINE_ID SIDE_CHANNEL_PORT
  "$PYTHON" "$helper" kv-config "$1" "$2" --side-channel-port "$3" --secret "$secret" \
    --host "$host" --strategy "$STRATEGY" --extra "$KVXFER_EXTRA_CONFIG"
}

collect() {  # URL OUT [collect arguments...]
  local url=$1 out=$2; shift 2
  run_helper collect "$url" --model "$MODEL" --out "$out" --max-tokens "$MAX_TOKENS" \
    --seed "$SEED" --timeout "$REQUEST_TIMEOUT" "$@"
}

# Built before anything starts: a bad KVXFER_EXTRA_CONFIG stops the run here.
prefill_config="$(kv_config kv_producer kvxfer-e2e-prefill "$SIDE_CHANNEL_PORT")"
decode_config="$(kv_config kv_consumer kvxfer-e2e-decode "$((SIDE_CHANNEL_PORT + 100))")"

"$NVIDIA_SMI" -L
echo "model $MODEL; outputs and logs in $OUT_DIR"

# --- 1a. the GPU correctness checks, before any engine ---------------------------------------
if [ -n "$CUDA_CHECKS" ]; then
  read -r -a cuda_checks <<<"$CUDA_CHECKS"
  echo "GPU correctness checks: pytest -m cuda ${CUDA_CHECKS}: log $OUT_DIR/cuda-checks.log"
  # In the background, as run_helper does: a signal to this script is acted on at once.
  # -o addopts=: the project's pytest options name plugins that only the suite needs.
  (cd "$root" && exec env KVXFER_REQUIRE_CUDA=1 "$PYTHON" -m pytest -o addopts= -m cuda -q -ra \
    -p no:cacheprovider "${cuda_checks[@]}") >"$OUT_DIR/cuda-checks.log" 2>&1 &
  helper_pid=$!
  wait "$helper_pid" || die "the GPU correctness checks failed: see $OUT_DIR/cuda-checks.log"
  tail -n 1 "$OUT_DIR/cuda-checks.log"
fi

# --- 1b. kvxfer's layout table against the GPU backends' own cache-write ops ---------------
for backend in $PROBE_BACKENDS; do
  echo "probing kvxfer's layout of $backend against its cache write: $OUT_DIR/probe-$backend.jsonl"
  "$PYTHON" -m kvxfer.testing.backend_probe --backend "$backend" --device cuda \
    >"$OUT_DIR/probe-$backend.jsonl" ||
    die "kvxfer reads $backend's cache wrongly: see $OUT_DIR/probe-$backend.jsonl"
done

# --- 2. the baseline: one engine, no connector ---------------------------------------------
start_engine baseline "$BASELINE_PORT" "" "$BASELINE_GPU_UTIL"
collect "http://$host:$BASELINE_PORT" "$OUT_DIR/baseline.json"
stop_all

# --- 3. prefill, then decode (sequentially: vLLM profiles GPU memory at start), then the proxy
start_engine prefill "$PREFILL_PORT" "$PREFILL_LAYOUT" "$PREFILL_GPU_UTIL" \
  --block-size "$PREFILL_BLOCK_SIZE" \
  --kv-transfer-config "$prefill_config"
start_engine decode "$DECODE_PORT" "$DECODE_LAYOUT" "$DECODE_GPU_UTIL" \
  --block-size "$DECODE_BLOCK_SIZE" \
  --kv-transfer-config "$decode_config"
echo "starting the P/D proxy on port $PROXY_PORT: log $OUT_DIR/proxy.log"
launch proxy -- "$PYTHON" -m kvxfer.integrations.pd_proxy --host "$host" --port "$PROXY_PORT" \
  --prefill "http://$host:$PREFILL_PORT" --decode "http://$host:$DECODE_PORT" \
  --timeout "$REQUEST_TIMEOUT"
run_helper wait "http://$host:$PROXY_PORT/" --any-status --timeout 60 --pid "$launched"

# --- 4. the same prompts through the proxy; compare ----------------------------------------
collect "http://$host:$PROXY_PORT" "$OUT_DIR/disaggregated.json" \
  --metrics-url "http://$host:$DECODE_PORT/metrics"
"$PYTHON" "$helper" compare "$OUT_DIR/baseline.json" "$OUT_DIR/disaggregated.json" \
  --report "$OUT_DIR/report.json"
echo "report: $OUT_DIR/report.json"
