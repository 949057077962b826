#!/usr/bin/env bash
# Issues 12 and 14 on the H200, after scripts/shapes_call.sh: finish its tuning (carry
# experiments/runs/s8; it resumes), then on that store the seed protocol's step at H = 128
# (500 steps), the default protocol's 10 epochs at H = 1024, 128 and 4096 (accuracy, and the
# step against torch-graph and torch-compile-graph), and with the time left the trainer's GEMMs
# against cuBLAS (experiments.bench_kernels, whose rows survive a stop at the limit).
# Usage: bash scripts/compare_bench_call.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-540}
store=experiments/runs/s8
tune=(python3 -m autotune.search --workload mnist-mlp --out "$store" --workers 10)
seed=(--dtypes fp16 --layers 3 --batch-size 32)
logs=$(mktemp -d)  # packed with the CSVs at the end: a call brings back at most 8 files
export STEP_LOGS=$logs
step tune4096 45 "${tune[@]}" --dtypes fp32 --hidden 4096 --ops matmul,linear_cross_entropy,linear_sgd
step tune_fp16 75 "${tune[@]}" "${seed[@]}" --hidden 4096,1024 --ops matmul
tar czf "$OUT/s8_state.tgz" "$store"
best=$store/sm_90/best.json
step seed128 70 python3 -m experiments.compare --protocol seed --dtype fp16 --hidden 128 --steps 500 \
    --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$best"
step default 300 python3 -m experiments.compare --protocol default --hidden 1024,128,4096 \
    --variants torch-graph,torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$best"
step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer --tuned-configs "$best"
cp experiments/results/compare_h200_fp16.csv experiments/results/trainer_h200_fp32.csv \
    experiments/results/trainer_gemms_h200.csv* "$logs/"
tar czf "$OUT/results.tgz" -C "$logs" .
