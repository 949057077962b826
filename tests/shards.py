"""Run a pytest selection in several processes at once: `python3 -m tests.shards [--shards N] -- ARGS`.

Why: on a fresh GPU machine the first run of the GPU tests compiles every kernel variant it meets
(CuPy's NVRTC, Triton), one after another in the one pytest process: about a test a second, over
320 s for the gpu-marked suite on the H200 (experiments/FINDINGS.md, "Test-suite cost"), while 15 of the
machine's 16 cores idle. Each compiler is single-threaded, so N processes compile N variants at a
time. They share CuPy's and Triton's disk caches, which both write a finished binary under a
temporary name and rename it, so a variant two shards compile is written whole either way.

How: shard k of N runs `pytest ARGS -p tests.shards` with PYTEST_SHARD=k/N; this module's
collection hook (below) keeps every N-th test of the selection from the k-th, after -m, -k and
--deselect, so the shards' tests are the selection's, each once. A parametrized test's cases sit
next to each other in collection order, so they land in different shards, and so do the kernel
variants they compile. All shards get one KERNEL_TEST_SEED (tests/conftest.py), so the inputs
are those of one plain run with that seed and a failure replays with it.

Every test's outcome is appended to its shard's outcome file the moment each phase ends, so a
shard cut by --limit (or a crash) still says what it ran; the summary counts the tests that never
ran as such. Exit status: 0 when every selected test ran and none failed or errored, 1 otherwise.
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

SHARD_ENV = "PYTEST_SHARD"  # "k/N": this process runs shard k (0-based) of N
OUTCOMES_ENV = "PYTEST_SHARD_OUTCOMES"  # the file this shard's outcomes go to
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the plugin, in each shard

def _shard() -> tuple[int, int] | None:
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return None
    k, n = (int(x) for x in spec.split("/"))
    if not 0 <= k < n:
        raise pytest.UsageError(f"{SHARD_ENV}={spec}: want k/N with 0 <= k < N")
    return k, n


def _record(*fields) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        with open(path, "a") as f:  # one line per write, flushed at close: nothing is lost to a kill
            f.write("\t".join(str(x) for x in fields) + "\n")


@pytest.hookimpl(trylast=True)  # after -m, -k and --deselect have taken their tests out
def pytest_collection_modifyitems(config, items):
    shard = _shard()
    if shard is None:
        return
    k, n = shard
    keep = items[k::n]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k])
    items[:] = keep
    _record("selected", len(keep), "")


def pytest_runtest_logreport(report):
    if _shard() is None:
        return
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    _record(report.when, outcome, report.nodeid)


# ---------------------------------------------------------------- the runner

def outcome_of(phases: dict[str, str]) -> str:
    """One test's result from its phases' outcomes, as pytest's own summary counts them."""
    if phases.get("setup") == "failed" or phases.get("teardown") == "failed":
        return "error"
    call = phases.get("call")
    if call is not None:
        return call
    if phases.get("setup") in ("skipped", "xfailed"):
        return phases["setup"]
    return "unfinished"  # set up, never reached its end: the shard was stopped inside it


def read_outcomes(path: Path) -> tuple[int | None, dict[str, dict[str, str]]]:
    """(tests the shard selected, or None before its collection ended; {nodeid: {phase: outcome}})."""
    selected, tests = None, {}
    if not path.exists():
        return selected, tests
    for line in path.read_text().splitlines():
        when, outcome, nodeid = (line.split("\t", 2) + ["", ""])[:3]
        if when == "selected":
            selected = int(outcome)
        elif nodeid:
            tests.setdefault(nodeid, {})[when] = outcome
    return selected, tests


def _die_with_parent() -> None:
    """A shard is killed when the runner dies, even by SIGKILL (the device calls' `timeout -s KILL`):
    otherwise its tests would go on using the GPU under the call's next stage."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    os.setpgrp()  # its own group: stopping it stops the workers it started too


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.shards", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes at once (default: the CPU count, at most 8)")
    p.add_argument("--limit", type=float, default=None,
                   help="seconds for the whole run; shards still running then are stopped and their unrun tests counted")
    p.add_argument("--log-dir", type=Path, default=ROOT / "experiments" / "logs" / "shards",
                   help="each shard's log and outcomes, and outcomes.csv (default experiments/logs/shards)")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments, as for one run")
    args = p.parse_args(argv)
    if args.shards < 1:
        p.error(f"--shards must be >= 1, got {args.shards}")
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args

    seed = os.environ.get("KERNEL_TEST_SEED") or str(random.randrange(2**31))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KERNEL_TEST_SEED": seed,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"{args.shards} shards, KERNEL_TEST_SEED={seed}: python3 -m pytest {' '.join(pytest_args)}", flush=True)

    shards = []
    t0 = time.monotonic()
    for k in range(args.shards):
        log, outcomes = args.log_dir / f"shard{k}.log", args.log_dir / f"shard{k}.outcomes"
        outcomes.unlink(missing_ok=True)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", *pytest_args, "-p", "tests.shards", "-p", "no:cacheprovider"],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                env={**env, SHARD_ENV: f"{k}/{args.shards}", OUTCOMES_ENV: str(outcomes)})
        shards.append({"k": k, "proc": proc, "log": log, "outcomes": outcomes, "rc": None, "seconds": None})

    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append("SIGTERM"))  # the stage's own timeout: summarize first
    from tqdm import tqdm  # here, not at the top: every shard imports this module as its plugin

    with tqdm(desc="tests", unit="test", file=sys.stdout, mininterval=10, dynamic_ncols=True) as bar:
        while True:
            for s in shards:
                if s["rc"] is None and (rc := s["proc"].poll()) is not None:
                    s["rc"], s["seconds"] = rc, time.monotonic() - t0
            read = [read_outcomes(s["outcomes"]) for s in shards]
            if bar.total is None and all(sel is not None for sel, _ in read):
                bar.total = sum(sel for sel, _ in read)
            bar.update(sum(sum(1 for ph in tests.values() if "teardown" in ph) for _, tests in read) - bar.n)
            if all(s["rc"] is not None for s in shards):
                break
            if not stopped and args.limit is not None and time.monotonic() - t0 > args.limit:
                stopped.append(f"--limit {args.limit:g}s")
            if stopped:
                for s in shards:
                    if s["rc"] is None:
                        os.killpg(s["proc"].pid, signal.SIGKILL)
                        s["rc"], s["seconds"] = "stopped", time.monotonic() - t0
                break
            time.sleep(1)
    return summarize(shards, args.log_dir, seed, stopped)


def summarize(shards, log_dir: Path, seed: str, stopped: list[str]) -> int:
    rows, totals, unrun = [], Counter(), 0
    print(f"\n{'shard':>5} {'rc':>8} {'seconds':>8} {'tests':>6}  log")
    for s in shards:
        selected, tests = read_outcomes(s["outcomes"])
        for nodeid, phases in tests.items():
            rows.append({"nodeid": nodeid, "shard": s["k"], "outcome": outcome_of(phases)})
        unrun += (selected or 0) - len(tests)
        print(f"{s['k']:>5} {s['rc']!s:>8} {s['seconds']:>8.0f} {len(tests):>6}  {s['log']}")
    totals.update(r["outcome"] for r in rows)
    with open(log_dir / "outcomes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["nodeid", "shard", "outcome"])
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: r["nodeid"]))
    bad = [r for r in rows if r["outcome"] in ("failed", "error", "xpassed", "unfinished")]
    for r in sorted(bad, key=lambda r: r["nodeid"]):
        print(f"{r['outcome'].upper()} {r['nodeid']}  (shard {r['shard']}: {shards[r['shard']]['log']})")
    crashed = [s["k"] for s in shards if s["rc"] not in (0, 1, 5, "stopped")]
    counts = ", ".join(f"{n} {o}" for o, n in sorted(totals.items())) or "no tests"
    print(f"{counts}; {unrun} not run" + (f" (stopped: {stopped[0]})" if stopped else "")
          + (f"; shards {crashed} ended with errors (see their logs)" if crashed else "")
          + f"; KERNEL_TEST_SEED={seed}; outcomes in {log_dir / 'outcomes.csv'}")
    return 0 if not bad and not unrun and not crashed and not stopped else 1


if __name__ == "__main__":
    sys.exit(main())
