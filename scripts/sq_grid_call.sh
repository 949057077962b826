#!/usr/bin/env bash
# Issue 16's full grids on the H200, resumable across calls: every valid config of the Triton fp16
# matmul timed 3 times (experiments.search_quality --full-grid). Carry the runs file of earlier
# calls as experiments/runs/sq/ (it resumes from it); the CSVs come back under $OUT.
# Usage: bash scripts/sq_grid_call.sh SECONDS [more search_quality arguments: --shapes, --backend, --label ...]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
mkdir -p experiments/runs/sq
timeout -s KILL $(($1 + 60)) python3 -m experiments.search_quality --full-grid --repeats 3 --measure-only \
    --grid-seconds "$@" --workers 12 --out experiments/runs/sq > "$OUT/sq.log" 2>&1
echo "sq rc=$?" >> "$OUT/summary.txt"
cp experiments/runs/sq/search_quality_grid_*.csv "$OUT/"
