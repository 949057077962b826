#!/usr/bin/env bash
# Session 15's third device call. The old tree for code_ab is carried in .ab/ (git archive of
# c278b32, the commit before this session's change, without the MNIST files).
#   code_ab the default protocol's calls at H = 4096 and 128 on store trainer_shapes_s15_sm_90, the
#           CUDA twin's code before (c278b32) and after the split-K change: call 2 timed the fp32
#           128x4096x784 product 40 µs on the config session 13 timed at 29.5, with a main loop
#           whose SASS is unchanged;
#   tune    the seed protocol's linear_sgd at H = 8192 re-tuned as the trainer runs it (momentum 0,
#           no buffers: NOTES section 24), both twins, into a copy of store trainer_shapes_s15_sm_90;
#   seed    the seed step at H = 8192 on that store, with torch-compile-graph in the same run.
# Usage: LAB_COMMIT=<code commit> bash scripts/s15_call3.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-400}
logs=$(mktemp -d)
export STEP_LOGS=$logs
tuned=experiments/results/trainer_shapes_s15_sm_90/best.json
store=experiments/runs/s15c3
mkdir -p "$store/sm_90"
cp "$tuned" "$store/sm_90/best.json"
step ab4096 90 python3 -m experiments.code_ab --old-tree .ab/c278b32 --protocol default --hidden 4096 \
    --tuned-configs "$tuned" --rounds 3
step ab128 60 python3 -m experiments.code_ab --old-tree .ab/c278b32 --protocol default --hidden 128 \
    --tuned-configs "$tuned" --rounds 3
step tune 110 python3 -m autotune.search --workload mnist-mlp --dtypes fp16 --layers 3 --batch-size 32 \
    --hidden 8192 --momentum 0 --ops linear_sgd --trials 50 --workers 10 --out "$store"
step seed $((limit - SECONDS)) python3 -m experiments.compare --protocol seed --hidden 8192 --max-autotune-hidden= \
    --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$store/sm_90/best.json"
cp experiments/results/compare_h200_fp16.csv experiments/results/code_ab_h200.csv experiments/results/loss_curves/*fp16_seed* \
    "$store/sm_90/best.json" "$store/sm_90/trials.csv" "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
