#!/usr/bin/env bash
# Device call 3 of the fused step (issue 14): tune the fused ops on the default protocol's shapes
# (H = 128, 1024; both twins), then the default protocol at H = 128, 1024, 4096 against the torch
# variants on the new store, then a first look at the seed protocol (fp16, H = 128, 500 steps).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$SECONDS
timeout 250 python3 -m autotune.search --workload mnist-mlp --ops linear_cross_entropy,linear_sgd \
    --hidden 128,1024 --dtypes fp32 --backends cuda,triton --trials 20 --workers 10 > "$OUT/tune.log" 2>&1
echo "tune rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
cp experiments/sm_90/best.json experiments/sm_90/trials.csv "$OUT/"
t0=$SECONDS
timeout $((450 - SECONDS)) python3 -m experiments.compare --protocol default --hidden 128,1024,4096 \
    --variants torch-graph,torch-compile-graph,cuda-tuned,cuda-tuned-unfused,triton-tuned,triton-tuned-unfused \
    > "$OUT/compare.log" 2>&1
echo "compare rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
timeout $((565 - SECONDS)) python3 -m experiments.compare --protocol seed --dtype fp16 --hidden 128 --steps 500 \
    --variants torch-graph,torch-compile-graph,cuda-default,triton-default > "$OUT/compare_seed.log" 2>&1
echo "compare_seed rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
cp experiments/results/trainer_*_fp32.csv experiments/results/compare_*_fp16.csv "$OUT/" 2>/dev/null
tar czf "$OUT/runs.tgz" experiments/runs experiments/results/loss_curves 2>/dev/null
