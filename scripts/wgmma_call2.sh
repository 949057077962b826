#!/usr/bin/env bash
# Device call 2 of the wgmma matmul (issue 15): the persistent kernel's GPU tests, the
# progression again (5 passes, L2 flushed) with more tiles, and the tuner's 4096^3 fp16 study.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$SECONDS
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_wgmma.py > "$OUT/tests_wgmma.log" 2>&1
echo "tests_wgmma rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
W='"WGMMA": 1, "BLOCK_K": 64, "SPLIT_K": 1'
timeout -s KILL 150 python3 -m experiments.bench_wgmma --runs 5 --out "$OUT/wgmma_h200.csv" --extra \
  "256x128={$W, \"BLOCK_M\": 256, \"BLOCK_N\": 128, \"num_warps\": 8, \"num_stages\": 4, \"GROUP_M\": 8};128x256 3-stage={$W, \"BLOCK_M\": 128, \"BLOCK_N\": 256, \"num_warps\": 8, \"num_stages\": 3, \"GROUP_M\": 8}" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
timeout -s KILL $((555 - SECONDS)) python3 -m autotune.search --backends cuda --ops matmul --dtypes fp16 \
  --shapes 4096x4096x4096 --trials 40 --workers 8 --out "$OUT/tune" > "$OUT/tune.log" 2>&1
echo "tune rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
