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
step tests 210 python3 -m tests.shards --shards 14 --limit 200 --log-dir "$logs/shards" -- -q -m gpu \
    tests/test_ops.py tests/test_fused.py tests/test_splitk.py tests/test_cuda_host_side.py \
    -k "cuda and (matmul or splitk or linear or sampled or space or wide or small_work or a_rows or fused) and not bias_add"
if [ -f "$logs/shards/outcomes.csv" ] && ! grep -qE ",(failed|error)$" "$logs/shards/outcomes.csv"; then
    step tune16c 120 python3 -m autotune.search --ops matmul --trials 50 --workers 10 --out "$store" \
        --backends cuda --dtypes fp16 --shapes \
        32x1024x1024:nn,32x1024x1024:nt,32x1024x784:nn,32x10x1024:nn,32x10x4096:nn,32x10x8192:nn,32x128x784:nn,32x4096x4096:nn,32x4096x4096:nt,32x4096x784:nn
    step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$store/sm_90/best.json"
fi
cp "$store/sm_90/best.json" "$store/sm_90/trials.csv" experiments/results/trainer_gemms_h200.csv* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
