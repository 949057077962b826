"""Stress the tuner's bookkeeping where processes die or share a study (CPU, no GPU).

Two trials, repeated `--rounds` times each, with the test backend (tests/fake_backend.py)
whose configs take `FAKE_COMPILE_S` to "compile" (in the searches' compile pools, `--workers`),
so kills land inside real trial work:
- kill: a search is SIGKILLed at a random moment (up to 0.3 s after its CSV holds a random
  number of rows, 0 to budget - 1), then the same command is rerun;
- share: two searches start at once on one new storage (two machines, in effect).
Each round must end with exactly the budget measured, no config measured twice and
every process exiting 0. The storage is a new SQLite file per round, or with
--storage postgresql a new database per round on a throwaway local PostgreSQL
server (tests/postgres.py). One CSV row per round:
experiments/results/cpu/stress_sharing[_postgresql].csv.

    python -m experiments.stress_sharing --rounds 20 [--storage postgresql] [--workers 0]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from kernels_core.provenance import AS_TEXT, REPO, provenance
from tests.postgres import local_server
from experiments.paths import results_dir

BUDGET = 12


def _search(out: Path, storage: str, seed: int, workers: int) -> list[str]:
    return [sys.executable, "-m", "autotune.search", "--out", str(out), "--storage", storage,
            "--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32",
            "--shapes", "16x16x16", "--sampler", "random", "--trials", str(BUDGET), "--seed", str(seed),
            "--workers", str(workers)]


def _env(tmp: Path) -> dict:
    return dict(os.environ, AUTOTUNE_BACKENDS="fake=tests.fake_backend", TRITON_INTERPRET="1",
                FAKE_COMPILE_S="0.1", FAKE_CACHE_DIR=str(tmp))


def _judge(csvs: list[Path]) -> dict:
    rows = pd.concat([pd.read_csv(c, dtype=AS_TEXT) for c in csvs if c.exists()])
    measured = rows[rows["status"] != "invalid"]
    return {"measured": len(measured), "budget": BUDGET,
            "configs_measured_twice": int(measured.duplicated(["BLOCK_M", "BLOCK_N", "SPLIT"]).sum()),
            "trials_in_two_rows": int(rows.duplicated(["trial"]).sum())}


def _told(logs: list[str]) -> int:
    """Suggestions of configs measured before, told their results at no cost (the summaries)."""
    return sum(int(m[1]) for log in logs for m in re.finditer(r"(\d+) suggestions of configs measured before", log))


def kill_round(tmp: Path, rng: random.Random, storage: str, workers: int) -> dict:
    cmd = _search(tmp / "out", storage, 3, workers)
    csv = tmp / "out" / "cpu" / "trials.csv"
    # By progress, not by the clock: start-up alone takes 2 to 5 s, with the machine's load.
    at_rows, extra_s = rng.randrange(BUDGET), rng.uniform(0, 0.3)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and (csv.read_bytes().count(b"\n") - 1 if csv.exists() else 0) < at_rows:
        time.sleep(0.02)
    time.sleep(extra_s)
    kill_s = time.monotonic() - start
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _judge([csv])["measured"] if csv.exists() else 0
    rerun = subprocess.run(cmd, cwd=REPO, env=_env(tmp), capture_output=True, text=True)
    return {"kill_after_s": round(kill_s, 2), "measured_before_kill": before,
            "exit_codes": str(rerun.returncode), "repeats_told": _told([rerun.stdout]), **_judge([csv])}


def share_round(tmp: Path, rng: random.Random, storage: str, workers: int) -> dict:
    procs = [subprocess.Popen(_search(tmp / f"m{i}", storage, i, workers), cwd=REPO, env=_env(tmp), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for i in (1, 2)]
    logs = [p.communicate()[0] for p in procs]
    return {"kill_after_s": None, "measured_before_kill": None,
            "exit_codes": " ".join(str(p.returncode) for p in procs), "repeats_told": _told(logs),
            **_judge([tmp / f"m{i}" / "cpu" / "trials.csv" for i in (1, 2)])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds of each kind")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill times")
    ap.add_argument("--storage", choices=["sqlite", "postgresql"], default="sqlite",
                    help="a new SQLite file per round (default), or a new database per round on a local "
                         "PostgreSQL server started for the run")
    ap.add_argument("--workers", type=int, default=2,
                    help="each search's compile processes (default 2; 0: its timing process compiles)")
    ap.add_argument("--out", type=Path, help="default experiments/results/cpu/stress_sharing[_postgresql].csv")
    args = ap.parse_args(argv)
    suffix = "" if args.storage == "sqlite" else f"_{args.storage}"
    args.out = args.out or results_dir("cpu") / f"stress_sharing{suffix}.csv"
    rng, rows = random.Random(args.seed), []
    prov = provenance()
    with contextlib.ExitStack() as stack:
        server = None
        if args.storage == "postgresql":
            try:
                server = stack.enter_context(local_server())
            except RuntimeError as exc:  # the local PostgreSQL server did not start
                print(f"stress_sharing: --storage {args.storage}: {exc}", file=sys.stderr)
                return 2
        for kind, run in (("kill", kill_round), ("share", share_round)):
            for i in tqdm(range(args.rounds), desc=kind):
                with tempfile.TemporaryDirectory() as tmp:
                    storage = server.new_database() if server else f"sqlite:///{Path(tmp) / 't.db'}"
                    row = run(Path(tmp), rng, storage, args.workers)
                row["ok"] = (row["measured"] == BUDGET and not row["configs_measured_twice"]
                             and not row["trials_in_two_rows"] and set(row["exit_codes"].split()) == {"0"})
                rows.append({"kind": kind, "round": i, "storage": args.storage, "workers": args.workers, **row, **prov})
    table = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(table.groupby("kind")["ok"].agg(ok="sum", rounds="count").to_string())
    killed = table[table["kind"] == "kill"]["measured_before_kill"]
    print(f"kills that interrupted the search (fewer than {BUDGET} measured): {(killed < BUDGET).sum()} "
          f"of {len(killed)}")
    print(f"rows: {args.out}")
    return 0 if table["ok"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
