#!/usr/bin/env bash
# Issue 17 on nvidia-h200-x2: experiments.gpus on the default workload (fp32, H = 1024, both twins)
# at 20 configs per study (one worker per GPU, as the issue asks: one GPU alone, then two, then a
# pair of searches sharing a storage), then every winner timed on both GPUs.
# It resumes: carry experiments/runs/gpus (unpacked from the last call's gpus_state.tgz).
# Usage: bash scripts/gpus_call.sh SECONDS   (the searches' share of the call)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-480}
t0=$SECONDS
timeout -s KILL $((limit + 60)) python3 -m experiments.gpus --out experiments/runs/gpus --seconds "$limit" \
    -- --trials 20 > "$OUT/gpus.log" 2>&1
echo "gpus rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
tar czf "$OUT/gpus_state.tgz" experiments/runs/gpus
cp experiments/results/gpus_h200.csv experiments/results/gpus_spread_h200.csv "$OUT/" 2>/dev/null
