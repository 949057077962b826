#!/usr/bin/env bash
# Issue 14's CUDA seed step on the H200, one device call, after 6cf5c48 (the CUDA epilogues' operands
# on their way before the main loop; linear_sgd's bias summed from the staged dy tiles):
#   tests    the GPU tests of the CUDA paths the change touches (fused ops, bias, ReLU mask);
#   ab_*     experiments.code_ab: the fused step's calls at the committed store's configs, on this
#            checkout and on the tree before the change (carry .ab/4675c05: git archive 4675c05), in
#            turn: the seed protocol at H = 128 (fp16) and the default one at H = 128 (fp32);
#   tune     the CUDA twin's fp16 step GEMMs and fused ops at H = 128 again, into experiments/runs/s9,
#            whose best.json starts as the committed store (results/trainer_shapes_sm_90);
#   compare  the seed step at H = 128 on that store against torch-compile-graph.
# Usage: bash scripts/epilogue_call.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-560}
store=experiments/runs/s9
mkdir -p "$store/sm_90" && cp experiments/results/trainer_shapes_sm_90/best.json "$store/sm_90/"
committed=experiments/results/trainer_shapes_sm_90/best.json
logs=$(mktemp -d)  # packed with the CSVs at the end: a call brings back at most 8 files
export STEP_LOGS=$logs
step tests 170 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_fused.py tests/test_cuda_host_side.py \
    tests/test_splitk.py::test_splitk_bias_relu_once tests/test_ops.py::test_matmul_bias_activation -k "not triton"
step ab_seed 80 python3 -m experiments.code_ab --old-tree .ab/4675c05 --tuned-configs "$committed" \
    --protocol seed --hidden 128
step ab_default 70 python3 -m experiments.code_ab --old-tree .ab/4675c05 --tuned-configs "$committed" \
    --protocol default --hidden 128
step tune 110 python3 -m autotune.search --workload mnist-mlp --dtypes fp16 --layers 3 --batch-size 32 --hidden 128 \
    --backends cuda --ops matmul,linear_cross_entropy,linear_sgd --out "$store" --workers 10
tar czf "$OUT/s9_state.tgz" "$store"
step compare $((limit - SECONDS)) python3 -m experiments.compare --protocol seed --dtype fp16 --hidden 128 \
    --steps 500 --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$store/sm_90/best.json"
cp experiments/results/compare_h200_fp16.csv experiments/results/code_ab_h200.csv "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
