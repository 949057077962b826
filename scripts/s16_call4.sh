#!/usr/bin/env bash
# Session 16's fourth device call (issue 12, the CUDA twin's fp16 subset): two sets of accumulators
# for warp tiles of one or two mma tiles, which halves each k step's chain of dependent mmas
# (experiments/NOTES.md, section 26).
#   tests     the CUDA twin's matmul, split-K and fused-path GPU tests, in 14 shards; the rest runs
#             only if none failed;
#   ksweep    both twins at three shared configs and cuBLAS, 32 x 1024 over K = 64 .. 2048 (as call 3);
#   ksweep128 the same at 32 x 128, nn;
#   tune16c   the CUDA twin's fp16 subset (10 products) re-tuned at the default budget from store
#             trainer_shapes_s15_sm_90 (as call 2);
#   bench     the trainer's GEMMs and 4096^3 against cuBLAS on the re-tuned store, every case twice.
# Usage: LAB_COMMIT=<code commit> bash scripts/s16_call4.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-500}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=experiments/runs/s16c
mkdir -p "$store/sm_90"
cp experiments/results/trainer_shapes_s15_sm_90/best.json "$store/sm_90/best.json"
gemm_gpu_tests 190 14
if tests_clean 'failed|error|unfinished'; then
    step ksweep 40 python3 -m experiments.ksweep --out "$logs/ksweep_1024.csv"
    step ksweep128 25 python3 -m experiments.ksweep --mn 32x128 --layouts nn --ks 64,128,256,512,784,1024 \
        --out "$logs/ksweep_128.csv"
    step tune16c 110 python3 -m autotune.search --ops matmul --trials 50 --workers 10 --out "$store" \
        --backends cuda --dtypes fp16 --shapes "$FP16_SUBSET"
    step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$store/sm_90/best.json"
fi
cp "$store/sm_90/best.json" "$store/sm_90/trials.csv" experiments/results/trainer_gemms_h200.csv* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
