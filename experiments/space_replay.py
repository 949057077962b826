"""Replays the tuner's TPE sampler on a CUDA matmul space at sm_90 with fake times, every config
a predicate picks twice as fast as any other: does a study give up on a sparse space (100 invalid
suggestions in a row, autotune.studies), and does it measure a picked config at all? One line per
seed: seed, trials measured (below the budget: the study gave up), best time (below 1.0 only if a
picked config was measured). A fourth argument names another sampler (autotune.samplers).

    # the wgmma region of the fp16 space (experiments/FINDINGS.md, "wgmma + TMA kernel on Hopper")
    python -m experiments.space_replay 8 fp16 "WGMMA == 1" > experiments/results/h200/wgmma_space_replay.txt
    # the small 2 x 2 tiles of the fp32 SIMT space (experiments/FINDINGS.md, "SIMT fp32 kernel")
    python -m experiments.space_replay 8 fp32 "THREAD_M == THREAD_N == 2 and BLOCK_M * BLOCK_N <= 512" \
        > experiments/results/h200/simt_space_replay.txt
    python -m experiments.space_replay 8 fp32 "THREAD_M == THREAD_N == 2 and BLOCK_M * BLOCK_N <= 512" \
        tpe-valid > experiments/results/h200/simt_space_replay_tpe_valid.txt
"""
import argparse
import math
import random

import optuna
import pandas as pd

import kernels_cuda as kc
from autotune.samplers import SAMPLERS, view_space
from kernels_core.targets import TARGETS
from kernels_core.contract import DTYPES
from experiments.search_quality import replay


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.space_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("seeds", type=int, help="how many sampler runs")
    p.add_argument("dtype", choices=("fp32", "fp16", "bf16"))
    p.add_argument("fast", help="a Python expression over a config's tunables: the configs twice as fast")
    p.add_argument("sampler", nargs="?", default="tpe", choices=SAMPLERS)
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, target, rng = kc.space("matmul", args.dtype), TARGETS["sm_90"], random.Random(0)
    elt = DTYPES[args.dtype].itemsize
    rows = [{**c, "status": "ok", "time_ms": (0.5 if eval(args.fast, {}, dict(c)) else 1.0) * (1 + rng.random())}
            for c in view_space(space, target, elt).valid]  # what a search draws from: no lower precision
    grid = pd.DataFrame(rows)
    print("valid", len(grid), "product", math.prod(len(set(grid[t])) for t in space.params))
    for seed in range(args.seeds):
        curve = replay(grid, list(space.params), args.sampler, seed, 60)
        print(seed, len(curve), min(curve), flush=True)


if __name__ == "__main__":
    main()
