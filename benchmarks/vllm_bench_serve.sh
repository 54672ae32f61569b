#!/usr/bin/env bash
# vLLM's own load client, `vllm bench serve`, against vLLM 0.32's OpenAI server and against
# `minipaged serve`, one server after the other, on the same checkpoint (the course model),
# float32, --max-num-seqs 64. Each server is warmed up by the client's own warm-up requests.
# Writes each run's result JSON (vLLM's format) to OUT_DIR and prints both result blocks.
#
# usage: bash benchmarks/vllm_bench_serve.sh [OUT_DIR]      (needs .venv-vllm: scripts/setup_vllm_venv.sh)
# env:   RATE (32), NUM_PROMPTS (200), INPUT_LEN (64), OUTPUT_LEN (48), MINIPAGED (minipaged),
#        ORDER ("vllm minipaged"; alternate it between runs: a shared machine drifts),
#        MINIPAGED_ARGS (extra `minipaged serve` arguments: for RATE=inf with more prompts than
#        its --max-waiting-requests (256), raise it, or the rest get 503s where vLLM queues)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/benchmarks/results/vllm_bench_serve}"
VLLM_PY="${MINIPAGED_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}"
MODEL="$ROOT/minipaged/data/course_model"
RATE="${RATE:-32}" NUM_PROMPTS="${NUM_PROMPTS:-200}" INPUT_LEN="${INPUT_LEN:-64}" OUTPUT_LEN="${OUTPUT_LEN:-48}"
mkdir -p "$OUT"
port() { "$VLLM_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_health() {  # url pid
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited before /health answered" >&2; return 1; }
    sleep 1
  done
  echo "server not healthy after 600 s" >&2; return 1
}
bench() {  # name url
  # NOTE: PYTHONPATH unset: vLLM's venv, not this checkout
  env -u PYTHONPATH "$VLLM_PY" "$ROOT/benchmarks/vllm_cli.py" bench serve \
    --backend openai --base-url "$2" --endpoint /v1/completions --model course --tokenizer "$MODEL" \
    --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --num-prompts "$NUM_PROMPTS" --request-rate "$RATE" --ignore-eos --seed 0 --num-warmups 8 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm \
    --save-result --result-dir "$OUT" --result-filename "$1.json" 2>&1 | tee "$OUT/$1.txt" \
    | sed -n '/Serving Benchmark Result/,/^=\+$/p'
}
run() {  # name command...
  local name=$1; shift
  local p; p=$(port)
  "$@" --port "$p" >"$OUT/$name.server.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  wait_health "http://127.0.0.1:$p" "$pid"
  echo "== $name (rate $RATE/s, $NUM_PROMPTS prompts, $INPUT_LEN in / $OUTPUT_LEN out, ignore_eos)"
  bench "$name" "http://127.0.0.1:$p"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  trap - EXIT
}
start_vllm() {
  run vllm env -u PYTHONPATH VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --served-model-name course --dtype float32 --max-num-seqs 64 \
    --host 127.0.0.1 --disable-uvicorn-access-log
}
start_minipaged() {
  run minipaged "${MINIPAGED:-minipaged}" serve --model "$MODEL" --served-model-name course \
    --dtype float32 --max-num-seqs 64 --host 127.0.0.1 ${MINIPAGED_ARGS:-}
}
for server in ${ORDER:-vllm minipaged}; do "start_$server"; done
