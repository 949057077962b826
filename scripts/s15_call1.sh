#!/usr/bin/env bash
# Session 15's first device call (issue 12): 32 and 64 split-K slices for tiles of at most 512
# outputs, in both twins, and the products of issue 12's subset (K >= 784, M * N <= 131072)
# re-tuned on the current spaces (the CUDA twin's were tuned before its small tiles on 2-4 warps).
#   tests   the split-K tests of both twins on the GPU (test_splitk, linear_cross_entropy's split-K,
#           the CUDA twin's sample across its space), in 12 shards; the rest runs only if none failed;
#   tune16  the CUDA twin's fp16 subset (10 products) and the Triton twin's N = 10 ones, from the
#           store results/trainer_shapes_s13_sm_90, at the default budget (50 trials per study);
#   tune32  the same for fp32 (the CUDA twin's 6 products, the Triton twin's N = 10 ones).
# Usage: LAB_COMMIT=<code commit> bash scripts/s15_call1.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-550}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=experiments/runs/s15
mkdir -p "$store/sm_90"
cp experiments/results/trainer_shapes_s13_sm_90/best.json "$store/sm_90/best.json"
step tests 170 python3 -m tests.shards --shards 12 --limit 160 --log-dir "$logs/shards" -- -q \
    tests/test_splitk.py "tests/test_fused.py::test_linear_ce_split_k" \
    "tests/test_cuda_host_side.py::test_splitk_configs_across_the_space"
if tests_clean; then
    tune="python3 -m autotune.search --ops matmul --trials 50 --workers 10 --out $store"
    step tune16c 200 $tune --backends cuda --dtypes fp16 --shapes \
        32x1024x1024:nn,32x1024x1024:nt,32x1024x784:nn,32x10x1024:nn,32x10x4096:nn,32x10x8192:nn,32x128x784:nn,32x4096x4096:nn,32x4096x4096:nt,32x4096x784:nn
    step tune32c 120 $tune --backends cuda --dtypes fp32 --shapes \
        128x1024x1024:nn,128x1024x1024:nt,128x1024x784:nn,128x10x1024:nn,128x10x4096:nn,128x128x784:nn
    step tune16t 90 $tune --backends triton --dtypes fp16 --shapes 32x10x1024:nn,32x10x4096:nn,32x10x8192:nn
    step tune32t $((limit - SECONDS)) $tune --backends triton --dtypes fp32 --shapes 128x10x1024:nn,128x10x4096:nn
fi
cp "$store/sm_90/best.json" "$store/sm_90/trials.csv" "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
