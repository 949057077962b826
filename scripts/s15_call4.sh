#!/usr/bin/env bash
# Session 15's fourth device call, on the split-K reduction as it was up to 17 slices (the third
# call's code_ab measured the fp32 split-K products at K = 784 18-42% slower on f02d5ae's single
# loop over batches; the SASS of those kernels is now c278b32's, instruction for instruction).
#   tests   the CUDA twin's split-K tests on the GPU (test_splitk, linear_cross_entropy's split-K,
#           the sample across the space), in 12 shards; the rest runs only if none failed;
#   ab4096, ab128  code_ab again, c278b32 against this code, default protocol at H = 4096 and 128;
#   bench   the trainer's GEMMs and 4096^3 against cuBLAS on store trainer_shapes_s15_sm_90,
#           every case twice in turn.
# Usage: LAB_COMMIT=<code commit> bash scripts/s15_call4.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-330}
logs=$(mktemp -d)
export STEP_LOGS=$logs
tuned=experiments/results/trainer_shapes_s15_sm_90/best.json
step tests 120 python3 -m tests.shards --shards 12 --limit 110 --log-dir "$logs/shards" -- -q -m gpu \
    tests/test_splitk.py "tests/test_fused.py::test_linear_ce_split_k" \
    "tests/test_cuda_host_side.py::test_splitk_configs_across_the_space"
if tests_clean; then
    for h in 4096 128; do
        step "ab$h" 50 python3 -m experiments.code_ab --old-tree .ab/c278b32 --protocol default --hidden "$h" \
            --tuned-configs "$tuned" --rounds 3
    done
    step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
        --tuned-configs "$tuned"
fi
cp experiments/results/code_ab_h200.csv experiments/results/trainer_gemms_h200.csv* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
