#!/usr/bin/env bash
# Session 17's second device call (issue 12): the CUDA twin's main loop split in two, the k steps of
# an inner tile whose refills lie wholly inside K first, with copies free of edge tests (call 1: a
# k step of 16 x 16 on 2 warps cost 0.2 µs at BLOCK_K = 64, Triton's 0.12; experiments/NOTES.md,
# section 27).
#   tests     the CUDA twin's matmul, split-K and fused-path GPU tests, in 14 shards; the rest runs
#             only if none failed;
#   ks_v0, ks_new, ks128_v0, ks128_new   ksweep, both twins, 16x16x64 and 16x16x128 on 2 warps with 4
#             stages, 32 x 1024 (nn, nt) and 32 x 128 (nn), K = 256 .. 2048; v0 is session 16's code
#             (.ab/v0, f46617a), new this commit's;
#   tune16c   the CUDA twin's fp16 subset (10 products) re-tuned at the default budget from store
#             trainer_shapes_s16_sm_90;
#   bench     the trainer's GEMMs and 4096^3 against cuBLAS on the re-tuned store, every case twice.
# Usage: LAB_COMMIT=<code commit> bash scripts/s17_call2.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-540}
logs=$(mktemp -d)
export STEP_LOGS=$logs
root=$PWD
store=experiments/runs/s17b
mkdir -p "$store/sm_90"
cp experiments/results/trainer_shapes_s16_sm_90/best.json "$store/sm_90/best.json"
gemm_gpu_tests 190 14
if tests_clean 'failed|error|unfinished'; then
    c64='{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2'
    c128='{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2'
    two="[$c64, \"num_stages\": 4}, $c128, \"num_stages\": 4}]"
    for v in v0 new; do
        tree=$root; [ $v = new ] || tree=$root/.ab/$v
        step "ks_$v" 40 env -C "$tree" PYTHONPATH="$tree:/tmp/site" python3 -m experiments.ksweep --configs "$two" \
            --ks 256,512,1024,2048 --out "$logs/ks1024_$v.csv"
        step "ks128_$v" 30 env -C "$tree" PYTHONPATH="$tree:/tmp/site" python3 -m experiments.ksweep --mn 32x128 \
            --layouts nn --configs "$two" --ks 256,512,1024,2048 --out "$logs/ks128_$v.csv"
    done
    step tune16c 110 python3 -m autotune.search --ops matmul --trials 50 --workers 10 --out "$store" \
        --backends cuda --dtypes fp16 --shapes "$FP16_SUBSET"
    step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$store/sm_90/best.json"
fi
cp "$store/sm_90/best.json" "$store/sm_90/trials.csv" experiments/results/trainer_gemms_h200.csv* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
