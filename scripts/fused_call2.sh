#!/usr/bin/env bash
# Device call 2 of the fused step (issue 14): a per-kernel profile of the fused and unfused steps
# of both twins at H = 128 and 1024, then the rest of the fused step's GPU tests.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$SECONDS
timeout 200 python3 -m experiments.profile_step --backends cuda,triton --hidden 128,1024 > "$OUT/profile.log" 2>&1
echo "profile rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
cp experiments/results/step_profile_*.csv "$OUT/" 2>/dev/null
t0=$SECONDS
timeout $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -x tests/test_fused.py \
    tests/test_ops.py tests/test_trainer_gpu.py -k "linear_cross_entropy or linear_sgd or three_kernels or match_torch or a_rows or relu_grad or fused or graph" \
    -rf > "$OUT/tests.log" 2>&1
echo "tests rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
