#!/usr/bin/env bash
# Session 9's last device call (issues 14 and 12), on the store results/seed128_s9_sm_90 (the
# committed store, with the fused-step entries of the seed protocol at H = 128 that this session's
# re-tuning timed faster than the committed config under the same code; NOTES section 19):
#   tests    the CUDA GPU tests the second call's limit cut (fused ops, host side, split-K odd K);
#   compare  the seed step at H = 128 against torch-compile-graph;
#   bench    the trainer's GEMMs against cuBLAS, the CUDA twin only (its loads changed), with the
#            time left (rows survive a stop at the limit).
# Usage: bash scripts/s9_final_call.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-500}
store=experiments/results/seed128_s9_sm_90/best.json
logs=$(mktemp -d)
export STEP_LOGS=$logs
step tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused.py tests/test_cuda_host_side.py \
    tests/test_splitk.py::test_splitk_odd_k -k "not triton"
step compare 50 python3 -m experiments.compare --protocol seed --dtype fp16 --hidden 128 \
    --steps 500 --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$store"
cp experiments/results/compare_h200_fp16.csv "$logs/"
step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer --backends cuda \
    --tuned-configs "$store" --out "$logs/trainer_gemms_cuda_s9_h200.csv"
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
