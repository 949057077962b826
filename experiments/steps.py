"""What the tuner experiments run on a GPU share (experiments.search_budget, experiments.gpus):
steps that resume across runs cut short by a time limit, and timings taken in turn.

A step is one or more commands run at once; <out>/<name>_runs.csv, the ledger, keeps each run's
seconds and exit code. A step with a run that exited 0 is done; one cut short by the deadline is
run again next time (the tuner resumes its searches), its seconds added to the step's.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pandas as pd

from autotune.evaluate import Evaluator
from kernels_core.mlp import Call

LEDGER_COLUMNS = ["step", "seconds", "rc"]


def _ledger(ledger: Path) -> pd.DataFrame:
    return pd.read_csv(ledger) if ledger.exists() else pd.DataFrame(columns=LEDGER_COLUMNS)


def step_seconds(ledger: Path, step: str) -> float:
    """Every run of `step` together: a step resumed over several calls took their sum."""
    runs = _ledger(ledger)
    return float(runs[runs["step"] == step]["seconds"].sum())


def run_step(ledger: Path, step: str, commands: list[tuple[list[str], dict | None]], deadline: float,
             who: str) -> bool:
    """Run `step`'s commands (argv, environment) at once unless the ledger says it is done;
    True once it is, False when it stopped (a command failed, or the deadline came first)."""
    runs = _ledger(ledger)
    if (runs[runs["step"] == step]["rc"] == 0).any():
        return True
    if time.monotonic() >= deadline:
        return False
    print(f"{who}: step {step}", flush=True)
    start = time.monotonic()
    procs = [subprocess.Popen(argv, env=env) for argv, env in commands]
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:  # SIGKILL: a resumable search loses only the trials in flight
        for p in procs:
            p.kill()
            p.wait()
        codes = [-9]
    rc, seconds = max(codes, key=abs), time.monotonic() - start
    runs = pd.concat([runs, pd.DataFrame([{"step": step, "seconds": round(seconds, 1), "rc": rc}])])
    runs.to_csv(ledger, index=False)
    if rc != 0:
        print(f"{who}: step {step} stopped (exit {rc}) after {seconds:.0f} s; run again to resume")
    return rc == 0


def timings_in_turn(pool: Evaluator, call: Call, backend: str, takes: list[tuple[int, dict]], rounds: int,
                    who: str) -> list[list[float]]:
    """Each (worker, config) of `takes` timed `rounds` times, all of them in turn within a round,
    so a drift of the GPU's clocks falls on every one alike; any outcome but ok stops the run."""
    times: list[list[float]] = [[] for _ in takes]
    for r in range(rounds):
        for (worker, config), mine in zip(takes, times):
            result = pool.evaluate(worker, call, backend, config, seed=r)
            if result.get("status") != "ok":
                raise SystemExit(f"{who}: {call.op} {backend} {call.key} {config} on worker {worker}: "
                                 f"{result.get('status')}: {result.get('error')}")
            mine.append(result["time_ms"])
    return times
