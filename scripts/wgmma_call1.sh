#!/usr/bin/env bash
# Device call 1 of the wgmma matmul (issue 15): a smoke launch, its GPU tests, the progression at
# 4096^3 and 8192^3 against cuBLAS, and the CUDA-only fused GPU tests owed since session 5.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
t0=$SECONDS
timeout -s KILL 90 python3 - > "$OUT/smoke.log" 2>&1 <<'PY'
import torch, kernels_cuda as kc
for cfg in ({"WGMMA": 1, "BLOCK_K": 64, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
            {"WGMMA": 1, "BLOCK_K": 64, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4}):
    for ta, tb in ((0, 0), (0, 1), (1, 0), (1, 1)):
        a = torch.randn(256, 200, device="cuda").half(); b = torch.randn(200, 264, device="cuda").half()
        a = a.t().contiguous().t() if ta else a
        b = b.t().contiguous().t() if tb else b
        out = kc.matmul(a, b, config=cfg); ref = a.float() @ b.float()
        torch.cuda.synchronize()
        print(cfg["BLOCK_N"], ta, tb, ((out.float() - ref).norm() / ref.norm()).item(), flush=True)
PY
echo "smoke rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
timeout -s KILL 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_wgmma.py > "$OUT/tests_wgmma.log" 2>&1
echo "tests_wgmma rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
timeout -s KILL 130 python3 -m experiments.bench_wgmma --runs 5 --out "$OUT/wgmma_h200.csv" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
timeout -s KILL $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_host_side.py \
    > "$OUT/tests_host_side.log" 2>&1
echo "tests_host_side rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
