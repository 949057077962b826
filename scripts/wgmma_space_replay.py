"""Replays the tuner's TPE sampler on the CUDA fp16 matmul space at sm_90 (mma.sync and wgmma
configs) with fake times, every wgmma config twice as fast as any mma.sync one: does a study give
up on the sparse wgmma region, and does it measure a wgmma config at all? (NOTES section 14.)
One line per seed: seed, trials measured, best time (below 1.0 only if a wgmma config was measured).

    PYTHONPATH=. python scripts/wgmma_space_replay.py 8 > experiments/results/wgmma_space_replay.txt
"""
import math
import random
import sys

import optuna
import pandas as pd

import kernels_cuda as kc
from autotune.targets import TARGETS
from experiments.search_quality import replay

optuna.logging.set_verbosity(optuna.logging.WARNING)
space, target, rng = kc.space("matmul", "fp16"), TARGETS["sm_90"], random.Random(0)
rows = [{**c, "status": "ok", "time_ms": (0.5 if c["WGMMA"] else 1.0) * (1 + rng.random())}
        for c in space.configs(2, 90) if space.cost(c, 2, 90)["smem_bytes"] <= target.smem_per_block_optin]
grid = pd.DataFrame(rows)
print("valid", len(grid), "product", math.prod(len(set(grid[t])) for t in space.params))
for seed in range(int(sys.argv[1])):
    curve = replay(grid, list(space.params), "tpe", seed, 60)
    print(seed, len(curve), min(curve), flush=True)
