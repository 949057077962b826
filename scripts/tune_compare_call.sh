#!/usr/bin/env bash
# One device call: tune into the store of $TUNE_OUT (default experiments/runs/budget, which the
# issue-16 budget run started; carry it to resume), then compare the trainer's step on that store
# against the torch variants.
# Usage: TUNE_ARGS="--hidden 128" COMPARE_ARGS="--protocol default --hidden 128 --steps 500 --variants ..." \
#        bash scripts/tune_compare_call.sh TUNE_SECONDS [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
store=${TUNE_OUT:-experiments/runs/budget}
t0=$SECONDS
# shellcheck disable=SC2086 # the arguments are word lists on purpose
timeout -s KILL "${1:-250}" python3 -m autotune.search --workload mnist-mlp --out "$store" --workers 10 \
    $TUNE_ARGS > "$OUT/tune.log" 2>&1
echo "tune rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
tar czf "$OUT/budget_state.tgz" "$store"
t0=$SECONDS
# shellcheck disable=SC2086
timeout -s KILL $((${2:-570} - SECONDS)) python3 -m experiments.compare $COMPARE_ARGS \
    --tuned-configs "$store/sm_90/best.json" > "$OUT/compare.log" 2>&1
echo "compare rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
cp experiments/results/trainer_h200_fp32.csv experiments/results/compare_h200_fp16.csv "$OUT/" 2>/dev/null
