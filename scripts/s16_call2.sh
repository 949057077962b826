#!/usr/bin/env bash
# Session 16's second device call (issue 12, the CUDA twin's fp16 subset): the tensor-core kernel's
# ldmatrix addresses worked out once per lane in the shared space, its ring's stages counted, and each
# operand's copies advancing a running source pointer (experiments/NOTES.md, section 26).
#   tests    the CUDA twin's matmul, split-K and fused-path GPU tests (every layout, odd n-tiles, the
#            space's samples), in 14 shards; the rest runs only if none failed;
#   tune16c  the CUDA twin's fp16 subset (K >= 784, M * N <= 131072: 10 products) re-tuned at the
#            default budget (50 trials a study) into a copy of that store;
#   bench    the trainer's GEMMs and 4096^3 against cuBLAS on the re-tuned store, every case twice.
# Usage: LAB_COMMIT=<code commit> bash scripts/s16_call2.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-550}
logs=$(mktemp -d)
export STEP_LOGS=$logs
old=experiments/results/trainer_shapes_s15_sm_90/best.json
store=experiments/runs/s16b
mkdir -p "$store/sm_90"
cp "$old" "$store/sm_90/best.json"
gemm_gpu_tests 210 14
if tests_clean; then
    step tune16c 120 python3 -m autotune.search --ops matmul --trials 50 --workers 10 --out "$store" \
        --backends cuda --dtypes fp16 --shapes "$FP16_SUBSET"
    step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$store/sm_90/best.json"
fi
cp "$store/sm_90/best.json" "$store/sm_90/trials.csv" experiments/results/trainer_gemms_h200.csv* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
