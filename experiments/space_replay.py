"""Replays the tuner's sampler on a matmul space at sm_90 with fake times, every config a predicate
picks twice as fast as any other: does a study give up on a sparse space (100 invalid suggestions in
a row, autotune.studies), and does it measure a picked config at all? One line per seed: seed,
trials measured (below the budget: the study gave up), best time (below 1.0 only if a picked config
was measured). A fourth argument names another sampler (autotune.samplers). `--families both` runs
each seed with the space's kernel families (Space.families: tpe-valid draws a rare one first) and
without, and `--csv` appends a row per run: the family rule's gain where the fast configs are a rare
kernel's, its cost where they are the common kernel's.

    # the wgmma region of the fp16 space (experiments/FINDINGS.md, "wgmma + TMA kernel on Hopper")
    python -m experiments.space_replay 8 fp16 "WGMMA == 1" > experiments/results/h200/wgmma_space_replay.txt
    # the small 2 x 2 tiles of the fp32 SIMT space (experiments/FINDINGS.md, "SIMT fp32 kernel")
    python -m experiments.space_replay 8 fp32 "THREAD_M == THREAD_N == 2 and BLOCK_M * BLOCK_N <= 512" \
        > experiments/results/h200/simt_space_replay.txt
    python -m experiments.space_replay 8 fp32 "THREAD_M == THREAD_N == 2 and BLOCK_M * BLOCK_N <= 512" \
        tpe-valid > experiments/results/h200/simt_space_replay_tpe_valid.txt
    # the family rule (experiments/FINDINGS.md, "Tuner samplers and search quality")
    python -m experiments.space_replay 30 fp32 "WGMMA == 1" tpe-valid --families both --budget 12 \
        --csv experiments/results/cpu/family_replay.csv
"""
import argparse
import math
import random
from pathlib import Path

import optuna
import pandas as pd

from autotune.samplers import SAMPLERS, view_space
from experiments.search_quality import replay
from kernels_core import backends
from kernels_core.contract import DTYPES
from kernels_core.provenance import provenance
from kernels_core.targets import TARGETS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.space_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("seeds", type=int, help="how many sampler runs")
    p.add_argument("dtype", choices=("fp32", "fp16", "bf16"))
    p.add_argument("fast", help="a Python expression over a config's tunables: the configs twice as fast")
    p.add_argument("sampler", nargs="?", default="tpe", choices=SAMPLERS)
    p.add_argument("--backend", default="cuda", choices=("cuda", "triton"))
    p.add_argument("--budget", type=int, default=60, help="configs measured a run (default 60)")
    p.add_argument("--families", choices=("on", "off", "both"), default="on",
                   help="the space's kernel families given to the sampler (default on, as the tuner does)")
    p.add_argument("--csv", type=Path, help="append a row per run here")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, target, rng = backends.space(args.backend, "matmul", args.dtype), TARGETS["sm_90"], random.Random(0)
    elt = DTYPES[args.dtype].itemsize
    rows = [{**c, "status": "ok", "time_ms": (0.5 if eval(args.fast, {}, dict(c)) else 1.0) * (1 + rng.random())}
            for c in view_space(space, target, elt).valid]  # what a search draws from: no lower precision
    grid = pd.DataFrame(rows)
    fast = int((grid.time_ms < 1).sum())
    print("valid", len(grid), "product", math.prod(len(set(grid[t])) for t in space.params), "fast", fast)
    runs = []
    for families in {"on": [space.families], "off": [()], "both": [space.families, ()]}[args.families]:
        for seed in range(args.seeds):
            curve = replay(grid, list(space.params), args.sampler, seed, args.budget, families)
            print(seed, len(curve), min(curve), *(["families" if families else "no families"] * (args.families == "both")),
                  flush=True)
            runs.append({"backend": args.backend, "dtype": args.dtype, "fast": args.fast, "fast_configs": fast,
                         "valid_configs": len(grid), "sampler": args.sampler, "budget": args.budget,
                         "families": " ".join(families) or "none", "seed": seed, "measured": len(curve),
                         "best": min(curve), "found_fast": min(curve) < 1})
    if args.csv:
        table = pd.DataFrame([{**provenance(), **r} for r in runs])
        table.to_csv(args.csv, mode="a", header=not args.csv.exists(), index=False, float_format="%.6g")


if __name__ == "__main__":
    main()
