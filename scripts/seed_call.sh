#!/usr/bin/env bash
# Issue 14's seed-protocol bars on the H200, one device call: the GPU tests of the CUDA loss and
# SGD epilogues (common.cuh: xent_tile, sgd_bias), then tuning into experiments/runs/s8 (carry
# it: its best.json starts as the merged committed stores) the CUDA twin's fp16 fused ops at
# H = 128 again (their epilogues changed) and both twins' fused-step GEMMs at H = 8192, then
# the seed protocol's step at H = 128 and 8192 against torch-compile-graph.
# Usage: bash scripts/seed_call.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-560}
store=experiments/runs/s8
seed=(--workload mnist-mlp --dtypes fp16 --layers 3 --batch-size 32 --out "$store" --workers 10)
step tests 170 python3 -m pytest -q -m gpu -x tests/test_fused.py tests/test_cuda_host_side.py \
    -k "(linear_ce or linear_sgd or cross_entropy_epilogue or sgd_updates_bits) and not triton"
step tune128 60 python3 -m autotune.search "${seed[@]}" --hidden 128 --backends cuda --ops linear_cross_entropy,linear_sgd
step tune8192 170 python3 -m autotune.search "${seed[@]}" --hidden 8192 --ops matmul,linear_cross_entropy,linear_sgd
tar czf "$OUT/s8_state.tgz" "$store"
step compare $((limit - SECONDS)) python3 -m experiments.compare --protocol seed --dtype fp16 --hidden 128,8192 \
    --steps 500 --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$store/sm_90/best.json"
cp experiments/results/compare_h200_fp16.csv "$OUT/" 2>/dev/null
