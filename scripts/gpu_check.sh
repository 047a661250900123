#!/usr/bin/env bash
# The GPU check, as ONE prepared script for a lent GPU machine (the device tool's nvidia-h200:
# torch with CUDA, Triton, numpy, safetensors, tokenizers on its python3; nothing reachable from it).
#
#   here:   python scripts/gpu_wheels.py                    # the wheels it needs, into .whl/ (git-ignored)
#   there:  bash scripts/gpu_check.sh [--quick]             # device tool: carry [".whl"], timeout_s 540
#           bash scripts/gpu_check.sh --dry-run             # print the stages and their budgets, run nothing
#           bash scripts/gpu_check.sh --amx                 # after it, on the same warm machine: the host
#                                                           # CPU's AMX check alone (timeout_s 200, no carry)
#
# Stages, each under its own time budget (`timeout`), each recorded in $OUT/stages.tsv as it ends, so a
# stage that fails or hangs costs only its budget and leaves the others' results:
#   env      the machine: GPU, driver, python3, torch, CUDA, torch's flash varlen op
#   install  .whl/*.whl into /tmp/site (--no-index --no-deps); qasr from src/ on PYTHONPATH
#   tests    the CUDA tests: pytest -k cuda over the parity tests and the CUDA backend's tests
#   bench    benchmarks/throughput.py --device cuda at the real 0.6B dims (random weights): audio-s/s at
#            concurrency 1/16/128 (512 is skipped here: a budget of 0), TTFT, GPU memory, batch invariance,
#            transformers at batch 8 and 32 (--quick: no transformers)
# The whole run stays under TOTAL_S (470 s, under the 8 minutes the issue allows); --quick under 270 s.
#
# The bench stage's budget, in seconds (full | quick). Inner budgets stop themselves (a level, the
# transformers batches, the batch-invariance check); fixed costs are estimates for an H200 and the 0.6B
# dims. tests/e2e/test_gpu_check_script.py checks that the lines add up to the total, that the inner budgets are the
# ones the command passes, and that the total stays under 90% of the stage's budget.
#   fixed  GPU probe: CUDA init, bf16 8192^3 matmuls, 2 GiB copies                  10 |  10
#   fixed  random checkpoint (0.6B dims, ~1.9 GB), written ONCE, read by both sides 25 |  25
#   fixed  qasr process: spawn, load, KV pool, flash self-test, graphs, 4 warm-ups  45 |  35
#   fixed  levels: cancelling what still runs at each budget's end (3 levels)        6 |   6
#   fixed  batch invariance: its clips together, before its own budget counts       5 |   5
#   fixed  transformers process: spawn, import, load, a short warm-up              30 |   0
#   fixed  transformers: its last batch past the budget (see run_reference_gpu)    15 |   0
#   fixed  report and plot                                                          5 |   5
#   inner  levels c=1,16,128 (--gpu-budgets; c=512 has budget 0: skipped)          75 |  31
#   inner  transformers batches 8 and 32 (--gpu-reference-budget; quick: 0)        30 |   0
#   inner  batch invariance, one at a time (GpuPlan.invariance_budget_s)           10 |   8
#   total                                                                         256 | 125
#   bench stage budget                                                            290 | 145
# --amx runs instead: env, then
#   amx      where the host CPU has amx_bf16: qasr's native CPU kernels built there, their tests
#            (tests/engine/cpu/test_amx_linear.py, tests/engine/cpu/test_selftest.py) on real tile instructions, and the bf16 GEMM
#            rates of torch against qasr's AMX and AVX512 kernels (scripts/amx_rates.py -> amx_rates.json);
#            on a CPU without AMX it says so and passes. 180 s in all.
# PYTHON (default python3) and GPU_CHECK_SITE (default /tmp/site) say which interpreter and install folder.
# Files under $OUT (./gpu_out when unset): gpu_check.log, stages.tsv, env.txt, throughput_gpu*.json and .png.
set -u -o pipefail

DRY=0
QUICK=0
AMX=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --quick) QUICK=1 ;;
    --amx) AMX=1 ;;
    -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (use --dry-run, --quick, --amx, --help)" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/gpu_out}"
PY="${PYTHON:-python3}"  # the device's python3 holds torch
SITE="${GPU_CHECK_SITE:-/tmp/site}"
export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export QASR_NO_NATIVE=1  # CPU-side engines in the checks use torch ops: nothing to compile on the GPU machine
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # the image's pytest plugins stay out of the way

if [ "$QUICK" = 1 ]; then
  TOTAL_S=270
  BUDGET_ENV=15; BUDGET_INSTALL=45; BUDGET_TESTS=60; BUDGET_BENCH=145
  BENCH_ARGS="--quick --gpu-budgets 6,10,15,0 --gpu-reference-budget 0"
  TEST_SELECT="tests/engine/cuda/test_cuda_backend.py"
else
  TOTAL_S=470
  BUDGET_ENV=15; BUDGET_INSTALL=45; BUDGET_TESTS=110; BUDGET_BENCH=290
  BENCH_ARGS="--gpu-budgets 10,20,45,0 --gpu-reference-budget 30"
  TEST_SELECT="tests/model/test_transformers_parity.py tests/engine/cuda/test_cuda_backend.py"
fi

STAGES=(env install tests bench)
declare -A BUDGET=([env]=$BUDGET_ENV [install]=$BUDGET_INSTALL [tests]=$BUDGET_TESTS [bench]=$BUDGET_BENCH \
  [amx]=155)
if [ "$AMX" = 1 ]; then
  STAGES=(env amx)
  TOTAL_S=180
fi
# GPU_CHECK_BUDGETS="tests=2,bench=3" overrides stage budgets (the script's own tests use it)
for kv in $(echo "${GPU_CHECK_BUDGETS:-}" | tr , " "); do
  BUDGET[${kv%%=*}]=${kv#*=}
done
declare -A COMMAND=(
  [env]="nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; \
$PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
\"available\", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"\"); \
print(torch.ops.aten._flash_attention_forward.default._schema)'; \
$PY -c 'import triton; print(\"triton\", triton.__version__)'; nproc; free -g | head -2; df -h /tmp | tail -1; \
ls -la .whl 2>/dev/null || echo 'no .whl carried (the install stage needs it; --amx does not)'"
  [install]="rm -rf $SITE && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
--target $SITE .whl/*.whl && $PY -c 'import transformers, qasr.engine.cuda.prepare; \
print(\"transformers\", transformers.__version__, \"from\", transformers.__file__)'"
  [tests]="$PY -m pytest -q -p no:cacheprovider -k cuda --durations=15 $TEST_SELECT"
  [bench]="$PY benchmarks/throughput.py --device cuda --out $OUT --cache /tmp/qasr-bench $BENCH_ARGS"
  # the native kernels are built here (QASR_NO_NATIVE=0), on 2 threads as on the project's machines
  [amx]="grep -o 'amx_bf16\\|amx_tile\\|avx512_bf16' /proc/cpuinfo | sort -u; grep -m1 'model name' /proc/cpuinfo; \
if grep -qw amx_bf16 /proc/cpuinfo; then export QASR_NO_NATIVE=0 OMP_NUM_THREADS=2; \
$PY -m pytest -q -p no:cacheprovider -rs tests/engine/cpu/test_amx_linear.py tests/engine/cpu/test_selftest.py && \
$PY scripts/amx_rates.py --threads 2 --out $OUT/amx_rates.json; \
else echo 'this host CPU has no amx_bf16: nothing to check'; fi"
)

if [ "$DRY" = 1 ]; then
  echo "gpu_check: ${#STAGES[@]} stages, at most $TOTAL_S s in all; OUT=$OUT; PYTHONPATH=$PYTHONPATH"
  for s in "${STAGES[@]}"; do
    echo "stage $s (budget ${BUDGET[$s]} s): ${COMMAND[$s]}"
  done
  exit 0
fi

mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
printf 'stage\trc\tseconds\tbudget_s\n' > "$OUT/stages.tsv"
START=$(date +%s)
echo "gpu_check: $(date -u +%FT%TZ), ${#STAGES[@]} stages, at most $TOTAL_S s" | tee -a "$LOG"

for s in "${STAGES[@]}"; do
  left=$(( TOTAL_S - ($(date +%s) - START) - 5 ))
  budget=${BUDGET[$s]}
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt 5 ]; then
    printf '%s\tskipped\t0\t%s\n' "$s" "$budget" >> "$OUT/stages.tsv"
    echo "=== stage $s: skipped, no time left" | tee -a "$LOG"
    continue
  fi
  echo "=== stage $s (budget $budget s)" | tee -a "$LOG"
  t0=$(date +%s)
  if [ "$s" = env ]; then
    timeout -k 5 "$budget" bash -c "${COMMAND[$s]}" 2>&1 | tee -a "$LOG" "$OUT/env.txt"
  else
    timeout -k 10 "$budget" bash -c "${COMMAND[$s]}" 2>&1 | tee -a "$LOG"
  fi
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\t%s\n' "$s" "$rc" "$secs" "$budget" >> "$OUT/stages.tsv"
  note=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note=" (time budget spent)"; fi
  echo "=== stage $s: exit $rc after $secs s$note" | tee -a "$LOG"
done

echo | tee -a "$LOG"
awk -F'\t' '{ printf "%-8s %-8s %-8s %s\n", $1, $2, $3, $4 }' "$OUT/stages.tsv" | tee -a "$LOG"
echo "gpu_check: $(( $(date +%s) - START )) s in all; files in $OUT" | tee -a "$LOG"
# the run fails when any stage failed or was skipped
awk -F'\t' 'NR > 1 && $2 != "0" { bad = 1 } END { exit bad }' "$OUT/stages.tsv"
