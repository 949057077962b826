#!/usr/bin/env bash
# Issue 14's CUDA seed step on the H200, the second device call of session 9: after 7423c6a's lean
# tensor-core loads (matmul_tc.cu: TcTile::Async) and the epilogue reads queued behind the first
# k steps' copies, one call:
#   tests    the GPU tests of the CUDA GEMM paths the change touches (every mma.sync load: layouts,
#            ragged edges, split-K, the fused ops);
#   ab_*     experiments.code_ab against the tree before this session's kernel changes (carry
#            .ab/4675c05), the committed store's configs: seed and default protocols at H = 128;
#   tune     the CUDA twin's fp16 step GEMMs and fused ops at H = 128 again, into experiments/runs/s9
#            (carry it to resume a cut run; its best.json starts as the committed store);
#   compare  the seed step at H = 128 on that store against torch-compile-graph.
# Usage: bash scripts/loads_call.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-560}
store=experiments/runs/s9
committed=experiments/results/trainer_shapes_sm_90/best.json
[ -f "$store/sm_90/best.json" ] || { mkdir -p "$store/sm_90" && cp "$committed" "$store/sm_90/"; }
logs=$(mktemp -d)  # packed with the CSVs at the end: a call brings back at most 8 files
export STEP_LOGS=$logs
step tests 190 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_ops.py::test_matmul \
    tests/test_ops.py::test_matmul_wide_ragged tests/test_ops.py::test_matmul_views tests/test_splitk.py::test_splitk_layouts \
    tests/test_splitk.py::test_splitk_odd_k tests/test_fused.py -k "not triton"
step ab_seed 50 python3 -m experiments.code_ab --old-tree .ab/4675c05 --tuned-configs "$committed" \
    --protocol seed --hidden 128
step ab_default 45 python3 -m experiments.code_ab --old-tree .ab/4675c05 --tuned-configs "$committed" \
    --protocol default --hidden 128
step tune 130 python3 -m autotune.search --workload mnist-mlp --dtypes fp16 --layers 3 --batch-size 32 --hidden 128 \
    --backends cuda --ops matmul,linear_cross_entropy,linear_sgd --out "$store" --workers 10
tar czf "$OUT/s9_state.tgz" "$store"
step compare $((limit - SECONDS)) python3 -m experiments.compare --protocol seed --dtype fp16 --hidden 128 \
    --steps 500 --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs "$store/sm_90/best.json"
cp experiments/results/compare_h200_fp16.csv experiments/results/code_ab_h200.csv "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
