#!/usr/bin/env bash
# Device call 1 of the fused step (issue 14): its GPU tests, then the default protocol at
# H = 128 and 1024 against the torch variants, in one call. Logs and CSVs under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
t0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py > "$OUT/tests_fused.log" 2>&1
echo "tests_fused rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
timeout $((260 - SECONDS)) python3 -m pytest -q -p no:cacheprovider \
    tests/test_ops.py tests/test_trainer_gpu.py -k "linear_cross_entropy or linear_sgd or three_kernels or match_torch" \
    > "$OUT/tests_step.log" 2>&1
echo "tests_step rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
timeout $((570 - SECONDS)) python3 -m experiments.compare --protocol default --hidden 128,1024 \
    --variants torch-graph,torch-compile-graph,cuda-tuned,cuda-tuned-unfused,triton-tuned,triton-tuned-unfused \
    > "$OUT/compare.log" 2>&1
echo "compare rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
cp experiments/results/trainer_*_fp32.csv "$OUT/" 2>/dev/null
tar czf "$OUT/runs.tgz" experiments/runs experiments/results/loss_curves 2>/dev/null
