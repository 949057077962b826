#!/usr/bin/env bash
# Session 19's third device call (issue 12): two more benchmark runs of the trainer's GEMMs and
# 4096^3 against cuBLAS on call 2's store (experiments/results/trainer_shapes_s19_sm_90), whose
# first run there was cut by its stage limit on a cold machine.
# Usage: LAB_COMMIT=<code commit> bash scripts/s19_call3.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-330}
logs=$(mktemp -d)
export STEP_LOGS=$logs
best=experiments/results/trainer_shapes_s19_sm_90/best.json
step bench 200 python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 --tuned-configs "$best"
cp experiments/results/trainer_gemms_h200.csv "$logs/trainer_gemms_h200_run1.csv" 2>/dev/null
if [ $((limit - SECONDS)) -gt 50 ]; then  # timeout 0 would be no limit at all
    step bench2 $((limit - SECONDS - 5)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$best"
    cp experiments/results/trainer_gemms_h200.csv "$logs/trainer_gemms_h200_run2.csv" 2>/dev/null
fi
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
