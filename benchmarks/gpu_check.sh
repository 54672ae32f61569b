#!/usr/bin/env bash
# The GPU check: one command that turns a short GPU window into committed results.
#
#   PYTHONPATH=. bash benchmarks/gpu_check.sh OUTDIR             # on a CUDA GPU, from the repo root
#   PYTHONPATH=. bash benchmarks/gpu_check.sh OUTDIR --dry-run   # tiny shapes, CPU, Triton interpreter
#
# Steps, each time-boxed with `timeout` and recorded in OUTDIR/steps.tsv (ok / failed /
# timeout / skipped); a failing step never stops the next one:
#   env                 OUTDIR/env.json: device name, versions, which packages are there
#   kernel_correctness  benchmarks/gpu_kernels_check.py: kernels + cache ops, compiled, vs the torch reference
#   kernel_bench        benchmarks/attention_kernels.py --quick --tune: paged vs contiguous, % of peak, block sizes, figure
#   serving             benchmarks/gpu_serving.py: random 1.1B Llama, bf16, 256 requests, (a)-(d)
#   tensor_parallel     benchmarks/tensor_parallel.py --level model: tp over NCCL, tp = the GPUs (at most 2;
#                       with one GPU a world of one, which still starts NCCL), tokens equal across sizes
#   report              benchmarks/gpu_report.py: OUTDIR/<device-slug>.json + OUTDIR/summary.txt
# A real run then copies the report, summary and figure to OUTDIR/results/ and to
# benchmarks/results/ (for the lead to commit); a dry run writes to OUTDIR only. Total time is kept under GPU_CHECK_TOTAL_S
# (default 450 s, then the report): each step gets min(its budget, what is left). Installs nothing.
set -u

usage="usage: bash benchmarks/gpu_check.sh OUTDIR [--dry-run]"
OUT=${1:-}
if [ -z "$OUT" ] || [ "${OUT#-}" != "$OUT" ]; then echo "$usage" >&2; exit 2; fi
DRY=0
case "${2:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network: never wait on the hub
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # Triton 3.9 warns when unset
PY=${PYTHON:-$(command -v python || command -v python3)}
START=$(date +%s)
TOTAL=${GPU_CHECK_TOTAL_S:-450}  # + the last kill grace (10 s) and the report (<= 30 s): under 8 minutes
RESERVE=25  # kept for the report step
STEPS="$OUT/steps.tsv"
: > "$STEPS"

if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # the CPU path even on a GPU machine
  export TRITON_INTERPRET=1
  DRYFLAG="--dry-run"
  B_ENV=60; B_CORRECT=90; B_KBENCH=60; B_SERVE=120; B_TP=90
  TP_ARGS="--device cpu --model tiny-llama --tp 2 --repeats 1 --max-tokens 4"
else
  DRYFLAG=""
  B_ENV=60; B_CORRECT=110; B_KBENCH=120; B_SERVE=200; B_TP=60  # serving gets >= 145 s of the 450
  TP_ARGS="--device cuda --repeats 3"
fi

now() { date +%s; }
left() { echo $(( TOTAL - ($(now) - START) - RESERVE )); }

has() {  # has PKG: is the Python package there? (env.json says, else try to import it)
  if [ -s "$OUT/env.json" ]; then
    "$PY" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))['packages'].get(sys.argv[2]) else 1)" \
      "$OUT/env.json" "$1" 2>/dev/null
  else
    "$PY" -c "import $1" >/dev/null 2>&1
  fi
}

record() {  # record NAME STATUS RC SECONDS [NOTE]
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >> "$STEPS"
  printf '[gpu_check] %-19s %-8s rc=%-4s %4ss %s\n' "$1" "$2" "$3" "$4" "${5:-}"
}

# run_step NAME BUDGET_S COMMAND...: time-boxed, logged to OUTDIR/NAME.log, never aborts the script.
# The command may read $STEP_S (the seconds it was given) to stop its own work early.
run_step() {
  local name=$1 budget=$2; shift 2
  local l; l=$(left)
  local t=$(( budget < l ? budget : l ))
  if [ "$t" -lt 5 ]; then record "$name" skipped - 0 "total time guard (${TOTAL} s) spent"; return; fi
  export STEP_S=$t
  local s; s=$(now)
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local status=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=timeout; elif [ "$rc" != 0 ]; then status=failed; fi
  record "$name" "$status" "$rc" "$(( $(now) - s ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-150 | tr '\t' ' ')"
}

echo "[gpu_check] repo $REPO -> $OUT (mode: $([ "$DRY" = 1 ] && echo dry-run || echo gpu), total guard ${TOTAL} s)"

run_step env "$B_ENV" "$PY" benchmarks/gpu_report.py env "$OUT" $DRYFLAG
SLUG=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['slug'])" "$OUT/env.json" 2>/dev/null || echo unknown-device)

if ! has torch; then
  record kernel_correctness skipped - 0 "torch missing"
  record kernel_bench skipped - 0 "torch missing"
  record serving skipped - 0 "torch missing"
elif ! has triton; then
  record kernel_correctness skipped - 0 "triton missing"
  record kernel_bench skipped - 0 "triton missing"
  record serving skipped - 0 "triton missing"
else
  run_step kernel_correctness "$B_CORRECT" \
    bash -c '"$0" benchmarks/gpu_kernels_check.py --json "$1/kernel_correctness.json" --budget-s $(( STEP_S - 15 )) $2' \
    "$PY" "$OUT" "$DRYFLAG"
  run_step kernel_bench "$B_KBENCH" \
    bash -c '"$0" benchmarks/attention_kernels.py --quick --tune --budget-s $(( STEP_S - 15 )) --json "$1/kernels.json" --figure "$1/$2_kernels.png" $3' \
    "$PY" "$OUT" "$SLUG" "$DRYFLAG"
  if has transformers; then
    run_step serving "$B_SERVE" \
      bash -c '"$0" benchmarks/gpu_serving.py --json "$1/serving.json" --budget-s $(( STEP_S - 20 )) $2' \
      "$PY" "$OUT" "$DRYFLAG"
  else
    record serving skipped - 0 "transformers missing"
  fi
fi
if has torch && has transformers; then
  if [ "$DRY" = 0 ]; then
    NGPU=$("$PY" -c "import torch; print(min(2, max(1, torch.cuda.device_count())))" 2>/dev/null || echo 1)
    TP_ARGS="$TP_ARGS --tp $NGPU"
  fi
  run_step tensor_parallel "$B_TP" \
    bash -c '"$0" benchmarks/tensor_parallel.py --level model $2 --json > "$1/tensor_parallel.json"' \
    "$PY" "$OUT" "$TP_ARGS"
else
  record tensor_parallel skipped - 0 "torch or transformers missing"
fi

# The report: always, even when every step above failed.
# OUTDIR/results/ holds the files to commit (the device machine may hand back only OUTDIR).
COPY=""
if [ "$DRY" = 0 ]; then COPY="--copy-to $OUT/results --copy-to $REPO/benchmarks/results"; fi
s=$(now)
timeout -k 5 30 "$PY" benchmarks/gpu_report.py combine "$OUT" $COPY > "$OUT/report.log" 2>&1
rc=$?
echo
if [ "$rc" = 0 ]; then
  cat "$OUT/summary.txt"
else
  echo "[gpu_check] the report step failed (rc=$rc), see $OUT/report.log; step statuses:"
  cat "$STEPS"
fi
echo
echo "[gpu_check] finished in $(( $(now) - START )) s; results in $OUT${COPY:+ (files to commit: $OUT/results/, also copied to benchmarks/results/)}"
# Exit status: 0 when every step ran ok (skipped for a missing package counts as ok).
if grep -qE $'\t(failed|timeout)\t' "$STEPS" || [ "$rc" != 0 ]; then exit 1; fi
exit 0
