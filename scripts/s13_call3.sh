#!/usr/bin/env bash
# Session 13's third device call (issues 14 and 12), on the code of the second (LAB_COMMIT, the
# staged epilogue), with that call's compare rows carried in experiments/results:
#   maxauto  torch-compile-max-graph in the seed protocol at H = 8192, in the same run as the
#            second call's twins (issue 14's last figure);
#   tune     the CUDA twin's fp16 big-output products (matmul and linear_sgd at the seed
#            protocol's tn shapes of H = 8192 and 4096) re-tuned on the staged epilogue, from the
#            store results/trainer_shapes_s12_sm_90;
#   seed     the seed step at H = 8192 on the re-tuned store, same run again;
#   bench    the trainer's GEMMs and 4096^3 against cuBLAS on the re-tuned store, with the time left.
# Usage: LAB_COMMIT=<code commit> bash scripts/s13_call3.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-560}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=experiments/runs/s13
mkdir -p "$store/sm_90"
cp experiments/results/trainer_shapes_s12_sm_90/best.json "$store/sm_90/best.json"
step maxauto 280 python3 -m experiments.compare --protocol seed --hidden 8192 --max-autotune-hidden 8192 \
    --variants torch-compile-max-graph --tuned-configs experiments/results/seed128_s11_sm_90/best.json
step tune 140 python3 -m autotune.search --backends cuda --dtypes fp16 --ops matmul,linear_sgd --trials 50 --workers 10 \
    --shapes 8192x8192x32:tn,784x8192x32:tn,8192x10x32:tn,4096x4096x32:tn,784x4096x32:tn,4096x10x32:tn --out "$store"
step seed 40 python3 -m experiments.compare --protocol seed --hidden 8192 --max-autotune-hidden= \
    --variants cuda-tuned --tuned-configs "$store/sm_90/best.json"
step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer,gemm --tuned-configs "$store/sm_90/best.json"
cp experiments/results/compare_h200_fp16.csv experiments/results/trainer_gemms_h200.csv* experiments/results/loss_curves/*fp16_seed* \
    "$store/sm_90/best.json" "$store/sm_90/trials.csv" "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
