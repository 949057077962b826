"""How fast the tuner tunes on this GPU, with its compile pool and without (a GPU machine).

    python -m experiments.tuning_speed [--runs make-run-cold,...] [--rounds 5]

Each run is a command as a user types it, in a fresh working directory (so a fresh --out and
Optuna storage: every trial is measured), with the kernel libraries' disk caches (CuPy's,
Triton's, inductor's) in a folder of the run's group: a `cold` run starts it empty, as on a fresh
machine; a `warm` run reuses what its group's cold run left.

  make-run-cold, make-run-warm      `make run`'s main job, `python -m experiments.quickstart`: its
                                    tuning step (both twins, --workload mnist-mlp, 12 trials a
                                    study) and the three training runs
  workload-search-cold, -warm       `python -m autotune.search --workload mnist-mlp` (50 a study)
  serial-cold                       make run's tuning step with --workers 0, the serial baseline:
                                    each timing process compiles its own trials, one at a time

Then the winners (after make-run-cold and serial-cold): per study, the best config of each run
(trials.csv: a study's own winner, whatever the shipped store holds) is re-timed side by side
with the other's, --rounds times each, alternating (experiments.steps.timings_in_turn): a parallel
search should pick configs as good as a serial one's.

-> experiments/results/<gpu>/tuning_speed.csv, a row per run, device and commit (run again there, it
   is replaced; other commits' rows stay): the
   command, cache, wall_s, and the tuner's own summary: trials, tuning_s, trials_per_s, workers
   (compile processes), cores, and the timing process's ms a measurement loading the config and
   checking and timing it (load_ms, measure_ms); tuning_winners.csv, a row per study (within_3pct: the
   parallel run's winner no more than 3% slower than the serial run's; serial_within_3pct: the
   converse). Logs and working folders
   under --work.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from autotune.search import summary_figures
from experiments.paths import results_dir
from kernels_core.provenance import AS_TEXT, REPO, provenance

TUNING = ["-m", "autotune.search", "--workload", "mnist-mlp", "--backends", "cuda,triton", "--trials", "12"]
# name: (the command's python arguments, cache group, cold or warm)
RUNS = {
    "make-run-cold": (["-m", "experiments.quickstart"], "make-run", "cold"),
    "make-run-warm": (["-m", "experiments.quickstart"], "make-run", "warm"),
    "workload-search-cold": (["-m", "autotune.search", "--workload", "mnist-mlp"], "workload-search", "cold"),
    "workload-search-warm": (["-m", "autotune.search", "--workload", "mnist-mlp"], "workload-search", "warm"),
    "serial-cold": ([*TUNING, "--workers", "0"], "serial", "cold"),
}
WINNERS = ("make-run-cold", "serial-cold")  # the same studies: make run's tuning step, parallel and serial
WITHIN = 0.03
CACHES = {"CUPY_CACHE_DIR": "cupy", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
def run(name: str, work: Path) -> dict:
    """One run of RUNS, in work/<name>/ with its group's caches; its row."""
    argv, group, cache = RUNS[name]
    caches = work / "caches" / group
    if cache == "cold":
        shutil.rmtree(caches, ignore_errors=True)
    elif not caches.exists():
        raise SystemExit(f"tuning_speed: {name} reuses the caches {group}-cold leaves; run that first")
    cwd = work / name
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    env = dict(os.environ, **{var: str(caches / sub) for var, sub in CACHES.items()},
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = work / f"{name}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode:
        said = [line for line in log.read_text().splitlines() if line.strip()]
        raise SystemExit(f"tuning_speed: {name} exited {done.returncode}: {said[-1] if said else 'no output'} "
                         f"(its output: {log})")
    return {**provenance(), "run": name, "command": " ".join(["python", *argv]), "cache": cache,
            "wall_s": round(wall, 1), **summary_figures(log.read_text())}


def study_winners(trials_csv: Path) -> pd.DataFrame:
    """Each study's fastest config that ran correctly, and its time."""
    rows = pd.read_csv(trials_csv)
    ok = rows[rows["status"] == "ok"]
    best = ok.loc[ok.groupby("study")["time_ms"].idxmin()]
    tunables = [c for c in rows.columns if c.isupper() or c in ("num_warps", "num_stages")]
    best["config"] = [json.dumps({k: int(v) for k, v in r.items() if v == v}, sort_keys=True)
                      for r in best[tunables].to_dict("records")]
    return best.set_index("study")[["op", "backend", "dtype", "shape", "config", "time_ms"]]


def study_calls(plan) -> dict:
    """The call each study of `plan` times, by the study's name (trials.csv's `study`)."""
    from autotune.studies import study_name

    return {study_name("", plan.target.name, job.call.op, job.backend, job.call.dtype, job.call.study_key): job.call
            for job in plan.jobs}


def winners(work: Path, rounds: int, tuning: list[str] = TUNING[2:]) -> pd.DataFrame:
    """The parallel run's and the serial run's winner of each study (the search `tuning`, the
    autotune.search arguments both ran), re-timed side by side."""
    from autotune import search
    from autotune.evaluate import Evaluator
    from autotune.plan import build_plan
    from experiments.steps import timings_in_turn

    args = search.parse_args(tuning)
    plan = build_plan(args)
    target = plan.target.name
    parallel, serial = (study_winners(work / name / "experiments" / target / "trials.csv") for name in WINNERS)
    calls = study_calls(plan)
    pool = Evaluator(target, 1, args.timeout, work / "logs")
    rows, prov = [], provenance()
    try:
        for study, p in parallel.iterrows():
            s = serial.loc[study]
            # By key: p.dtype and p.shape are the row Series' own attributes, not its columns.
            row = {**prov, "study": study, **{k: p[k] for k in ("op", "backend", "dtype", "shape")},
                   "parallel_config": p["config"], "serial_config": s["config"], "parallel_ms": p["time_ms"],
                   "serial_ms": s["time_ms"]}
            if p["config"] == s["config"]:
                row.update(parallel_retimed_ms=None, serial_retimed_ms=None, ratio=1.0)
            else:
                takes = [(0, json.loads(p["config"])), (0, json.loads(s["config"]))]
                times = timings_in_turn(pool, calls[study], p["backend"], takes, rounds,
                                        "tuning_speed")
                med = [float(pd.Series(t).median()) for t in times]
                row.update(parallel_retimed_ms=med[0], serial_retimed_ms=med[1], ratio=med[0] / med[1])
            row["within_3pct"], row["serial_within_3pct"] = within(row["ratio"])
            rows.append(row)
    finally:
        pool.close()
    return pd.DataFrame(rows)


def within(ratio):
    """Whether the parallel run's winner is within WITHIN of the serial run's, and the converse;
    `ratio` (parallel / serial time) a number or a Series."""
    return ratio <= 1 + WITHIN, 1 / ratio <= 1 + WITHIN


def winners_summary(found: pd.DataFrame) -> str:
    """Both directions: at a dozen trials a study, which of two searches finds the better config is
    partly the luck of its draws, and that luck falls on both sides, where a pipeline that made the
    parallel search worse would show on one."""
    ratio = found["ratio"]
    parallel, serial = within(ratio)
    return (f"winners, re-timed side by side: the parallel run's within {WITHIN:.0%} of the serial run's in "
            f"{int(parallel.sum())} of {len(found)} studies, the serial run's within {WITHIN:.0%} of the "
            f"parallel run's in {int(serial.sum())}; parallel / serial time median "
            f"{ratio.median():.3f} (range {ratio.min():.3f}-{ratio.max():.3f})")


def put_row(table: Path, row: dict) -> None:
    """`row` into `table`, replacing the row of the same run, device and commit (the run repeated there)
    and keeping the others: earlier commits' rows are the history the findings cite."""
    key = ["run", "device", "commit"]
    old = pd.read_csv(table, dtype=AS_TEXT) if table.exists() else pd.DataFrame(columns=key)
    same = (old[key].astype(str) == pd.Series({k: str(row[k]) for k in key})).all(axis=1)
    pd.concat([old[~same], pd.DataFrame([row])]).to_csv(table, index=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tuning_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}, or winners "
                   "(default: all runs, then the winners)")
    p.add_argument("--rounds", type=int, default=5, help="alternating re-timings of two differing winners")
    p.add_argument("--work", type=Path, default=Path("experiments/runs/tuning_speed"),
                   help="working folders, caches and logs (default experiments/runs/tuning_speed)")
    p.add_argument("--results", type=Path, default=None, help="default experiments/results/<gpu>")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS and n != "winners"]
    if unknown:
        p.error(f"--runs: {', '.join(unknown)}: not one of {', '.join(RUNS)}, winners")
    import torch

    if not torch.cuda.is_available():
        print("tuning_speed needs a CUDA GPU: it times the tuner tuning one.", file=sys.stderr)
        return 2
    results = args.results or results_dir()
    results.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    table = results / "tuning_speed.csv"
    for name in (n for n in names if n in RUNS):
        row = run(name, args.work)
        print(f"{name}: {row['wall_s']:.0f} s wall, {row['trials']} trials in {row['tuning_s']:.0f} s of tuning, "
              f"{row['trials_per_s']:.2f} trials/s ({row['workers']} compile processes, {row['cores']} cores)",
              flush=True)
        put_row(table, row)
    if "winners" in names or args.runs == p.get_default("runs"):
        found = winners(args.work, args.rounds)
        found.to_csv(results / "tuning_winners.csv", index=False, float_format="%.6g")
        print(winners_summary(found))
    print(f"rows: {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
