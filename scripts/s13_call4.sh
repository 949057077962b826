#!/usr/bin/env bash
# Session 13's last device call: the gpu-marked tests of the staged epilogue's code that the second
# call's limit cut (10 of test_cuda_host_side's sweeps), and the trainer's GPU tests of the CUDA
# backend (the fused step in fp32, fp16 and bf16, graph replay against eager launches, 98%), in 12 shards.
# Usage: LAB_COMMIT=<HEAD> bash scripts/s13_call4.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
logs=$(mktemp -d)
export STEP_LOGS=$logs
h=tests/test_cuda_host_side.py
step tests 250 python3 -m tests.shards --shards 12 --limit 240 --log-dir "$logs/shards" -- -q -m gpu \
    "$h::test_a_rows_with_splitk" "$h::test_linear_cross_entropy_epilogue_across_the_space" \
    "$h::test_linear_sgd_weights_are_sgd_updates_bits" "$h::test_splitk_configs_across_the_space" \
    "$h::test_staged_epilogue_keeps_the_bits" "$h::test_wide_k_steps_across_the_layouts" \
    tests/test_trainer_gpu.py -k "cuda"
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
