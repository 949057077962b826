"""Tuning on several GPUs: does a second GPU halve the search, and does a winner depend
on which GPU timed it?

    python -m experiments.gpus --out experiments/runs/gpus [--rounds 5] [--seconds S] -- [tuner flags]

Steps, each run until it exits 0 (<out>/gpus_runs.csv keeps every run's seconds and exit code; a
search cut short by --seconds resumes on the next run of this command, its seconds added):
1. one:  the workload search on the first GPU, one worker, a fresh storage in <out>/one;
2. all:  the same search with one worker on each GPU, a fresh storage in <out>/all;
3. pair: two searches at once on one storage (<out>/pair/tuning.db), each on its own GPU with its
   own --seed and --out: the README's recipe for two machines, on one host;
4. spread: the winners of steps 1 and 2, each timed on every GPU, --rounds times, the GPUs in turn.

-> results/<device>/gpus[_<label>].csv, a row per search step: GPUs, wall seconds, configs measured, studies
   whose count is not exactly min(budget, valid configs), configs measured twice;
   results/<device>/gpus_spread[_<label>].csv, a row per study, winner and GPU: median, min and max of its
   timings. The summary prints the speed-up of all GPUs over one (the bar: >= 1.7x for two),
   the spread between GPUs against the spread of repeats on one, and the studies whose two
   winners differ by more than that noise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd

from autotune import samplers, search, studies
from autotune.evaluate import Evaluator
from autotune.plan import build_plan
from kernels_core.store import load_store, store_path
from autotune.worker_pool import visible_gpus
from experiments.steps import run_step, step_seconds, timings_in_turn
from kernels_core.contract import DTYPES
from kernels_core.provenance import AS_TEXT, provenance
from experiments.paths import results_dir

STEPS = ("one", "all", "pair")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.gpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("experiments/runs/gpus"))
    p.add_argument("--gpus", default=None, help="GPU ids to use, e.g. 0,1 (default: every visible GPU)")
    p.add_argument("--rounds", type=int, default=5, help="timings of each winner on each GPU")
    p.add_argument("--seconds", type=float, default=1e9, help="stop a search after this long (it resumes)")
    p.add_argument("--label", default=None, help="results file suffix (default: none)")
    p.add_argument("--results", type=Path, default=None, help="folder (default experiments/results/<device>)")
    p.add_argument("search_args", nargs="*", help="tuner flags for every search, after -- (not --out, "
                   "--workers, --seed, --storage)")
    args = p.parse_args(argv)
    if any(a.split("=")[0] in ("--out", "--workers", "--seed", "--storage") for a in args.search_args):
        p.error("--out, --workers, --seed and --storage are this command's to set")
    args.gpus = args.gpus.split(",") if args.gpus else visible_gpus()
    if len(args.gpus) < 2:
        p.error(f"needs two GPUs or more; sees {len(args.gpus)} (CUDA_VISIBLE_DEVICES or --gpus)")
    args.search = search.parse_args(["--workload", "mnist-mlp", *args.search_args])
    return args


def _command(args, out: Path, gpus: list[str], seed: int, storage: Path) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "autotune.search", "--workload", "mnist-mlp", "--out", str(out),
           "--storage", f"sqlite:///{storage}", "--workers", str(len(gpus)), "--seed", str(seed),
           *args.search_args]
    return cmd, dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))


def _searches(args, step: str) -> list[tuple[list[str], dict, Path]]:
    """(command, environment, out) of each search of a step; a pair's two run at once."""
    root = args.out / step
    if step == "pair":
        storage = root / "tuning.db"
        return [(*_command(args, root / f"gpu{g}", [g], seed, storage), root / f"gpu{g}")
                for seed, g in enumerate(args.gpus[:2], start=1)]
    gpus = args.gpus[:1] if step == "one" else args.gpus
    return [(*_command(args, root, gpus, 0, root / "tuning.db"), root)]


def run_steps(args, ledger: Path, deadline: float) -> bool:
    return all(run_step(ledger, step, [(cmd, env) for cmd, env, _ in _searches(args, step)], deadline, "gpus")
               for step in STEPS)  # all() stops at the first step that did not finish


def judge(args, plan, ledger: Path) -> pd.DataFrame:
    """A row per search step: is every study's count exact, and was any config measured twice?"""
    budget = args.search.trials or search.DEFAULT_TRIALS
    valid = {}
    for job in plan.jobs:
        view = samplers.view_space(job.space, plan.target, DTYPES[job.call.dtype].itemsize)
        name = studies.study_name("", plan.target.name, job.call.op, job.backend, job.call.dtype, job.call.study_key)
        valid[name] = (None if view.valid is None else len(view.valid), list(job.space.params))
    rows, prov = [], provenance()
    for step in STEPS:
        outs = [out for _, _, out in _searches(args, step)]
        trials = pd.concat([pd.read_csv(out / plan.target.name / "trials.csv", dtype=AS_TEXT) for out in outs])
        counted = trials[trials["status"] != "invalid"]
        inexact = twice = 0
        for name, (n_valid, tunables) in valid.items():
            mine = counted[counted["study"] == name]
            inexact += len(mine) != (budget if n_valid is None else min(budget, n_valid))
            twice += int(mine.duplicated(tunables).sum())
        gpus = {"one": 1, "all": len(args.gpus), "pair": 2}[step]
        rows.append({**prov, "step": step, "gpus": gpus,
                     "wall_s": step_seconds(ledger, step), "studies": len(valid),
                     "measured": len(counted), "budget": budget, "studies_not_exact": inexact,
                     "configs_measured_twice": twice, "by_gpu": json.dumps(counted["gpu"].astype(str)
                                                                             .value_counts().to_dict())})
    return pd.DataFrame(rows)


def spread(args, plan) -> pd.DataFrame:
    """The winners of one and all, each timed --rounds times on every GPU, the GPUs in turn."""
    calls = {(job.call.op, job.call.dtype, job.call.key): job.call for job in plan.jobs}
    winners = {}
    for step in ("one", "all"):
        for key, e in load_store(store_path(args.out / step, plan.target.name), plan.target).entries.items():
            winners.setdefault(key, {})[step] = e["config"]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(args.gpus)  # worker i runs on GPU i
    pool = Evaluator(plan.target.name, len(args.gpus), args.search.timeout, args.out / "logs" / "spread")
    rows = []
    try:
        for (op, backend, dtype, shape), configs in sorted(winners.items()):
            for source, config in configs.items():
                if source == "one" and config == configs.get("all"):
                    continue
                takes = [(g, config) for g in range(len(args.gpus))]
                times = timings_in_turn(pool, calls[(op, dtype, shape)], backend, takes, args.rounds, "gpus")
                for g, t in enumerate(times):
                    t = pd.Series(t)
                    rows.append({"op": op, "backend": backend, "dtype": dtype, "shape": shape, "winner_of": source,
                                 "config": json.dumps(config, sort_keys=True), "gpu": args.gpus[g],
                                 "median_ms": t.median(), "min_ms": t.min(), "max_ms": t.max(), "rounds": len(t)})
    finally:
        pool.close()
    return pd.DataFrame(rows)


def summary(steps: pd.DataFrame, times: pd.DataFrame) -> list[str]:
    wall = steps.set_index("step")["wall_s"]
    n = int(steps.set_index("step")["gpus"]["all"])
    within = ((times["max_ms"] - times["min_ms"]) / times["median_ms"]).median()
    by_gpu = times.pivot_table(index=["op", "backend", "shape", "winner_of"], columns="gpu", values="median_ms")
    between = ((by_gpu.max(axis=1) - by_gpu.min(axis=1)) / by_gpu.mean(axis=1)).median()
    first = times[times["gpu"] == times["gpu"].iloc[0]].pivot_table(index=["op", "backend", "shape"],
                                                                    columns="winner_of", values="median_ms")
    lines = [f"{n} GPUs: {wall['one'] / wall['all']:.2f}x the speed of one ({wall['one']:.0f} s -> {wall['all']:.0f} s;"
             f" the bar: >= 1.7x for two)",
             f"spread of a config's time: between GPUs {between:.1%} (median over winners), between repeats on one "
             f"GPU {within:.1%}"]
    if "one" in first.columns:
        apart = first.dropna()
        worse = apart[(apart["one"] / apart["all"] - 1).abs() > max(within, between)]
        lines.append(f"studies whose two winners differ: {len(apart)}; by more than that noise: {len(worse)}"
                     + "".join(f"\n  {' '.join(k)}: one's winner / all's = {r['one'] / r['all']:.3f}" for k, r in worse.iterrows()))
    for r in steps.itertuples():
        lines.append(f"{r.step}: {r.measured} configs in {r.wall_s:.0f} s on {r.gpus} GPU(s) {r.by_gpu}; studies "
                     f"not exactly at budget: {r.studies_not_exact}; configs measured twice: {r.configs_measured_twice}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = build_plan(args.search)
    args.out.mkdir(parents=True, exist_ok=True)
    ledger = args.out / "gpus_runs.csv"
    if not run_steps(args, ledger, time.monotonic() + args.seconds):
        return 3
    steps, times = judge(args, plan, ledger), spread(args, plan)
    label = f"_{args.label}" if args.label else ""
    args.results = args.results or results_dir()
    args.results.mkdir(parents=True, exist_ok=True)
    steps.to_csv(args.results / f"gpus{label}.csv", index=False, float_format="%.6g")
    times.to_csv(args.results / f"gpus_spread{label}.csv", index=False, float_format="%.6g")
    print("\n".join(summary(steps, times)))
    print(f"wrote {args.results / f'gpus{label}.csv'} and gpus_spread{label}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
