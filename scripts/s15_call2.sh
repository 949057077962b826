#!/usr/bin/env bash
# Session 15's second device call (issue 12), on the store the first call re-tuned (carried in
# experiments/runs/s15, copied to results/trainer_shapes_s15_sm_90 after that call):
#   clocks  nvidia-smi's clocks before and after (the first call's cuBLAS baselines came out up to
#           2x faster than session 13's on the same shapes and versions);
#   ncu     Nsight Compute on 32x1024x1024 (nn, nt): both twins at the store's configs and cuBLAS
#           (the CUDA twin's small-output products stay ~1 µs behind Triton's whatever the config);
#   bench   the trainer's GEMMs and 4096^3 against cuBLAS, every case twice in turn (medians).
# Usage: LAB_COMMIT=<code commit> bash scripts/s15_call2.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-400}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=experiments/results/trainer_shapes_s15_sm_90/best.json
clocks="nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv"
step clocks_before 20 $clocks
ncu_probe ncu 90 --shapes 32x1024x1024:nn,32x1024x1024:nt --tuned-configs "$store"
step bench $((limit - SECONDS - 20)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 --tuned-configs "$store"
step clocks_after 20 $clocks
cp experiments/results/trainer_gemms_h200.csv* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
