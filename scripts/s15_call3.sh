#!/usr/bin/env bash
# Session 15's third device call: runs owed from earlier sessions (experiments/NOTES.md, "Next
# device session"), none of issue 12's bars:
#   tests   the two gpu-marked tests no call had finished (torch.compile with max-autotune trains
#           like eager, minutes of inductor autotuning each), side by side in 2 shards;
#   tune    the seed protocol's linear_sgd at H = 8192 re-tuned as the trainer runs it (momentum 0,
#           no buffers: section 24), both twins, into a copy of store trainer_shapes_s15_sm_90;
#   seed    the seed step at H = 8192 on that store, with torch-compile-graph in the same run.
# Usage: LAB_COMMIT=<code commit> bash scripts/s15_call3.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-540}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=experiments/runs/s15c3
mkdir -p "$store/sm_90"
cp experiments/results/trainer_shapes_s15_sm_90/best.json "$store/sm_90/best.json"
t=tests/test_trainer_gpu.py::test_torch_variants_train_like_eager
step tests 330 python3 -m tests.shards --shards 2 --limit 320 --log-dir "$logs/shards" -- -q \
    "$t[torch-compile-max-graph]" "$t[torch-max-autotune]"
step tune 110 python3 -m autotune.search --workload mnist-mlp --dtypes fp16 --layers 3 --batch-size 32 \
    --hidden 8192 --momentum 0 --ops linear_sgd --trials 50 --workers 10 --out "$store"
step seed $((limit - SECONDS)) python3 -m experiments.compare --protocol seed --hidden 8192 --max-autotune-hidden= \
    --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$store/sm_90/best.json"
cp experiments/results/compare_h200_fp16.csv experiments/results/loss_curves/*fp16_seed* \
    "$store/sm_90/best.json" "$store/sm_90/trials.csv" "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
