"""Tune the kernel twins' configs with Optuna: `python -m autotune.search --help`.

Every trial runs in a worker subprocess (autotune.worker): compile, check
against the float64 reference on fresh random inputs, time (on a GPU, ten calls
replayed as one CUDA graph, kernels_core.timing.bench_in_graph: the kernel's own
time with inputs warm in L2, as inside a graphed training step; per call with
L2 flushed, kernels_core.timing.bench, for an op that cannot be captured or on the
CPU). Results go to <out>/<target>/trials.csv (a row per
trial, flushed as it ends), the Optuna storage (committed per trial), and
<out>/<target>/best.json (the winners, rewritten atomically after each study; an entry
already there is replaced only by a winner that beats its config in the same run).
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
    import fcntl
    import math
    import re
    import threading
    from collections import Counter
    from pathlib import Path

    import optuna
    import sqlalchemy.exc
    from optuna.trial import TrialState
    from sqlalchemy.engine import make_url
    from tqdm import tqdm

    from autotune import compile_sweep, studies
    from kernels_core.backends import BackendError
    from autotune.plan import Job, Plan, build_plan
    from kernels_core.provenance import COLUMNS as PROVENANCE, provenance, utc_now
    from kernels_core.store import ConfigStore, StoreError, load_store, save_store, store_path
    from autotune.studies import SAMPLERS, SearchError, SearchStopped, StudyRunner
    from kernels_core.targets import TARGETS, TargetError
    from autotune.trials_csv import TrialsCsv, columns
    from autotune.evaluate import Evaluator
    from autotune.worker_pool import WorkerStartError
    from autotune.workload import metric, throughput
    from kernels_core.mlp import DEFAULT
    from kernels_core.cli import OneLineParser, whole_number
    from kernels_core.contract import DTYPES, MAX_DIM
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
WORKER_FAILURES = ("launch_error", "timeout")
# Flags a --compile-only run has no use for (a config's compile does not depend on the shape,
# and it keeps no Optuna study), with the default each takes otherwise.
SEARCH_ONLY = {"workload": "mnist-mlp", "hidden": (DEFAULT.hidden,), "layers": DEFAULT.layers,
               "batch_size": DEFAULT.batch_size, "shapes": None, "momentum": DEFAULT.momentum,
               "sampler": studies.DEFAULT_SAMPLER,
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
# Each worker is a process with torch loaded; a GPU times one at a time, so more than a few per
# GPU only wait for their turn.
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
    p.add_argument("--ops", default="all", help="comma-separated ops, or all (default)")
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
    p.add_argument("--workers", type=whole_number(1, MAX_WORKERS), help="worker processes (default: one per visible "
                   "GPU; 1 on cpu; compile-only: up to 8); several per GPU overlap compiles, timing stays one at a "
                   "time per GPU")
    p.add_argument("--max-failures-in-a-row", type=whole_number(1), default=MAX_FAILURES_IN_A_ROW,
                   help="a worker whose trials end this many times in a row with it crashed, hung or unable to "
                        "launch (a lost GPU) gets no more; the search stops when none is left "
                        f"(default {MAX_FAILURES_IN_A_ROW})")
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
    args.storage = args.storage or f"sqlite:///{args.out / 'tuning.db'}"  # one --out root holds every output
    return args


def _in_memory(url: str) -> bool:
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # opening it says what is wrong
        return False
    return parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:")


# What a storage that is unreachable, corrupt or not a database raises while the search runs.
STORAGE_ERRORS = (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError)


def shown_url(url: str) -> str:
    """The storage URL with its password hidden, for messages and the summary."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        # Not parseable, yet it may still hold user:password@host: hide what lies between the user
        # part's first ':' and the last '@'.
        return re.sub(r"^([^:/@]*://)?([^:/@]*):.*@", r"\1\2:***@", url)


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The Optuna storage at `url`, or a SearchError that says what is wrong with --storage."""
    try:
        return studies.open_storage(url)
    except (*STORAGE_ERRORS, ImportError, RuntimeError, OSError, ValueError) as exc:
        # ImportError: no driver for the URL; RuntimeError: a schema of another Optuna version
        raise SearchError(f"--storage {shown_url(url)}: cannot open it: {storage_problem(exc)}") from None


def storage_problem(exc: BaseException) -> str:
    """What went wrong, in one line: SQLAlchemy adds the SQL and a link on further lines, and
    Optuna's wrappers keep what failed in their cause."""
    cause = exc.__cause__
    if isinstance(exc, optuna.exceptions.StorageInternalError) and cause is not None:
        return storage_problem(cause)
    first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return f"{first} ({cause})" if isinstance(exc, ImportError) and cause is not None else first


def check_out(out: Path) -> None:
    """Refuse an --out that is, or lies under, something other than a directory."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise SearchError(f"--out {out}: {path} is a file, not a directory")
            return


def _fmt_config(config: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items()) if config else "-"


class Search:
    def __init__(self, plan: Plan, args: argparse.Namespace):
        self.plan, self.args, self.target = plan, args, plan.target
        self.budget = args.trials or DEFAULT_TRIALS
        self.out_dir = args.out / self.target.name
        self.csv = TrialsCsv(self.out_dir / "trials.csv", columns(plan.tunables()))
        self.best_path = store_path(args.out, self.target.name)
        if self.best_path.exists():
            load_store(self.best_path, self.target)  # refuse to build on a broken file
        self.storage = open_storage(args.storage)
        self.lock = threading.Lock()
        self.heartbeat = studies.Heartbeat(self.storage)
        self.pool = Evaluator(self.target.name, args.workers, args.timeout, args.out / "logs" / self.target.name)
        self.prov = provenance()
        self.stop = threading.Event()
        self.crashed: list[BaseException] = []  # what ended a worker thread other than its work running out
        self.failures_in_a_row = [0] * len(self.pool)  # per worker, across studies
        self.retired: dict[int, str] = {}  # workers given no more trials, and why
        self.summary: list[dict] = []
        self.outcomes: Counter = Counter()  # this run's measured trials by status
        self.bar = None

    def make_row(self, job: Job, name: str, baselines: dict, config: dict, result: dict, number: int) -> dict:
        call, t = job.call, result.get("time_ms")
        kind = metric(call.op)
        value = throughput(call.op, call.shape, call.dtype, t, call.momentum) if t else None
        peak = self.target.peak(kind, call.dtype)
        default_ms, torch_ms = baselines.get("default_ms"), baselines.get("torch_ms")
        row = {
            **{k: self.prov.get(k) for k in PROVENANCE}, "utc": utc_now(), "target": self.target.name,
            "op": call.op, "backend": job.backend, "dtype": call.dtype, "shape": call.key, **config,
            "status": result["status"], "error": result.get("error"),
            "time_ms": t, "time_p20_ms": result.get("time_p20_ms"), "time_p80_ms": result.get("time_p80_ms"),
            "metric": kind, kind: value, "pct_of_peak": 100.0 * value / peak if value and peak else None,
            "speedup_vs_default": default_ms / t if t and default_ms else None,
            "speedup_vs_torch": torch_ms / t if t and torch_ms else None,
            "default_ms": default_ms, "torch_ms": torch_ms,
            **{k: result.get(k) for k in ("compile_s", "registers", "smem_bytes", "spill_bytes", "rel_err")},
            "trial": number, "study": name, "sampler": self.args.sampler, "gpu": result.get("gpu"),
        }
        return row

    def record(self, row: dict) -> None:
        self.csv.append(row)
        if row["status"] != "invalid":
            self.outcomes[row["status"]] += 1
            self.bar.update(1)

    # -- one study -------------------------------------------------------------------
    def open(self, job: Job):
        call, elt = job.call, DTYPES[job.call.dtype].itemsize
        key = studies.study_name("", self.target.name, call.op, job.backend, call.dtype, call.study_key)
        name = self.args.study_prefix + key
        view = studies.view_space(job.space, self.target, elt)
        sampler = studies.make_sampler(self.args.sampler, self.args.seed, view.values,
                                       parallel=len(self.pool) > 1, valid=view.valid)
        with self.lock:
            study = optuna.create_study(study_name=name, storage=self.storage, sampler=sampler,
                                        direction="minimize", load_if_exists=True)
            if not study.get_trials(deepcopy=False) and any(s == name for s, _ in self.csv.keys()):
                # The CSV's rows of this study came from a storage this run does not have: its
                # trial numbers would start over beside them, and the study be measured twice.
                raise SearchError(
                    f"{self.csv.path} holds rows of study {name} that --storage {shown_url(self.args.storage)} "
                    "lacks: pass the storage those trials came from, or another --out or --study-prefix")
            studies.reap_dead(study)
            self._copy_missing_rows(study, name)
            known = studies.measured_elsewhere(self.storage, name, key)
        baselines: dict = {}
        check = lambda config: self.target.target_violation(job.space, config, elt)
        runner = StudyRunner(study, view, self.budget, check,
                             make_row=lambda config, result, number: self.make_row(
                                 job, name, baselines, config, result, number),
                             record=self.record, ordinal=self.args.sampler in studies.ORDINAL_SAMPLERS,
                             lock=self.lock, heartbeat=self.heartbeat, known=known)
        return name, view, study, runner, baselines

    def _copy_missing_rows(self, study: optuna.Study, name: str) -> None:
        """Rows the study has but the CSV lacks, of trials whose process on this host died
        between the two writes. Read now: another process may share this CSV, and a live
        one writes its own rows (as other machines write theirs, to their own CSVs)."""
        have = self.csv.keys()
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if ((studies.counts_toward_budget(t) or t.user_attrs.get("status") == "invalid")
                    and (name, str(t.number)) not in have and studies.owner_dead(t.user_attrs.get("owner"))):
                self.csv.append(t.user_attrs["row"])

    def baselines(self, job: Job, study: optuna.Study) -> dict:
        """The default config's time, torch's, and the incumbent's: the config best.json already
        holds for this call (a valid one the study has not measured; the default's time when it is
        the default), which the study's winner must beat in this run to replace (_write_best). A
        re-tune after a kernel change, or with another seed or storage, draws other configs; its
        best of a budget can be slower than the entry it would overwrite, and times recorded in
        another run do not compare (experiments/FINDINGS.md, "Tuner budget and the study's winner"). A study resumed with a
        larger budget has its own earlier winner among its trials, and judges it by its trial like
        every other config."""
        call, elt = job.call, DTYPES[job.call.dtype].itemsize
        out = {}
        config = job.space.default_for(self.target.arch)
        problem = self.target.target_violation(job.space, config, elt)
        first = self.live()[0]
        default = {"status": "invalid", "error": problem} if problem else self.pool.evaluate(
            first, call, job.backend, config, self.args.seed)
        torch_ = self.pool.evaluate(first, call, "torch", None, self.args.seed)
        measured = [("default", default), ("torch", torch_)]
        incumbent = self._incumbent(job)
        with self.lock:
            tried = [t.user_attrs.get("config") for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        if incumbent is not None and incumbent not in tried:
            out["incumbent"] = incumbent
            same = not problem and incumbent == job.space.resolve(config, elt, self.target.arch)
            measured.append(("incumbent", default if same else self.pool.evaluate(
                first, call, job.backend, incumbent, self.args.seed)))
        for label, result in measured:
            if result.get("status") == "ok":
                out[f"{label}_ms"] = result["time_ms"]
            else:
                out[f"{label}_problem"] = f"{result.get('status')}: {result.get('error')}"
        return out

    def _incumbent(self, job: Job) -> dict | None:
        """best.json's config for this call, resolved, if the space and the target still take it."""
        if not self.best_path.exists():
            return None
        entry = load_store(self.best_path, self.target).entries.get(
            (job.call.op, job.backend, job.call.dtype, job.call.key))
        if entry is None:
            return None
        elt = DTYPES[job.call.dtype].itemsize
        try:
            config = job.space.resolve(entry["config"], elt, self.target.arch)
        except ValueError:
            return None
        return None if self.target.target_violation(job.space, config, elt) else config

    def run_study(self, job: Job, opened) -> None:
        name, view, study, runner, baselines = opened
        start_measured = runner.measured()
        left = runner.left()
        if left:
            self.bar.set_description(f"{job.call.op}:{job.backend}:{job.call.dtype}:{job.call.key}")
            baselines.update(self.baselines(job, study))
            with self.lock:
                study.set_user_attr("baselines", baselines)
            threads = [threading.Thread(target=self._work, args=(runner, job, i), daemon=True)
                       for i in self.live()]
            for t in threads:
                t.start()
            try:
                for t in threads:
                    while t.is_alive():
                        t.join(0.5)
                if self.crashed:
                    raise self.crashed[0]  # the search stops: a bug, or a study it cannot go on with
            except KeyboardInterrupt:
                self.stop.set()
                self.pool.interrupt()  # unblocks the threads, which drop their trials
                for t in threads:
                    t.join(30)
                raise
        else:
            baselines.update(study.user_attrs.get("baselines", {}))
        done_now = runner.measured() - start_measured
        self.bar.total -= max(0, left - done_now)
        self.bar.refresh()
        self._write_best(job, name, study, runner)

    def live(self) -> list[int]:
        """The workers still given trials; a SearchStopped when none is."""
        live = [i for i in range(len(self.pool)) if i not in self.retired]
        if not live:
            raise SearchStopped("no worker left to run trials: " + "; ".join(self.retired.values())
                                + ". The trials so far are saved: once the GPU works again, the same command resumes")
        return live

    def _count_failure(self, index: int, result: dict) -> bool:
        """Counts a trial's outcome against its worker; True when the worker is to be set aside."""
        if result.get("status") not in WORKER_FAILURES:
            self.failures_in_a_row[index] = 0
            return False
        self.failures_in_a_row[index] += 1
        n = self.failures_in_a_row[index]
        if n < self.args.max_failures_in_a_row:
            return False
        gpu = self.pool.workers[index][1]
        why = (f"worker {index}{f' (GPU {gpu})' if gpu is not None else ''}: {n} trials in a row ended "
               f"{result['status']} (the last: {str(result.get('error'))[:200]})")
        with self.lock:
            self.retired[index] = why
        tqdm.write(f"{console.PREFIX}: {why}; it gets no more trials", file=sys.stderr)
        return True

    def _work(self, runner: StudyRunner, job: Job, index: int) -> None:
        try:
            self._work_loop(runner, job, index)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.crashed.append(exc)
            self.stop.set()

    def _work_loop(self, runner: StudyRunner, job: Job, index: int) -> None:
        while not self.stop.is_set():
            candidate = runner.next_candidate(self.stop)
            if candidate is None:
                return
            if self.stop.is_set():
                runner.abandon(candidate)
                return
            try:
                result = self.pool.evaluate(index, job.call, job.backend, candidate.config,
                                            self.args.seed * 1_000_003 + candidate.trial.number + 1)
            except BaseException:
                runner.abandon(candidate)  # no outcome: the slot goes back to the budget
                raise
            if self.stop.is_set():
                runner.abandon(candidate)
                return
            runner.complete(candidate, result)
            if self._count_failure(index, result):
                self.live()  # raises when no worker is left: the study cannot go on
                return

    def _write_best(self, job: Job, name: str, study: optuna.Study, runner: StudyRunner) -> None:
        with self.lock:
            best = studies.best_trial(study)
            counts = studies.outcome_counts(study)
            measured = sum(v for k, v in counts.items() if k != "invalid")
        failures = {k: v for k, v in counts.items() if v and k not in ("ok", "invalid")}
        baselines = study.user_attrs.get("baselines", {})
        summary = {"op": job.call.op, "backend": job.backend, "dtype": job.call.dtype, "shape": job.call.key,
                   "best config": "-", "time_ms": None, "vs default": None, "vs torch": None,
                   "trials": measured, "failures": ", ".join(f"{k}:{v}" for k, v in failures.items()) or "-",
                   "invalid": counts["invalid"], "note": (runner.ended or baselines.get("default_problem", ""))[:80]}
        kept = best is not None and baselines.get("incumbent_ms") is not None \
            and baselines["incumbent_ms"] <= best.user_attrs["row"]["time_ms"]
        if kept:
            t, default_ms, torch_ms = baselines["incumbent_ms"], baselines.get("default_ms"), baselines.get("torch_ms")
            summary.update({"best config": _fmt_config(baselines["incumbent"]), "time_ms": t,
                            "vs default": default_ms / t if default_ms else None,
                            "vs torch": torch_ms / t if torch_ms else None,
                            "note": f"best.json's entry kept: the study's best took {best.user_attrs['row']['time_ms']:.4g} ms"})
        if best is not None and not kept:
            row = best.user_attrs["row"]
            entry = {"op": job.call.op, "backend": job.backend, "dtype": job.call.dtype, "shape": job.call.key,
                     "config": best.user_attrs["config"], "trials": measured, "failures": failures,
                     # Where the measurement was made: a copy's row is its source's (another
                     # --study-prefix's study, say), and names that study and trial.
                     "study": row.get("study", name), "trial": row.get("trial", best.number),
                     "provenance": {k: row.get(k) for k in PROVENANCE}}
            for key in ("time_ms", "time_p20_ms", "time_p80_ms", "default_ms", "torch_ms",
                        "speedup_vs_default", "speedup_vs_torch"):
                entry[key] = row.get(key)
            self._save_entry(entry)
            summary.update({"best config": _fmt_config(entry["config"]), "time_ms": row["time_ms"],
                            "vs default": row.get("speedup_vs_default"), "vs torch": row.get("speedup_vs_torch")})
        self.summary.append(summary)

    def _save_entry(self, entry: dict) -> None:
        self.best_path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.args.out / "logs" / self.target.name / "best.json.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another search on this machine may write it too
            store = load_store(self.best_path, self.target) if self.best_path.exists() else ConfigStore(self.target.name)
            store.put(entry)
            save_store(self.best_path, store)

    # -- the whole run ---------------------------------------------------------------
    def run(self) -> int:
        opened = [(job, self.open(job)) for job in self.plan.jobs]
        total = 0
        for _, (_, _, _, runner, _) in opened:
            total += runner.left()
        interrupted = False
        self.bar = console.bar(total=total, unit="trial")
        try:
            for job, o in opened:
                self.run_study(job, o)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self.bar.close()
            self.pool.close()
            self.heartbeat.stop()
            self.csv.close()
        self.print_summary(opened, interrupted)
        if interrupted:
            return console.INTERRUPTED
        if self.outcomes and not self.outcomes["ok"]:
            raise SearchStopped(self.nothing_timed())
        return 0

    def nothing_timed(self) -> str:
        """Why a run whose every trial failed measured nothing, and what to change."""
        n = sum(self.outcomes.values())
        if set(self.outcomes) == {"timeout"}:
            return (f"every one of the {n} trials of this run timed out (--timeout {self.args.timeout:g} s, for "
                    "each compile and for each check with its timing): no config was timed; pass a larger --timeout "
                    "(default 180)")
        failures = ", ".join(f"{k}:{v}" for k, v in sorted(self.outcomes.items()))
        return (f"none of the {n} trials of this run ran correctly ({failures}): no config was timed; each one's "
                f"error is in {self.csv.path}")

    def print_summary(self, opened, interrupted: bool) -> None:
        import pandas as pd

        print()
        if self.summary:
            table = pd.DataFrame(self.summary)
            for col in ("vs default", "vs torch"):
                table[col] = table[col].map(lambda v: f"{v:.3g}x" if v == v and v is not None else "-")
            if self.target.name == "cpu":  # an interpreter against native code: no measure of the kernel
                table = table.drop(columns="vs torch")
            table["time_ms"] = table["time_ms"].map(lambda v: f"{v:.4g}" if v == v and v is not None else "-")
            print(table.to_string(index=False))
            if self.target.name == "cpu":
                print("(no 'vs torch' on the cpu target: the Triton kernels run in its Python interpreter, "
                      "torch natively)")
        invalid_now = sum(o[3].invalid for _, o in opened)
        reused_now = sum(o[3].reused for _, o in opened)
        done = len(self.summary)
        finished = f"{done} of {len(opened)} studies finished" if interrupted else f"{done} studies"
        print(f"\n{finished} on {self.target.name} ({self.args.sampler}, budget {self.budget} "
              f"measured configs each). This run: {sum(self.outcomes.values())} trials measured, {reused_now} "
              f"suggestions of configs measured before told their results at no cost, {invalid_now} suggestions "
              f"pruned as invalid before compiling ({sum(s['invalid'] for s in self.summary)} in the finished studies).")
        for line in self.plan.skipped:
            print(f"skipped {line}")
        for why in self.retired.values():
            print(f"set aside: {why}")
        if interrupted:
            print("interrupted: trials in flight were dropped; re-run the same command to resume.")
        # Only files there are: an interrupted first run has no winner yet.
        best = self.best_path if self.best_path.exists() else "none yet: no study has finished with a config that ran"
        print(f"trials: {self.csv.path}\nbest:   {best}\nstudies: {shown_url(self.args.storage)}")


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
        return Search(plan, args).run()
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
