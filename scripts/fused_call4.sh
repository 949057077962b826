#!/usr/bin/env bash
# Device call 4 of the fused step (issue 14): (1) the fused steps on their own tuned configs
# against the tuned matmul configs they borrow otherwise, alternating, graphed step times;
# (2) the strongest torch step at H = 128 (max-autotune + graph) beside the twins, same commit.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$SECONDS
timeout 100 python3 - > "$OUT/ab.log" 2>&1 <<'PY'
import json, statistics
import pandas as pd
from kernels_core.provenance import provenance
from trainer.config import Config
from trainer.train import step_time
store = json.load(open("experiments/sm_90/best.json"))
store["entries"] = [e for e in store["entries"] if not e["op"].startswith("linear_")]
json.dump(store, open("/tmp/borrowed.json", "w"))
rows = []
for backend in ("triton", "cuda"):
    for h in (128, 1024):
        for rep in range(3):
            for label, path in (("own", "experiments/sm_90/best.json"), ("borrowed", "/tmp/borrowed.json")):
                t = step_time(Config(backend=backend, hidden=h, tuned_configs=path, progress=False), reps=300)
                rows.append(dict(backend=backend, hidden=h, rep=rep, fused_configs=label, step_us=t.median_ms * 1e3,
                                 **provenance()))
                print(rows[-1]["backend"], h, rep, label, round(rows[-1]["step_us"], 1), flush=True)
pd.DataFrame(rows).to_csv("experiments/results/fused_configs_ab_h200.csv", index=False)
PY
echo "ab rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
t0=$SECONDS
timeout $((335 - SECONDS)) python3 -m experiments.compare --protocol default --hidden 128 --steps 500 \
    --variants torch-graph,torch-compile-graph,torch-compile-max-graph,cuda-tuned,triton-tuned > "$OUT/compare.log" 2>&1
echo "compare rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
cp experiments/results/fused_configs_ab_h200.csv experiments/results/trainer_*_fp32.csv "$OUT/" 2>/dev/null
