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
