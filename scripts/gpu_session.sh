#!/usr/bin/env bash
# One call on the lent GPU machine: run the named stages, each under its own time limit, and pack
# everything they wrote, logs included, into $OUT/results.tgz (the device tool brings back at most
# 8 files); $OUT/summary.txt has each stage's exit code and the end of its log.
#   bash scripts/gpu_session.sh "tests:200 bench:150 tune:240"
# Lanes separated by "|" run at the same time, each on the GPU named after "@" (stages within a
# lane run in order); on a machine of two GPUs:
#   bash scripts/gpu_session.sh "tune:520@0 | testall:520@1"
# Stages: tests, testall, bench, tune, compare (compare2, ...), quality (see the case list
# below); their extra arguments come from TUNE_ARGS, BENCH_ARGS, COMPARE_ARGS (COMPARE2_ARGS, ...),
# QUALITY_ARGS, TEST_ARGS (and TEST_SHARDS: the tests stage's processes, default 12).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
OUT=${OUT:-/tmp/lab-out}
LOGS=experiments/logs
mkdir -p "$OUT" "$LOGS"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$LOGS/gpu.txt" 2>&1

run_stage() {
    local name=$1 limit=$2; shift 2
    [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && name="$name-gpu$CUDA_VISIBLE_DEVICES"  # lanes running one stage keep their logs apart
    echo "== $name (limit ${limit}s, GPU ${CUDA_VISIBLE_DEVICES:-all}): $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$LOGS/$name.log" >> "$OUT/summary.txt"
}

run_lane() {
    for spec in $1; do
        local stage=${spec%%:*} rest=${spec#*:}
        local limit=${rest%%@*}
        case $stage in
            # In TEST_SHARDS processes (tests/shards.py): a cold machine compiles that many kernels at once.
            tests)   run_stage tests "$limit" python3 -m tests.shards --shards "${TEST_SHARDS:-12}" --limit $((limit - 20)) \
                         --log-dir "$LOGS/shards" -- -q -m gpu ${TEST_ARGS:-} ;;
            testall) run_stage testall "$limit" python3 -m pytest -q -p no:cacheprovider ${TEST_ARGS:-} ;;
            bench)   run_stage bench "$limit" python3 -m experiments.bench_kernels ${BENCH_ARGS:-} ;;
            tune)    run_stage tune "$limit" python3 -m autotune.search --workload mnist-mlp --backends cuda,triton ${TUNE_ARGS:-} ;;
            compare*) local var="${stage^^}_ARGS"  # compare2 takes COMPARE2_ARGS: two lanes, two comparisons
                     run_stage "$stage" "$limit" python3 -m experiments.compare ${!var:-} ;;
            quality) run_stage quality "$limit" python3 -m experiments.search_quality ${QUALITY_ARGS:-} ;;
            *) echo "unknown stage $stage" | tee -a "$OUT/summary.txt" ;;
        esac
    done
}

IFS='|' read -ra LANES <<< "$1"
pids=()
for lane in "${LANES[@]}"; do
    gpu=$(grep -o '@[0-9,]*' <<< "$lane" | head -n 1 | tr -d @)
    if [ -n "$gpu" ]; then
        (export CUDA_VISIBLE_DEVICES=$gpu; run_lane "$lane") &
    else
        run_lane "$lane" &
    fi
    pids+=($!)
done
wait "${pids[@]}"
tar czf "$OUT/results.tgz" experiments/results experiments/sm_* experiments/runs experiments/tuning.db "$LOGS" 2>/dev/null
ls -la "$OUT"
