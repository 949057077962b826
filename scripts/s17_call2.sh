#!/usr/bin/env bash
# Session 17's second device call (issue 12): is the CUDA twin's fixed cost per k step (about 0.16 µs
# at 16 x 16 on 2 warps, call 1) the branch between whole and zero-filling copies? Trees under .ab/:
#   v0  the code of session 16 (f46617a);
#   v5  an experiment, right only for inner tiles with K % BLOCK_K == 0 (every case below): the
#       copies are always whole, so ptxas predicates them and the loop has no branch.
# Stages:
#   ks_v0, ks_v5, ks128_v0, ks128_v5   ksweep, both twins, 16x16x64 and 16x16x128 on 2 warps with 4
#                    stages, 32 x 1024 (nn, nt) and 32 x 128 (nn), K = 256 .. 2048;
#   src_v0, src_v5   Nsight Compute, both twins at 16x16x64 w2 s4, 32x1024x1024:nn and 32x128x1024:nn:
#                    stall reasons (WarpStateStats) and per-instruction samples (SourceCounters, the
#                    source page as SASS).
# Usage: LAB_COMMIT=<code commit> bash scripts/s17_call2.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-300}
logs=$(mktemp -d)
export STEP_LOGS=$logs
root=$PWD
c64='{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2'
c128='{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2'
two="[$c64, \"num_stages\": 4}, $c128, \"num_stages\": 4}]"
in_tree() { echo env -C "$root/.ab/$1" PYTHONPATH="$root/.ab/$1:/tmp/site"; }  # a command prefix: run inside tree $1
for v in v0 v5; do
    step "ks_$v" 60 $(in_tree $v) python3 -m experiments.ksweep --configs "$two" --ks 256,512,1024,2048 \
        --out "$logs/ks1024_$v.csv"
    step "ks128_$v" 40 $(in_tree $v) python3 -m experiments.ksweep --mn 32x128 --layouts nn --configs "$two" \
        --ks 256,512,1024,2048 --out "$logs/ks128_$v.csv"
done
cat > "$logs/srcprobe.py" <<'PY'
import torch
from kernels_core import backends
gen = torch.Generator(device="cuda").manual_seed(0)
cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=4, GROUP_M=1, SPLIT_K=1)
calls = []
for m, n, k in ((32, 1024, 1024), (32, 128, 1024)):
    a = torch.randn(m, k, generator=gen, device="cuda").half()
    b = torch.randn(k, n, generator=gen, device="cuda").half()
    ref = a.double() @ b.double()
    for t in ("cuda", "triton"):
        run = {**cfg, "WGMMA": 0} if t == "cuda" else cfg
        f = lambda t=t, a=a, b=b, run=run: backends.load(t).matmul(a, b, config=run)
        err = ((f().double() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, (t, m, n, k, err)
        calls.append(f)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
PY
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
for v in v0 v5; do
    step "src_$v" 60 $(in_tree $v) "$ncu" --clock-control none --profile-from-start off \
        --section SourceCounters --section WarpStateStats --section LaunchStats --section SchedulerStats \
        --section InstructionStats -f -o "$logs/src_$v" python3 "$logs/srcprobe.py"
    step "srcpage_$v" 40 "$ncu" -i "$logs/src_$v.ncu-rep" --page source --print-source sass --csv
    step "details_$v" 20 "$ncu" -i "$logs/src_$v.ncu-rep" --page details
done
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
