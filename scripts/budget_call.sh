#!/usr/bin/env bash
# Issue 16 on the H200: the default workload search (fp32, H = 1024, both twins, 50 configs per
# study, tpe-valid) against a long run of the same studies (150), experiments.search_budget.
# It resumes: carry experiments/runs/budget (unpacked from the last call's budget_state.tgz).
# Then, with the time left, the default protocol at H = 1024 on the long run's configs.
# Usage: bash scripts/budget_call.sh SECONDS   (the budget run's share of the call)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-500}
t0=$SECONDS
timeout -s KILL $((limit + 40)) python3 -m experiments.search_budget --out experiments/runs/budget \
    --seconds "$limit" -- --workers 10 > "$OUT/budget.log" 2>&1
rc=$?
echo "budget rc=$rc $((SECONDS - t0))s" >> "$OUT/summary.txt"
tar czf "$OUT/budget_state.tgz" experiments/runs/budget
cp experiments/results/search_budget_h200.csv "$OUT/" 2>/dev/null
if [ "$rc" = 0 ] && [ $((560 - SECONDS)) -gt 90 ]; then
    t0=$SECONDS
    timeout -s KILL $((560 - SECONDS)) python3 -m experiments.compare --protocol default --hidden 1024 --steps 500 \
        --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs experiments/runs/budget/sm_90/best.json \
        > "$OUT/compare.log" 2>&1
    echo "compare rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
    cp experiments/results/trainer_h200_fp32.csv "$OUT/" 2>/dev/null
fi
