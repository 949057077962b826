#!/usr/bin/env bash
# Issue 12 on the H200, first of two calls: the GPU test of the CUDA loss epilogue across its
# space (common.cuh: xent_tile), then tuning into experiments/runs/s8 (carry it; it resumes) the
# trainer's GEMMs still untuned at the default budget: the seed protocol's H = 8192 studies a
# call before left, the default protocol's at H = 4096 (fp32) and the seed protocol's at
# H = 4096 and 1024 (fp16), each stage under its own limit. scripts/bench_call.sh follows.
# Usage: bash scripts/shapes_call.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-560}
store=experiments/runs/s8
tune=(python3 -m autotune.search --workload mnist-mlp --out "$store" --workers 10)
seed=(--dtypes fp16 --layers 3 --batch-size 32)
step tests 120 python3 -m pytest -q -m gpu -x tests/test_cuda_host_side.py -k cross_entropy_epilogue
step tune8192 60 "${tune[@]}" "${seed[@]}" --hidden 8192 --ops matmul,linear_cross_entropy,linear_sgd
step tune4096 190 "${tune[@]}" --dtypes fp32 --hidden 4096 --ops matmul,linear_cross_entropy,linear_sgd
step tune_fp16 $((limit - SECONDS - 15)) "${tune[@]}" "${seed[@]}" --hidden 4096,1024 --ops matmul
tar czf "$OUT/s8_state.tgz" "$store"
