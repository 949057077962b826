#!/usr/bin/env bash
# Session 19's first device call (issue 12): the SIMT kernel's cp.async ring (num_stages 3 and 4).
#   tests     the CUDA twin's fp32 GEMM GPU tests (every sampled config, split-K, fused paths) and
#             the ring's bits against the two-buffer loop, in 12 shards; the rest runs only if none
#             failed;
#   ksweep    one tile at num_stages 2, 3 and 4 over K at 128 x 1024 (nn and nt), cuBLAS alongside:
#             a k step's cost with one tile in flight against two and three;
#   tune32c   the CUDA twin's fp32 subset re-tuned at the default budget from session 18's store
#             (its winners are the incumbents a new config must beat in this run);
#   bench, bench2   the trainer's GEMMs and 4096^3 against cuBLAS on the re-tuned store, twice.
# Usage: LAB_COMMIT=<code commit> [STORE=experiments/runs/s19a] bash scripts/s19_call1.sh [CALL_SECONDS]
# (session 19 ran it twice: call 1 on 9816ba9's ring, call 2 with STORE=experiments/runs/s19b on the ring
# that keeps k-contiguous tiles as stored).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-540}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=${STORE:-experiments/runs/s19a}
mkdir -p "$store/sm_90"
cp experiments/results/trainer_shapes_s18_sm_90/best.json "$store/sm_90/best.json"
step tests 200 python3 -m tests.shards --shards 12 --limit 190 --log-dir "$logs/shards" -- -q -m gpu \
    tests/test_ops.py tests/test_fused.py tests/test_splitk.py tests/test_cuda_host_side.py \
    -k "simt_ring or (cuda and fp32 and (matmul or splitk or linear or sampled or space or wide or small_work or a_rows or fused) and not bias_add)"
if tests_clean; then
    cfgs='[{"BLOCK_M":64,"BLOCK_N":64,"BLOCK_K":16,"THREAD_M":8,"THREAD_N":2,"num_stages":2},
           {"BLOCK_M":64,"BLOCK_N":64,"BLOCK_K":16,"THREAD_M":8,"THREAD_N":2,"num_stages":3},
           {"BLOCK_M":64,"BLOCK_N":64,"BLOCK_K":16,"THREAD_M":8,"THREAD_N":2,"num_stages":4},
           {"BLOCK_M":16,"BLOCK_N":64,"BLOCK_K":32,"THREAD_M":4,"THREAD_N":4,"num_stages":2},
           {"BLOCK_M":16,"BLOCK_N":64,"BLOCK_K":32,"THREAD_M":4,"THREAD_N":4,"num_stages":4}]'
    step ksweep 60 python3 -m experiments.ksweep --dtype fp32 --twins cuda --mn 128x1024 --layouts nn,nt \
        --ks 128,256,512,784,1024 --configs "$cfgs" --rounds 3 --out "$logs/ksweep_fp32_h200.csv"
    step tune32c 130 python3 -m autotune.search --ops matmul --trials 50 --workers 10 --out "$store" \
        --backends cuda --dtypes fp32 --shapes "$FP32_SUBSET"
    step bench 120 python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$store/sm_90/best.json"
    cp experiments/results/trainer_gemms_h200.csv "$logs/" 2>/dev/null
    if [ $((limit - SECONDS)) -gt 70 ]; then  # timeout 0 would be no limit at all
        step bench2 $((limit - SECONDS - 5)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
            --tuned-configs "$store/sm_90/best.json"
        cp experiments/results/trainer_gemms_h200.csv "$logs/trainer_gemms_h200_run2.csv" 2>/dev/null
    fi
fi
cp "$store/sm_90/best.json" "$store/sm_90/trials.csv" "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
