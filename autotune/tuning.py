"""A search over a plan's studies: worker threads measure each study's trials, the study's
winner is judged against the default config, torch and the incumbent (best.json's entry, else
the one shipped for this GPU), and kept winners are merged into best.json after each study.
"""
from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from pathlib import Path

import optuna
from optuna.trial import TrialState
from tqdm import tqdm

from autotune import console
from autotune.errors import SearchError, SearchStopped
from autotune.evaluate import Evaluator
from autotune.plan import Job, Plan
from autotune.samplers import ORDINAL_SAMPLERS, make_sampler, view_space
from autotune.storage import (Heartbeat, counts_toward_budget, measured_elsewhere, open_storage, owner_dead,
                              reap_dead, shown_url)
from autotune.studies import StudyRunner, best_trial, outcome_counts, study_name
from autotune.trials_csv import TrialsCsv, columns
from autotune.workload import metric, throughput
from kernels_core.contract import DTYPES
from kernels_core.provenance import COLUMNS as PROVENANCE, provenance, utc_now
from kernels_core.store import choose_store, load_store, merge_into_store, store_path
from kernels_core.targets import local_gpu

# A worker's crash, hang or failure to launch: counted against the worker, in a row
# (--max-failures-in-a-row), since a lost GPU fails every config the same way.
WORKER_FAILURES = ("launch_error", "timeout")


def _fmt_config(config: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items()) if config else "-"


class Search:
    def __init__(self, plan: Plan, args: argparse.Namespace, budget: int):
        self.plan, self.args, self.target = plan, args, plan.target
        self.budget = budget
        self.out_dir = args.out / self.target.name
        self.csv = TrialsCsv(self.out_dir / "trials.csv", columns(plan.tunables()))
        self.best_path = store_path(args.out, self.target.name)
        local = local_gpu()
        # The configs each winner must beat: best.json's, else those shipped for this GPU.
        self.incumbents = choose_store(args.out, self.target.name, local[1] if local else None)
        if self.incumbents.path is not None:
            load_store(self.incumbents.path, self.target)  # refuse to build on a broken file
        self.storage = open_storage(args.storage)
        self.lock = threading.Lock()
        self.heartbeat = Heartbeat(self.storage)
        self.pool = Evaluator(self.target.name, args.workers, args.timeout, args.out / "logs" / self.target.name)
        self.prov = provenance()
        self.stop = threading.Event()
        self.crashed: list[BaseException] = []  # what ended a worker thread other than its work running out
        self.failures_in_a_row = [0] * len(self.pool)  # per worker, across studies
        self.retired: dict[int, str] = {}  # workers given no more trials, and why
        self.opened: list[tuple[Job, tuple]] = []  # each job of the plan with what open() made for it
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
        key = study_name("", self.target.name, call.op, job.backend, call.dtype, call.study_key)
        name = self.args.study_prefix + key
        view = view_space(job.space, self.target, elt)
        sampler = make_sampler(self.args.sampler, self.args.seed, view.values,
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
            reap_dead(study)
            self._copy_missing_rows(study, name)
            known = measured_elsewhere(self.storage, name, key)
        baselines: dict = {}
        check = lambda config: self.target.target_violation(job.space, config, elt)
        runner = StudyRunner(study, view, self.budget, check,
                             make_row=lambda config, result, number: self.make_row(
                                 job, name, baselines, config, result, number),
                             record=self.record, ordinal=self.args.sampler in ORDINAL_SAMPLERS,
                             lock=self.lock, heartbeat=self.heartbeat, known=known)
        return name, view, study, runner, baselines

    def _copy_missing_rows(self, study: optuna.Study, name: str) -> None:
        """Rows the study has but the CSV lacks, of trials whose process on this host died
        between the two writes. Read now: another process may share this CSV, and a live
        one writes its own rows (as other machines write theirs, to their own CSVs)."""
        have = self.csv.keys()
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if ((counts_toward_budget(t) or t.user_attrs.get("status") == "invalid")
                    and (name, str(t.number)) not in have and owner_dead(t.user_attrs.get("owner"))):
                self.csv.append(t.user_attrs["row"])

    def baselines(self, job: Job, study: optuna.Study) -> dict:
        """The default config's time, torch's, and the incumbent's: the config best.json (else the
        store shipped for this GPU) already holds for this call (a valid one the study has not measured; the default's time when it is
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
        """The incumbent store's config for this call (best.json's, else the one shipped for this
        GPU), resolved, if the space and the target still take it."""
        if self.incumbents.path is None:
            return None
        entry = load_store(self.incumbents.path, self.target).entries.get(
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
            best = best_trial(study)
            counts = outcome_counts(study)
            measured = sum(v for k, v in counts.items() if k != "invalid")
        failures = {k: v for k, v in counts.items() if v and k not in ("ok", "invalid")}
        baselines = study.user_attrs.get("baselines", {})
        summary = {"op": job.call.op, "backend": job.backend, "dtype": job.call.dtype, "shape": job.call.key,
                   "best config": "-", "time_ms": None, "vs default": None, "vs torch": None,
                   "trials": measured, "failures": ", ".join(f"{k}:{v}" for k, v in failures.items()) or "-",
                   "invalid": counts["invalid"], "note": (runner.ended or baselines.get("default_problem", ""))[:80]}
        key = (job.call.op, job.backend, job.call.dtype, job.call.key)
        # What every entry this study writes says of its call and its study.
        base = {"op": job.call.op, "backend": job.backend, "dtype": job.call.dtype, "shape": job.call.key,
                "trials": measured, "failures": failures}
        kept = best is not None and baselines.get("incumbent_ms") is not None \
            and baselines["incumbent_ms"] <= best.user_attrs["row"]["time_ms"]
        if best is not None:
            winner_ms = baselines["incumbent_ms"] if kept else best.user_attrs["row"]["time_ms"]
            winner = baselines["incumbent"] if kept else best.user_attrs["config"]
        default_ms, default = baselines.get("default_ms"), job.space.default_for(self.target.arch)
        # An entry slower than the default config would make its callers slower than the default: the
        # default config, timed in this run, is the entry then (a winner that is the default config,
        # timed as a trial, stands as it is: two timings of it differ by noise).
        lost = best is not None and default_ms is not None and winner_ms > default_ms \
            and {**default, **winner} != default
        if lost:
            beaten = f"{self._incumbent_name()} entry" if kept else "the study's best"
            torch_ms = baselines.get("torch_ms")
            row = best.user_attrs["row"]
            entry = {**base, "config": default, "study": name,
                     "provenance": {k: row.get(k) for k in PROVENANCE}, "time_ms": default_ms,
                     "default_ms": default_ms, "torch_ms": torch_ms, "speedup_vs_default": 1.0,
                     "speedup_vs_torch": torch_ms / default_ms if torch_ms else None}
            merge_into_store(self.best_path, self.target, [entry], lock=self._lock_path())
            summary.update({"best config": _fmt_config(default), "time_ms": default_ms, "vs default": 1.0,
                            "vs torch": entry["speedup_vs_torch"],
                            "note": f"the default config ({default_ms:.4g} ms) beat {beaten} ({winner_ms:.4g} ms)"})
        elif kept:
            t, torch_ms = baselines["incumbent_ms"], baselines.get("torch_ms")
            summary.update({"best config": _fmt_config(baselines["incumbent"]), "time_ms": t,
                            "vs default": default_ms / t if default_ms else None,
                            "vs torch": torch_ms / t if torch_ms else None,
                            "note": f"{self._incumbent_name()} entry kept: the study's best took "
                                    f"{best.user_attrs['row']['time_ms']:.4g} ms"})
            if self.incumbents.kind == "shipped":  # best.json, once written, replaces the shipped store whole
                shipped = load_store(self.incumbents.path, self.target).entries[key]
                merge_into_store(self.best_path, self.target, [shipped], lock=self._lock_path())
        elif best is not None:
            row = best.user_attrs["row"]
            entry = {**base, "config": best.user_attrs["config"],
                     # Where the measurement was made: a copy's row is its source's (another
                     # --study-prefix's study, say), and names that study and trial.
                     "study": row.get("study", name), "trial": row.get("trial", best.number),
                     "provenance": {k: row.get(k) for k in PROVENANCE}}
            for k in ("time_ms", "time_p20_ms", "time_p80_ms", "default_ms", "torch_ms",
                      "speedup_vs_default", "speedup_vs_torch"):
                entry[k] = row.get(k)
            merge_into_store(self.best_path, self.target, [entry], lock=self._lock_path())
            summary.update({"best config": _fmt_config(entry["config"]), "time_ms": row["time_ms"],
                            "vs default": row.get("speedup_vs_default"), "vs torch": row.get("speedup_vs_torch")})
        self.summary.append(summary)

    def _incumbent_name(self) -> str:
        return "the shipped store's" if self.incumbents.kind == "shipped" else "best.json's"

    def _lock_path(self) -> Path:
        return self.args.out / "logs" / self.target.name / "best.json.lock"

    # -- the whole run ---------------------------------------------------------------
    def run(self) -> bool:
        """Every study of the plan in turn; True when a Ctrl-C ended them (its trials in flight dropped)."""
        self.opened = [(job, self.open(job)) for job in self.plan.jobs]
        total = 0
        for _, (_, _, _, runner, _) in self.opened:
            total += runner.left()
        interrupted = False
        self.bar = console.bar(total=total, unit="trial")
        try:
            for job, o in self.opened:
                self.run_study(job, o)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self.bar.close()
            self.pool.close()
            self.heartbeat.stop()
            self.csv.close()
        return interrupted

