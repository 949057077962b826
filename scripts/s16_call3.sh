#!/usr/bin/env bash
# Session 16's third device call (issue 12): where the CUDA twin's fp16 32 x N products still lose
# about 0.5-1 µs to Triton's after the leaner main loop (experiments/NOTES.md, section 26).
#   ksweep1024  both twins at three shared configs and cuBLAS, 32 x 1024 over K = 64 .. 2048, nn and
#               nt, 3 rounds in turn: each config's line fixed + steps * per_step, and each twin's
#               launch floor (relu of 1024 elements);
#   ksweep128   the same at 32 x 128 (nn): 8 to 16 blocks where 32 x 1024 has 64 to 128;
#   ncu         Nsight Compute on 32x1024x1024:nt and 32x1024x784:nn at store trainer_shapes_s16's
#               configs (both twins, cuBLAS): stall reasons per warp, cycles.
# Usage: LAB_COMMIT=<code commit> bash scripts/s16_call3.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-300}
logs=$(mktemp -d)
export STEP_LOGS=$logs
step ksweep1024 150 python3 -m experiments.ksweep --out "$logs/ksweep_1024.csv"
step ksweep128 80 python3 -m experiments.ksweep --mn 32x128 --layouts nn --ks 64,128,256,512,784,1024 \
    --out "$logs/ksweep_128.csv"
ncu_probe ncu $((limit - SECONDS)) --shapes 32x1024x1024:nt,32x1024x784:nn \
    --tuned-configs experiments/results/trainer_shapes_s16_sm_90/best.json
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
