#!/usr/bin/env bash
# Session 18's fourth device call (issue 12): A's gathered rows (the first layer's products, as the
# tuner times them and the trainer runs them) read through TcTile::Async, a pointer per chunk
# looked up once, in the whole-step loop's turns; before, load_async looked every row up again at
# every k step, and the tuner picked the first layer's configs on those times.
#   tests     the gathered-rows GPU tests (along M and K, with split-K, the new whole-step one) and
#             the trainer's low-precision runs on the CUDA twin, in 8 shards; the rest runs only if
#             none failed;
#   tune16c   the CUDA twin's fp16 subset re-tuned at the default budget from call 3's store;
#   bench, bench2   the trainer's GEMMs and 4096^3 against cuBLAS on the re-tuned store, every case
#             twice, two runs.
# Usage: LAB_COMMIT=<code commit> bash scripts/s18_call4.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-540}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=experiments/runs/s18d
mkdir -p "$store/sm_90"
cp experiments/results/trainer_shapes_s18_sm_90/best.json "$store/sm_90/best.json"
step tests 150 python3 -m tests.shards --shards 8 --limit 140 --log-dir "$logs/shards" -- -q -m gpu \
    tests/test_fused.py tests/test_cuda_host_side.py tests/test_trainer_gpu.py \
    -k "a_rows or whole_k_steps or (low_precision and cuda)"
if tests_clean; then
    step tune16c 110 python3 -m autotune.search --ops matmul --trials 50 --workers 10 --out "$store" \
        --backends cuda --dtypes fp16 --shapes "$FP16_SUBSET"
    step bench 120 python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$store/sm_90/best.json"
    cp experiments/results/trainer_gemms_h200.csv "$logs/" 2>/dev/null
    step bench2 $((limit - SECONDS - 5)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$store/sm_90/best.json"
    cp experiments/results/trainer_gemms_h200.csv "$logs/trainer_gemms_h200_run2.csv" 2>/dev/null
fi
cp "$store/sm_90/best.json" "$store/sm_90/trials.csv" "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
