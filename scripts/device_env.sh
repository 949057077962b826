# Sourced by the device-call scripts: the repository root as working directory, the carried
# wheels (.whl: Optuna and its dependencies, which the GPU machine's image lacks) installed
# beside it, and both on PYTHONPATH. --upgrade: a warm machine already holds them from a call before.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1

# step NAME SECONDS COMMAND...: COMMAND under its own limit (a stage cut there still leaves the
# call's later stages their time), its output in ${STEP_LOGS:-$OUT}/NAME.log, its exit status and
# seconds in $OUT/summary.txt.
step() {
    local name=$1 secs=$2 t0=$SECONDS
    shift 2
    timeout -s KILL "$secs" "$@" > "${STEP_LOGS:-$OUT}/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
}

# ncu_probe NAME SECONDS [ARGS...]: experiments.ncu_probe under Nsight Compute, which reads only the
# launches between its profiler start and stop, with the sections and metrics behind
# experiments/NOTES.md section 23's tables; the report in ${STEP_LOGS:-$OUT}/NAME.log.
ncu_probe() {
    local name=$1 secs=$2 ncu
    shift 2
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
    step "$name" "$secs" "$ncu" --clock-control none --profile-from-start off \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_requests_srcunit_tex_op_write.sum \
        python3 -m experiments.ncu_probe "$@"
}

# gemm_gpu_tests SECONDS SHARDS: the CUDA twin's matmul, split-K and fused-path GPU tests (both
# kernels, every layout and epilogue, the spaces' samples) in SHARDS processes, each cut at SECONDS
# less 10; outcomes in ${STEP_LOGS:-$OUT}/shards/outcomes.csv.
gemm_gpu_tests() {
    step tests "$1" python3 -m tests.shards --shards "$2" --limit $(($1 - 10)) --log-dir "${STEP_LOGS:-$OUT}/shards" \
        -- -q -m gpu tests/test_ops.py tests/test_fused.py tests/test_splitk.py tests/test_cuda_host_side.py \
        -k "cuda and (matmul or splitk or linear or sampled or space or wide or small_work or a_rows or fused) and not bias_add"
}

# tests_clean [OUTCOMES]: true when gemm_gpu_tests wrote its outcomes and none is one of OUTCOMES
# (default failed|error). outcomes.csv comes from Python's csv module, its lines end in \r\n: a
# pattern anchored at "$" without the \r never matched, and the stages behind it ran whatever the
# tests said (session 17's call 2 went on past an unfinished test).
tests_clean() {
    local csv="${STEP_LOGS:-$OUT}/shards/outcomes.csv"
    [ -f "$csv" ] && ! grep -qE ",(${1:-failed|error})"$'\r'"?\$" "$csv"
}

# The CUDA twin's fp16 products of issue 12's subset (K >= 784, M·N <= 131072: seed protocol, batch 32).
FP16_SUBSET=32x1024x1024:nn,32x1024x1024:nt,32x1024x784:nn,32x10x1024:nn,32x10x4096:nn,32x10x8192:nn,32x128x784:nn,32x4096x4096:nn,32x4096x4096:nt,32x4096x784:nn

# The CUDA twin's fp32 products of issue 12's subset (K >= 784, M·N <= 131072: default protocol, batch 128).
FP32_SUBSET=128x1024x1024:nn,128x1024x1024:nt,128x1024x784:nn,128x10x1024:nn,128x10x4096:nn,128x128x784:nn
