"""What the tuner's own process spends on a trial: its studies' bookkeeping (no GPU needed).

    python -m experiments.tuner_bookkeeping [--trials 12] [--rounds 3]

`make run`'s tuning plan (both twins, --workload mnist-mlp, sm_90's spaces), every config
answered at once with a random time: each study opened and driven as the search drives it
(Search.open's sampler and StudyRunner: ask, suggest, the rules, the claim, the tell), on a new
SQLite storage as the search's default. What is left is the search process's own cost per
trial: the sampler, and the storage's round trips. The GPU's timing process waited through the
tell while the search told each outcome in line with the timing (autotune.tuning: now a thread
of its own tells).

-> experiments/results/<device>/tuner_bookkeeping.csv: a row per round: seconds to open the
   studies, trials, and per trial the ask (sampler and claim) and the tell, in ms.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pandas as pd

from autotune import search
from autotune.evaluate import host_cores
from autotune.plan import build_plan
from autotune.samplers import ORDINAL_SAMPLERS, make_sampler, view_space
from autotune.storage import open_storage
from autotune.studies import StudyRunner, study_name
from experiments.paths import results_dir
from kernels_core.contract import DTYPES
from kernels_core.provenance import provenance


def one_round(plan, sampler: str, trials: int, seed: int, storage_url: str) -> dict:
    storage = open_storage(storage_url)
    target, rand = plan.target, random.Random(seed)
    opened = asked = told = 0.0
    n = 0
    for job in plan.jobs:
        start = time.perf_counter()
        elt = DTYPES[job.call.dtype].itemsize
        view = view_space(job.space, target, elt, False)
        study = optuna.create_study(
            study_name=study_name("", target.name, job.call.op, job.backend, job.call.dtype, job.call.study_key),
            storage=storage, direction="minimize", load_if_exists=True,
            sampler=make_sampler(sampler, seed, view.values, parallel=True, valid=view.valid))
        runner = StudyRunner(study, view, trials, lambda c, space=job.space: target.target_violation(space, c, elt),
                             make_row=lambda config, result, number: {}, ordinal=sampler in ORDINAL_SAMPLERS)
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
    return {"open_s": round(opened, 2), "trials": n, "ask_ms": round(1e3 * asked / n, 1),
            "tell_ms": round(1e3 * told / n, 1), "per_trial_ms": round(1e3 * (asked + told) / n, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tuner_bookkeeping", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=12, help="measured configs a study (default 12, make run's)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each on a new storage (default 3)")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tuning = search.parse_args(["--workload", "mnist-mlp", "--backends", "cuda,triton", "--trials", str(args.trials)])
    # sm_90's spaces, planned as a compile-only run plans them: this needs no GPU, and times nothing.
    tuning.target, tuning.compile_only = "sm_90", True
    plan = build_plan(tuning)
    sampler = tuning.sampler or search.SEARCH_ONLY["sampler"]
    rows, prov = [], provenance()
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            row = one_round(plan, sampler, args.trials, r, f"sqlite:///{Path(tmp) / 'tuning.db'}")
        rows.append({**prov, "round": r, "studies": len(plan.jobs), "sampler": sampler, "storage": "sqlite",
                     "cores": host_cores(), **row})
        print(f"round {r}: {row['trials']} trials, {row['per_trial_ms']} ms a trial (ask {row['ask_ms']}, tell "
              f"{row['tell_ms']}); {row['open_s']} s to open {len(plan.jobs)} studies", flush=True)
    out = results_dir() / "tuner_bookkeeping.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out, index=False)
    print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
