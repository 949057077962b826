#!/usr/bin/env bash
# Session 13's last device call (issue 12): Nsight Compute on the seed protocol's M = 32 products
# with long K at H = 8192 (32x8192x8192, nn and nt), both twins at store trainer_shapes_s13's
# configs and cuBLAS: what issue 12's remaining subset bar (CUDA fp16 0.71-0.84x) is made of.
# Usage: LAB_COMMIT=<HEAD> bash scripts/s13_call5.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
logs=$(mktemp -d)
export STEP_LOGS=$logs
ncu_probe ncu_m32 100 --shapes 32x8192x8192:nn,32x8192x8192:nt \
    --tuned-configs experiments/results/trainer_shapes_s13_sm_90/best.json
grep -v "^==PROF==" "$logs/ncu_m32.log" > "$OUT/ncu_seed8192_m32_h200.log"
cat "$OUT/summary.txt"
