#!/usr/bin/env bash
# One call on the lent GPU machine: run the named stages in order, each under its own time limit,
# and pack everything they wrote, logs included, into $OUT/results.tgz (the device tool brings back
# at most 8 files); $OUT/summary.txt has each stage's exit code and the end of its log.
#   bash scripts/gpu_session.sh "tests:200 bench:150 tune:240"
# Stages: tests, bench, tune, train, compare, quality (see the case list below).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lab-out}
LOGS=experiments/logs
mkdir -p "$OUT" "$LOGS"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PWD:/tmp/site"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$LOGS/gpu.txt" 2>&1

run_stage() {
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$LOGS/$name.log" >> "$OUT/summary.txt"
}

for spec in $1; do
    stage=${spec%%:*}; limit=${spec##*:}
    case $stage in
        tests)   run_stage tests "$limit" python3 -m pytest -q -x -m gpu -p no:cacheprovider ;;
        testall) run_stage testall "$limit" python3 -m pytest -q -p no:cacheprovider ;;
        bench)   run_stage bench "$limit" python3 -m experiments.bench_kernels ;;
        tune)    run_stage tune "$limit" python3 -m autotune.search --workload mnist-mlp --backends cuda,triton ${TUNE_ARGS:-} ;;
        retune)  run_stage retune "$limit" python3 -m autotune.search --workload mnist-mlp --backends cuda,triton ${TUNE_ARGS:-} ;;
        train)   run_stage train "$limit" python3 -m experiments.train_all ;;
        compare) run_stage compare "$limit" python3 -m experiments.compare ${COMPARE_ARGS:-} ;;
        quality) run_stage quality "$limit" python3 -m experiments.search_quality ${QUALITY_ARGS:-} ;;
        *) echo "unknown stage $stage" | tee -a "$OUT/summary.txt" ;;
    esac
done
tar czf "$OUT/results.tgz" experiments/results experiments/sm_* experiments/runs "$LOGS" 2>/dev/null
ls -la "$OUT"
