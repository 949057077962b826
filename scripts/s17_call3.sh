#!/usr/bin/env bash
# Session 17's third device call (issue 12): the GPU tests of this commit's code (call 2's cut one by
# the shard limit), why the CUDA twin's 16 x 16 tiles lose to Triton's at 32 x 1024 x 1024 nn under
# load (128 blocks; call 2's ksweep: 5.06 µs against 3.96 at 16x16x64 w2 s4) when alone (32 x 128)
# their k steps now cost less than Triton's, and a second benchmark of call 2's store.
#   tests     the CUDA twin's matmul, split-K and fused-path GPU tests, in 14 shards; the rest runs
#             only if none failed;
#   src       Nsight Compute, both twins at 16x16x64 w2 s4 (GROUP_M 1) and cuBLAS, 32x1024x1024:nn
#             and :nt: speed of light, memory tables, stall reasons, per-instruction samples (the
#             source page as SASS), L2 requests and sectors by operation, shared-memory conflicts;
#   bench     the trainer's GEMMs and 4096^3 against cuBLAS on store trainer_shapes_s17_sm_90, every
#             case twice.
# Usage: LAB_COMMIT=<code commit> bash scripts/s17_call3.sh [CALL_SECONDS]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
limit=${1:-540}
logs=$(mktemp -d)
export STEP_LOGS=$logs
store=experiments/results/trainer_shapes_s17_sm_90
gemm_gpu_tests 225 14
if ! tests_clean; then
    tar czf "$OUT/results.tgz" -C "$logs" .
    exit 1
fi
cat > "$logs/srcprobe.py" <<'PY'
import torch
from kernels_core import backends
from kernels_core.reference import native
gen = torch.Generator(device="cuda").manual_seed(0)
cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=4, GROUP_M=1, SPLIT_K=1)
calls = []
for layout in ("nn", "nt"):
    a = torch.randn(32, 1024, generator=gen, device="cuda").half()
    b = torch.randn(1024, 1024, generator=gen, device="cuda").half()
    kw = dict(trans_b=layout == "nt")
    ref = native.matmul(a.double(), b.double(), **kw)
    for t in ("cuda", "triton"):
        run = {**cfg, "WGMMA": 0} if t == "cuda" else cfg
        f = lambda t=t, a=a, b=b, run=run, kw=kw: backends.load(t).matmul(a, b, config=run, **kw)
        err = ((f().double() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, (t, layout, err)
        calls.append(f)
    calls.append(lambda a=a, b=b, kw=kw: native.matmul(a, b, **kw))
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in calls:
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
PY
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
step src 120 "$ncu" --clock-control none --profile-from-start off \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section SourceCounters --section WarpStateStats --section LaunchStats --section SchedulerStats \
    --section Occupancy \
    --metrics lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__bytes_read.sum,sm__cycles_active.avg,gpc__cycles_elapsed.max \
    -f -o "$logs/src" python3 "$logs/srcprobe.py"
step details 30 "$ncu" -i "$logs/src.ncu-rep" --page details
step srcpage 40 "$ncu" -i "$logs/src.ncu-rep" --page source --print-source sass --csv
step bench $((limit - SECONDS)) python3 -m experiments.bench_kernels --only trainer,gemm --repeat 2 \
    --tuned-configs "$store/best.json"
cp experiments/results/trainer_gemms_h200.csv "$logs/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$logs" .
cat "$OUT/summary.txt"
