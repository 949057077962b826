"""What the tuner's own process spends on a trial: its studies' bookkeeping (no GPU needed).

    python -m experiments.tuner_bookkeeping [--trials 12] [--rounds 3]

`make run`'s tuning plan (both twins, --workload mnist-mlp, sm_90's spaces), every config
answered at once with a random time: each study opened by the search's own Search.open and
driven through its StudyRunner (ask, suggest, the rules, the claim and its heartbeat, the tell and
its trials.csv row), on a new SQLite storage as the search's default. What is left is the search process's own cost per
trial: the sampler, and the storage's round trips. The GPU's timing process waited through the
tell while the search told each outcome in line with the timing (autotune.tuning: now a thread
of its own tells).

-> experiments/results/<device>/tuner_bookkeeping.csv: a row per round: seconds to open the
   studies, trials, and per trial the ask (sampler and claim) and the tell, in ms.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pandas as pd

from autotune import search
from autotune.evaluate import host_cores
from autotune.plan import build_plan
from autotune.tuning import Search
from experiments.paths import results_dir
from kernels_core.provenance import provenance


def one_round(trials: int, seed: int, work: Path) -> dict:
    """make run's studies opened and run to their budget by the search's own code (Search.open, its
    StudyRunner, heartbeat and trials.csv), no worker started: every config answered at once."""
    args = search.parse_args(["--workload", "mnist-mlp", "--backends", "cuda,triton", "--trials", str(trials),
                              "--seed", str(seed), "--out", str(work), "--storage", f"sqlite:///{work / 'tuning.db'}"])
    # sm_90's spaces, planned as a compile-only run plans them: this needs no GPU, and times nothing.
    args.target, args.compile_only = "sm_90", True
    # The search's worker pools are made, never started; naming their processes needs a GPU id.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    tuner = Search(build_plan(args), args, trials)
    tuner.bar = SimpleNamespace(update=lambda n: None)  # record() moves a progress bar: none to show here
    rand = random.Random(seed)
    opened = asked = told = 0.0
    n = 0
    try:
        for order, job in enumerate(tuner.plan.jobs):
            start = time.perf_counter()
            runner = tuner.open(order, job).runner
            opened += time.perf_counter() - start
            while True:
                start = time.perf_counter()
                candidate = runner.poll()
                asked += time.perf_counter() - start
                if candidate is None:
                    break
                start = time.perf_counter()
                runner.complete(candidate, {"status": "ok", "time_ms": rand.random()})
                told += time.perf_counter() - start
                n += 1
    finally:
        tuner.heartbeat.stop()
        tuner.csv.close()
    return {"sampler": args.sampler, "studies": len(tuner.plan.jobs), "open_s": round(opened, 2), "trials": n,
            "ask_ms": round(1e3 * asked / n, 1), "tell_ms": round(1e3 * told / n, 1),
            "per_trial_ms": round(1e3 * (asked + told) / n, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tuner_bookkeeping", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=12, help="measured configs a study (default 12, make run's)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each on a new storage (default 3)")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows, prov = [], provenance()
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            row = one_round(args.trials, r, Path(tmp))
        rows.append({**prov, "round": r, "storage": "sqlite", "cores": host_cores(), **row})
        print(f"round {r}: {row['trials']} trials, {row['per_trial_ms']} ms a trial (ask {row['ask_ms']}, tell "
              f"{row['tell_ms']}); {row['open_s']} s to open {row['studies']} studies", flush=True)
    out = results_dir() / "tuner_bookkeeping.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out, index=False)
    print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
