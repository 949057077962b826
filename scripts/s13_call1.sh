#!/usr/bin/env bash
# Session 13's first device call (issues 14 and 12):
#   ncu      the seed protocol's 8192 x 8192 x 32 weight-gradient products of both twins under
#            Nsight Compute (experiments/ncu_probe.py): what holds the CUDA twin's at 1.7-3.6x
#            their memory floor;
#   compare  the default protocol at H = 128 with the twins and torch-compile-max-graph in one
#            run (NOTES, next-session item 1: issue 14's last figure of that protocol).
# Usage: LAB_COMMIT=<HEAD> bash scripts/s13_call1.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
logs=$(mktemp -d)
export STEP_LOGS=$logs
ncu_probe ncu 120
step compare 420 python3 -m experiments.compare --protocol default --hidden 128 \
    --variants torch-compile-graph,cuda-tuned,triton-tuned,torch-compile-max-graph --max-autotune-hidden 128 \
    --tuned-configs experiments/results/default1024_s12_sm_90/best.json
cp experiments/results/trainer_h200_fp32.csv "$logs/"
cp experiments/results/loss_curves/*fp32_default* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
