"""Is the tuner's default budget enough? The workload search at its default budget against a
long run of the same studies, on the GPU.

1. `python -m autotune.search --workload mnist-mlp` (the default budget, 50 measured configs per
   study) into a fresh --out, timed; its best.json is kept as best_default.json.
2. The same command with --trials LONG on the same storage: it resumes each study, so the long
   run's first configs are step 1's (told their results, not measured again), timed.
3. Per study, step 1's winner against the long run's best. Where they are different configs,
   both are timed again on one GPU, alternating, --rounds times each, through the tuner's own
   worker: a best of LONG single timings is biased low by their noise, and re-timing the two on
   equal terms removes that bias before the 3% is judged.

Each step is skipped once done (search_budget_runs.csv in --out records every run of a step,
its seconds and exit code), and a search killed by --seconds resumes, so one command can be
run again and again under a time limit until it is done:

    python -m experiments.search_budget --out experiments/runs/budget --seconds 500

-> <out>/search_budget_runs.csv, <results>/search_budget[_<label>].csv (a row per
study) and a printed summary: the share of studies whose default winner is within 3% of the
long run's best (the bar: >= 90%), and the wall time of each step.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import pandas as pd

from autotune import search
from autotune.evaluate import Evaluator
from autotune.plan import build_plan
from kernels_core.store import load_store, store_path
from experiments.steps import run_step, step_seconds, timings_in_turn
from kernels_core.provenance import provenance
from experiments.paths import results_dir

WITHIN = 0.03
BAR = 0.90


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.search_budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("experiments/runs/search_budget"),
                   help="the searches' --out (a fresh one measures everything afresh)")
    p.add_argument("--default-trials", type=int, default=None,
                   help=f"the budget judged (default: the tuner's own, {search.DEFAULT_TRIALS})")
    p.add_argument("--long-trials", type=int, default=150, help="the long run's budget per study")
    p.add_argument("--rounds", type=int, default=5, help="alternating re-timings of each differing pair")
    p.add_argument("--seconds", type=float, default=1e9,
                   help="stop a search after this long (it resumes on the next run of this command)")
    p.add_argument("--label", default=None, help="results file suffix (default: none)")
    p.add_argument("--results", type=Path, default=None, help="where the per-study CSV goes (default experiments/results/<device>)")
    p.add_argument("search_args", nargs="*",
                   help="passed to both searches after --, e.g. -- --hidden 128 --workers 10 (not --out, --trials)")
    args = p.parse_args(argv)
    args.search = search.parse_args(["--workload", "mnist-mlp", "--out", str(args.out), *args.search_args])
    args.default_trials = args.default_trials or search.DEFAULT_TRIALS
    if any(a.split("=")[0] in ("--trials", "--out") for a in args.search_args):
        p.error("--trials and --out are this command's to set (--long-trials, --out)")
    return args


def run_steps(args, ledger: Path, deadline: float) -> bool:
    """Steps 1 and 2, each until it exits 0; False when one stopped first."""
    best = store_path(args.out, args.plan.target.name)
    for step, trials in (("default", args.default_trials), ("long", args.long_trials)):
        argv = [sys.executable, "-m", "autotune.search", "--workload", "mnist-mlp", "--out", str(args.out),
                *args.search_args, "--trials", str(trials)]
        if not run_step(ledger, step, [(argv, None)], deadline, "search_budget"):
            return False
        if step == "default" and not best.with_name("best_default.json").exists():  # before the long run moves it
            shutil.copy(best, best.with_name("best_default.json"))
    return True


def compare(args, ledger: Path) -> pd.DataFrame:
    best = store_path(args.out, args.plan.target.name)
    default, long = (load_store(path, args.plan.target).entries for path in (best.with_name("best_default.json"), best))
    calls = {(job.call.op, job.call.dtype, job.call.key): job.call for job in args.plan.jobs}
    pool = Evaluator(args.plan.target.name, 1, args.search.timeout, args.out / "logs" / "search_budget")
    rows, prov = [], provenance()
    try:
        for key, d in sorted(default.items()):
            l = long[key]
            op, backend, dtype, shape = key
            row = {**prov, "op": op, "backend": backend, "dtype": dtype, "shape": shape,
                   "default_trials": d["trials"], "long_trials": l["trials"],
                   "default_config": json.dumps(d["config"], sort_keys=True),
                   "long_config": json.dumps(l["config"], sort_keys=True),
                   "default_ms": d["time_ms"], "long_ms": l["time_ms"]}
            if d["config"] == l["config"]:
                row.update(default_retimed_ms=None, long_retimed_ms=None, ratio=1.0)
            else:
                takes = [(0, d["config"]), (0, l["config"])]
                times = dict(zip(("default", "long"), timings_in_turn(pool, calls[(op, dtype, shape)], backend, takes,
                                                                    args.rounds, "search_budget")))
                med = {k: float(pd.Series(v).median()) for k, v in times.items()}
                row.update(default_retimed_ms=med["default"], long_retimed_ms=med["long"],
                           ratio=med["default"] / med["long"])
            row["within_3pct"] = row["ratio"] <= 1 + WITHIN
            rows.append(row)
    finally:
        pool.close()
    table = pd.DataFrame(rows)
    for step in ("default", "long"):
        table[f"{step}_wall_s"] = step_seconds(ledger, step)
    table["long_budget"] = args.long_trials
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    args.plan = build_plan(args.search)
    args.out.mkdir(parents=True, exist_ok=True)
    ledger = args.out / "search_budget_runs.csv"
    if not run_steps(args, ledger, time.monotonic() + args.seconds):
        return 3
    table = compare(args, ledger)
    path = (args.results or results_dir()) / (f"search_budget_{args.label}.csv" if args.label else "search_budget.csv")
    table.to_csv(path, index=False, float_format="%.6g")
    share = table["within_3pct"].mean()
    print(table[["op", "backend", "shape", "default_trials", "long_trials", "ratio", "within_3pct"]].to_string(index=False))
    print(f"\n{int(table['within_3pct'].sum())} of {len(table)} studies ({share:.0%}): the default budget's winner "
          f"within {WITHIN:.0%} of the best of {args.long_trials} (bar {BAR:.0%}: {'met' if share >= BAR else 'missed'}); "
          f"wall time: default {table['default_wall_s'].iloc[0]:.0f} s, long run "
          f"{table['long_wall_s'].iloc[0]:.0f} s more\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
