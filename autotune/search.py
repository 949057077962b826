"""Tune the kernel twins' configs with Optuna: `python -m autotune.search --help`.

Every trial runs in a worker subprocess (autotune.worker): compile, check
against the float64 reference on fresh random inputs, time (on a GPU, ten calls
replayed as one CUDA graph, kernels_core.timing.bench_in_graph: the kernel's own
time with inputs warm in L2, as inside a graphed training step; per call with
L2 flushed, kernels_core.timing.bench, for an op that cannot be captured or on the
CPU). Results go to <out>/<target>/trials.csv (a row per
trial, flushed as it ends), the Optuna storage (committed per trial), and
<out>/<target>/best.json (the winners, rewritten atomically after each study; an entry
already there is replaced only by a winner that beats its config in the same run; where the
op's default config beats both, the entry is the default config).
Re-running a command resumes it; a SIGKILL loses at most the trials in flight.

Several machines can share studies through one RDB URL (e.g.
--storage postgresql+psycopg://user:pass@host/db): each counts the trials of all of
them against --trials, and reuses configs any of them measured.
"""
from __future__ import annotations

import sys

from autotune import console

try:  # a Ctrl-C while these load (torch takes a second or more) ends as one later does
    import argparse
    import math
    import re
    from pathlib import Path

    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    from autotune import compile_sweep
    from autotune.errors import SearchError, SearchStopped
    from autotune.plan import build_plan
    from autotune.samplers import DEFAULT_SAMPLER, SAMPLERS
    from autotune.storage import STORAGE_ERRORS, shown_url, storage_problem
    from autotune.evaluate import host_cores
    from autotune.tuning import DEFAULT_MAX_COMPILERS, Search
    from autotune.worker_pool import WorkerStartError
    from kernels_core.backends import BackendError
    from kernels_core.cli import OneLineParser, whole_number
    from kernels_core.mlp import DEFAULT
    from kernels_core.store import StoreError
    from kernels_core.targets import TARGETS, TargetError
    from kernels_core.contract import MAX_DIM
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise  # imported by another program: its Ctrl-C is its own to report
    sys.exit(console.interrupted())

DEFAULT_TRIALS = 50
# A worker is set aside after this many trials in a row end with it crashed, hung or unable to
# launch: a lost GPU would otherwise cost every trial left a restart and a failure (about 10 s
# each, or --timeout for a hang). Healthy GPUs see such outcomes one config at a time, rarely more
# than a few in a row (4 of tests/fake_backend.py's 10 valid relu configs crash or hang).
MAX_FAILURES_IN_A_ROW = 10
# Flags a --compile-only run has no use for (a config's compile does not depend on the shape,
# and it keeps no Optuna study), with the default each takes otherwise.
SEARCH_ONLY = {"workload": "mnist-mlp", "hidden": (DEFAULT.hidden,), "layers": DEFAULT.layers,
               "batch_size": DEFAULT.batch_size, "shapes": None, "momentum": DEFAULT.momentum,
               "sampler": DEFAULT_SAMPLER,
               "storage": None}  # storage: OUT/tuning.db


# --timeout: a step of a trial is a config's compile (Triton's and nvcc's take seconds), or its
# check and timing (on a GPU, repeats for up to evaluate.GPU_BENCH's 2 s): under a second, every
# new config would time out. The waiting (select) takes at most about 9.2e9 s (int64
# nanoseconds); 1e9 s is 31 years.
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 1e9
# A study measures at most this many configs, and --compile-only compiles at most this many per
# op: a million is weeks of a GPU per study, and a space too large to enumerate is sampled by
# drawing up to 200 times the cap.
MAX_TRIALS = 1_000_000
# Each compile process has torch loaded (and a CUDA context on its GPU).
MAX_WORKERS = 256
# The mnist-mlp workload's calls are the same for every depth from 2 on, but for sgd_update's length.
MAX_LAYERS = 1024
# Optuna's samplers seed numpy's RandomState, which takes seeds in [0, 2**32).
MAX_SEED = 2**32 - 1
WORKLOAD_FLAGS = ("workload", "hidden", "layers", "batch_size")  # what --shapes replaces


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:  # False for NaN too
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}")
    return value


def _momentum(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:  # False for NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a momentum in [0, 1)")
    return value


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1 or max(widths) > MAX_DIM:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of widths from 1 to {MAX_DIM}, like 128,1024,4096")
    return widths


class _Parser(OneLineParser):
    def refuse(self, message: str):
        console.error(message)  # the tuner's one prefix, whatever the message holds
        self.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m autotune.search", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="auto", choices=["auto", *TARGETS],
                   help="GPU to tune for; auto = the local GPU; cpu = the host: the Triton twin under its "
                        "interpreter (pipeline tests; the CUDA twin is skipped; nothing to --compile-only)")
    p.add_argument("--ops", default="all", help="comma-separated ops, or all (default: the contract's ops); "
                   "persistent tunes the persistent training kernel on the workload's net, time per step")
    p.add_argument("--backends", default="cuda,triton", help="comma-separated (default cuda,triton; "
                   "more via AUTOTUNE_BACKENDS=name=module)")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated of fp32,fp16,bf16 (default: fp32, the trainer's, for --workload; "
                        "else fp16)")
    p.add_argument("--workload", choices=["mnist-mlp"],
                   help=f"shapes of the trainer's calls (default {SEARCH_ONLY['workload']}; not with --shapes)")
    p.add_argument("--hidden", type=_widths, help="mnist-mlp hidden width, or a comma list of widths tuned in one "
                   f"run (default {SEARCH_ONLY['hidden'][0]}; not with --shapes)")
    p.add_argument("--layers", type=whole_number(1, MAX_LAYERS),
                   help=f"mnist-mlp hidden layers (default {SEARCH_ONLY['layers']}; not with --shapes)")
    p.add_argument("--batch-size", type=whole_number(1, MAX_DIM),
                   help=f"mnist-mlp batch size (default {SEARCH_ONLY['batch_size']}; not with --shapes)")
    p.add_argument("--momentum", type=_momentum,
                   help="the trainer's SGD momentum, for sgd_update and linear_sgd: 0 (the seed protocol's) tunes "
                        "them without momentum buffers, as the trainer runs them, any other value with "
                        f"(default {SEARCH_ONLY['momentum']})")
    p.add_argument("--shapes", help="e.g. 4096x4096x4096,128x1024x784:tn (matmul, layout nn by default), "
                   "128x1024 (row ops), 1863690 (sgd_update); each op takes the shapes of its rank")
    p.add_argument("--trials", type=whole_number(1, MAX_TRIALS), help=f"measured trials per study (default "
                   f"{DEFAULT_TRIALS}); with --compile-only, the most configs compiled per op (default 256)")
    p.add_argument("--timeout", type=seconds, default=180.0,
                   help="seconds one trial step (compile, or check + timing) may take before its worker is "
                   f"killed and the trial recorded as timeout ({MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}, default 180)")
    p.add_argument("--sampler", choices=SAMPLERS, help=f"default {SEARCH_ONLY['sampler']}")
    p.add_argument("--storage", help="Optuna RDB URL (default: sqlite:///OUT/tuning.db)")
    p.add_argument("--study-prefix", default="", help="prefix of every study name: new studies (configs measured "
                   "under another prefix are still reused; a new --storage measures everything afresh)")
    p.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0,
                   help="seeds the sampler and the inputs; give each machine sharing a study its own, "
                        "or their samplers propose the same configs and spend suggestions on each other's")
    p.add_argument("--workers", type=whole_number(0, MAX_WORKERS),
                   help="compile processes, which compile configs ahead of the one timing process per GPU (default: "
                        f"the cores but one per GPU and one, at most {DEFAULT_MAX_COMPILERS}; 0 on cpu, whose "
                        "interpreter compiles nothing; 0: each timing process compiles its own configs, one at a "
                        "time); with --compile-only, the processes compiling (default: up to 8)")
    p.add_argument("--max-failures-in-a-row", type=whole_number(1), default=MAX_FAILURES_IN_A_ROW,
                   help="a worker whose trials end this many times in a row with it crashed, hung or unable to "
                        "launch (a lost GPU) gets no more; the search stops when none is left "
                        f"(default {MAX_FAILURES_IN_A_ROW})")
    p.add_argument("--lower-precision", action="store_true",
                   help="also try configs that compute below their dtype's precision (fp32 matmuls on TF32 "
                        "tensor cores, TF32=1: about 1e-3 relative error), held to that precision's tolerance; "
                        "their studies are named apart (:lower-precision) and their winners go to the store")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every (sampled) config for a GPU --target and record registers, smem, spills; "
                        "no GPU, no study, no shapes")
    p.add_argument("--out", type=Path, default=Path("experiments"),
                   help="results go to OUT/<target>/, the Optuna storage to OUT/tuning.db (default: experiments)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in SEARCH_ONLY if getattr(args, name) is not None]
    if args.compile_only and given:
        p.error(f"{', '.join(given)}: not used by --compile-only, which compiles each config once for the "
                f"target, whatever the shape, and keeps no Optuna study; drop {'it' if len(given) == 1 else 'them'}")
    if args.compile_only and args.workers == 0:
        p.error("--compile-only --workers 0: no process would compile; leave --workers out for up to 8")
    if args.compile_only and args.target == "cpu":
        p.error("--compile-only --target cpu: the cpu target runs the Triton twin under its interpreter, which "
                "compiles nothing; compile offline for a GPU target (the interpreter plays sm_90: --target sm_90)")
    replaced = [f"--{name.replace('_', '-')}" for name in WORKLOAD_FLAGS if getattr(args, name) is not None]
    if args.shapes is not None and replaced:
        p.error(f"{', '.join(replaced)}: the mnist-mlp workload's, which --shapes replaces with the shapes it "
                f"names; drop {'it' if len(replaced) == 1 else 'them'} or --shapes")
    if args.storage is not None and _in_memory(args.storage):
        p.error(f"--storage {args.storage}: names no database file, so SQLite keeps an empty database in the "
                "memory of each connection, which the search's threads and worker processes cannot share; "
                "pass a file (sqlite:///PATH/tuning.db) or leave --storage out for OUT/tuning.db")
    for name, default in SEARCH_ONLY.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.storage = _anchored(args.storage or f"sqlite:///{args.out / 'tuning.db'}")  # one --out root holds every output
    return args


NO_FILE = (None, "", ":memory:")  # a SQLite URL's database where it names no file


def _anchored(url: str) -> str:
    """A SQLite URL whose file is named relative to here, made absolute: the compile and timing
    processes run in the repository's directory, and must open the search's database, not their own."""
    parsed = _sqlite(url)
    if parsed is None or parsed.database in NO_FILE:
        return url
    return parsed.set(database=str(Path(parsed.database).expanduser().absolute())).render_as_string(hide_password=False)


def _in_memory(url: str) -> bool:
    parsed = _sqlite(url)
    return parsed is not None and parsed.database in NO_FILE


def _sqlite(url: str):
    """`url` parsed, where it names a SQLite database; None for any other, or for no URL at all
    (opening it says what is wrong)."""
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return None
    return parsed if parsed.get_backend_name() == "sqlite" else None


def check_out(out: Path) -> None:
    """Refuse an --out that is, or lies under, something other than a directory."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise SearchError(f"--out {out}: {path} is a file, not a directory")
            return


def nothing_timed(search: Search) -> str:
    """Why a run whose every trial failed measured nothing, and what to change."""
    n = sum(search.outcomes.values())
    if set(search.outcomes) == {"timeout"}:
        return (f"every one of the {n} trials of this run timed out (--timeout {search.args.timeout:g} s, for "
                "each compile and for each check with its timing): no config was timed; pass a larger --timeout "
                "(default 180)")
    failures = ", ".join(f"{k}:{v}" for k, v in sorted(search.outcomes.items()))
    return (f"none of the {n} trials of this run ran correctly ({failures}): no config was timed; each one's "
            f"error is in {search.csv.path}")


def print_summary(search: Search, interrupted: bool) -> None:
    import pandas as pd

    print()
    if search.summary:
        table = pd.DataFrame(search.summary)
        for col in ("vs default", "vs torch"):
            table[col] = table[col].map(lambda v: f"{v:.3g}x" if v == v and v is not None else "-")
        if search.target.name == "cpu":  # an interpreter against native code: no measure of the kernel
            table = table.drop(columns="vs torch")
        table["time_ms"] = table["time_ms"].map(lambda v: f"{v:.4g}" if v == v and v is not None else "-")
        print(table.to_string(index=False))
        if search.target.name == "cpu":
            print("(no 'vs torch' on the cpu target: the Triton kernels run in its Python interpreter, "
                  "torch natively)")
    invalid_now = sum(lane.runner.invalid for lane in search.lanes)
    reused_now = sum(lane.runner.reused for lane in search.lanes)
    done, measured = len(search.summary), sum(search.outcomes.values())
    finished = f"{done} of {len(search.lanes)} studies finished" if interrupted else f"{done} studies"
    print(f"\n{finished} on {search.target.name} ({search.args.sampler}, budget {search.budget} "
          f"measured configs each). This run: {measured} trials measured, {reused_now} "
          f"suggestions of configs measured before told their results at no cost, {invalid_now} suggestions "
          f"pruned as invalid before compiling ({sum(s['invalid'] for s in search.summary)} in the finished studies).")
    compilers = f"{len(search.compilers)} compile processes" if len(search.compilers) else "no compile pool"
    print(f"Tuning took {search.seconds:.1f} s: {measured / search.seconds if search.seconds else 0:.2f} trials a "
          f"second ({compilers}, {len(search.pool)} timing process{'es' if len(search.pool) > 1 else ''}, "
          f"{host_cores()} cores).")
    if search.pool.evaluations:
        n = search.pool.evaluations
        print(f"A measurement took {1e3 * (search.pool.load_s + search.pool.measure_s) / n:.0f} ms of a timing "
              f"process: {1e3 * search.pool.load_s / n:.0f} ms loading the config (fresh inputs, its kernels from "
              f"the disk caches, a first call), {1e3 * search.pool.measure_s / n:.0f} ms checking and timing it.")
    for line in search.plan.skipped:
        print(f"skipped {line}")
    for why in search.retired.values():
        print(f"set aside: {why}")
    if interrupted:
        print("interrupted: trials in flight were dropped; re-run the same command to resume.")
    # Only files there are: an interrupted first run has no winner yet.
    best = search.best_path if search.best_path.exists() else "none yet: no study has finished with a config that ran"
    print(f"trials: {search.csv.path}\nbest:   {best}\nstudies: {shown_url(search.args.storage)}")


SUMMARY_RATE = re.compile(r"Tuning took ([\d.]+) s: ([\d.]+) trials a second \((?:no compile pool|(\d+) compile "
                          r"processes), (\d+) timing process(?:es)?, (\d+) cores\)")
SUMMARY_TRIALS = re.compile(r"This run: (\d+) trials measured")
SUMMARY_LANE = re.compile(r"A measurement took \d+ ms of a timing process: (\d+) ms loading .*?, (\d+) ms checking")


def summary_figures(output: str) -> dict:
    """The figures print_summary gave of the last search in `output`: trials, tuning_s,
    trials_per_s, workers (compile processes), timing_processes, cores, and the timing processes' ms
    a measurement loading and measuring (load_ms, measure_ms; None where nothing was measured)."""
    rate, measured = SUMMARY_RATE.findall(output), SUMMARY_TRIALS.findall(output)
    if not rate or not measured:
        raise ValueError("no tuner summary in the output")
    seconds, per_s, workers, timing, cores = rate[-1]
    lane = SUMMARY_LANE.findall(output)
    load_ms, measure_ms = (int(v) for v in lane[-1]) if lane else (None, None)
    return {"trials": int(measured[-1]), "tuning_s": float(seconds), "trials_per_s": float(per_s),
            "workers": int(workers or 0), "timing_processes": int(timing), "cores": int(cores),
            "load_ms": load_ms, "measure_ms": measure_ms}


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the studies run or after (they stop on their own, with a summary)
        return console.interrupted()


def _main(argv) -> int:
    args = parse_args(argv)
    try:
        check_out(args.out)
        plan = build_plan(args)
        if args.compile_only:
            return compile_sweep.run(plan, args)
        if not plan.jobs:
            raise SearchError("nothing to tune: " + ("; ".join(plan.skipped) or "no jobs"))
        search = Search(plan, args, args.trials or DEFAULT_TRIALS)
        print(f"incumbents: {search.incumbents.note.removeprefix('configs: ')}")
        interrupted = search.run()
        print_summary(search, interrupted)
        if interrupted:
            return console.INTERRUPTED
        if search.outcomes and not search.outcomes["ok"]:
            raise SearchStopped(nothing_timed(search))
        return 0
    except (SearchStopped, WorkerStartError) as exc:  # the input was fine; the run cannot go on
        console.error(exc)
        return 1
    except (TargetError, BackendError, StoreError, SearchError, ValueError) as exc:
        console.error(exc)
        return 2
    except STORAGE_ERRORS as exc:  # the storage failed while the search ran
        console.error(f"--storage {shown_url(args.storage)}: {storage_problem(exc)}")
        return 2
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        console.error(f"{where}{exc.strerror or exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
