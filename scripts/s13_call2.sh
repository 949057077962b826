#!/usr/bin/env bash
# Session 13's second device call (issues 12 and 14), on the staged tensor-core epilogue
# (matmul_tc.cu: STAGED). The old tree for code_ab is carried in .ab/ (git archive of the commit
# before the change, without the MNIST files).
#   tests    the gpu-marked tests of the CUDA twin's GEMMs (test_ops, test_splitk, test_fused,
#            test_cuda_host_side; not triton, not the elementwise ops), in 12 shards; the rest of
#            the call runs only if none failed;
#   code_ab  the seed step's calls at H = 8192, old code against new, at store seed128_s11's configs;
#   seed     the seed protocol at H = 8192 (5000 steps), the twins against torch-compile-graph;
#   bench    the trainer's GEMMs against cuBLAS with the time left (rows survive a stop at the limit).
# Usage: LAB_COMMIT=<HEAD> bash scripts/s13_call2.sh OLD_COMMIT [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
old=$1 limit=${2:-550}
logs=$(mktemp -d)
export STEP_LOGS=$logs
step tests 150 python3 -m tests.shards --shards 12 --limit 140 --log-dir "$logs/shards" -- -q -m gpu \
    -k "not triton and not test_relu and not test_bias_add and not test_bias_grad and not test_softmax and not test_elementwise and not test_sgd_update" \
    tests/test_ops.py tests/test_splitk.py tests/test_fused.py tests/test_cuda_host_side.py
if tests_clean; then
    step code_ab 110 python3 -m experiments.code_ab --old-tree ".ab/$old" --protocol seed --hidden 8192 \
        --tuned-configs experiments/results/seed128_s11_sm_90/best.json --rounds 3
    step seed 120 python3 -m experiments.compare --protocol seed --hidden 8192 --max-autotune-hidden= \
        --variants torch-compile-graph,cuda-tuned,triton-tuned --tuned-configs experiments/results/seed128_s11_sm_90/best.json
    step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer \
        --tuned-configs experiments/results/trainer_shapes_s12_sm_90/best.json
fi
cp experiments/results/compare_h200_fp16.csv experiments/results/code_ab_h200.csv experiments/results/trainer_gemms_h200.csv* \
    experiments/results/loss_curves/*fp16_seed* "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
