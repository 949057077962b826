"""A search over a plan's studies, as a pipeline: compile processes ask each study for configs
(autotune.asking: its sampler and claims, through the shared storage) and compile them; one
timing process per GPU checks and times them, one at a time. Each study's winner is judged
against the default config, torch and the incumbent (best.json's entry, else the one shipped
for this GPU), measured in the same run, and kept winners are merged into best.json as each
study finishes.

Why a pipeline: a trial's cost is mostly its compile (NVRTC or Triton, one thread each), and a
GPU times one config at a time. So the compiles run on the host's cores at once, ahead of the
timing, and a study whose budget is all handed out lets the next study's configs (its baselines
first) start compiling. A measurement shares its GPU with no other measurement and with none of
the kernels the compiles build (kernels_core.compile_only; a compile process's own small torch
work, its inputs' random fill and a wrapper's allocations, still runs on its GPU). A study's
trials are timed after its baselines, so every timed row carries the default's and torch's
times; the torch baseline of a call is timed once for all the backends' studies of it. A thread
of its own tells the studies the outcomes, so a GPU does not wait for the storage. How far ahead
the compiles run is bounded (AHEAD_PER_GPU), and so are a study's configs in flight
(IN_FLIGHT_PER_STUDY): a config asked for later is drawn by a sampler that knows more results,
and an ask reads back fewer running trials. This process keeps the rest: which study is asked
next, the baselines, the queue, the tells, the CSV and best.json.

With --workers 0 there is no compile pool: each timing process compiles its trials itself, and
this process asks the studies, the serial baseline of the pipeline.
"""
from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState
from tqdm import tqdm

from autotune import console
from autotune.asking import StudySpec, runner_parts
from autotune.errors import SearchError, SearchStopped
from autotune.evaluate import WORKER_FAILURES, CompilePool, Evaluator, close_pools, default_compilers
from autotune.plan import Job, Plan
from autotune.samplers import ORDINAL_SAMPLERS
from autotune.storage import (OWNER, Heartbeat, counts_toward_budget, measured_elsewhere, open_storage,
                              owner_dead, reap_dead, shown_url)
from autotune.studies import (LOWER_PRECISION_SUFFIX, WAIT, WAIT_S, Candidate, StudyRunner, best_trial, outcome_counts,
                              study_name)
from autotune.trials_csv import TrialsCsv, columns
from autotune.workload import metric, throughput
from kernels_core.contract import DTYPES
from kernels_core.mlp import Call
from kernels_core.provenance import COLUMNS as PROVENANCE, provenance, utc_now
from kernels_core.store import choose_store, load_store, merge_into_store, store_path
from kernels_core.targets import local_gpu

# Compiled configs waiting for each timing process, at most: enough that a GPU never waits for a
# compile while configs are being compiled, few enough that a study's sampler is asked late.
AHEAD_PER_GPU = 4
# Configs of one study handed out and not yet told, at most: the compile processes then work on
# several studies at once. Each ask reads back every trial of its study still running (Optuna
# caches only finished ones), so a study with a whole pool's worth in flight made each ask cost
# more: at 50 a study the search process spent 70 ms of CPU a trial, 43-45 with this bound
# (experiments/FINDINGS.md, "Tuner pipeline: compile pool and timing process").
IN_FLIGHT_PER_STUDY = 6
# The default compile pool: the host's cores but one per timing process and one for the search,
# at most this many (each holds torch, a CUDA context and its compiler's memory).
DEFAULT_MAX_COMPILERS = 16



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
        # Loaded once (refusing a broken file before any work): a study writes only its own call's
        # entry, so what the later studies of the run find there is what the run started with.
        self.incumbent_entries = {} if self.incumbents.path is None else \
            load_store(self.incumbents.path, self.target).entries
        self.storage = open_storage(args.storage)
        self.lock = threading.Lock()
        self.heartbeat = Heartbeat(self.storage)
        logs = args.out / "logs" / self.target.name
        self.pool = Evaluator(self.target.name, None, args.timeout, logs)  # one timing process per GPU
        if args.workers is None:
            args.workers = default_compilers(self.target.name, DEFAULT_MAX_COMPILERS)
        self.compilers = CompilePool(self.target.name, args.workers, args.timeout, logs)
        self.prov = provenance()
        self.stop = threading.Event()
        self.crashed: list[BaseException] = []  # what ended a thread other than its work running out
        self.failures_in_a_row: Counter = Counter()  # per worker ("compile"|"timing", index), across studies
        self.retired: dict[tuple[str, int], str] = {}  # workers given no more trials, and why
        self.lanes: list[Lane] = []  # each study of the plan, in the plan's order
        self.cond = threading.Condition()  # guards the lanes' progress and the queue; never taken inside self.lock
        self.queue: list[Timing] = []  # measurements waiting for a GPU
        self.told: list[tuple[Lane, Candidate, dict]] = []  # trials timed, outcome not yet told to their study
        self.timing_loops = 0  # timing threads running
        self.closing = False  # the run is ending: the teller stops taking outcomes
        self.ahead = AHEAD_PER_GPU * len(self.pool)
        self.torch_times: dict[Call, dict | list] = {}  # the torch baseline of a call: its result, or the lanes awaiting it
        self.summary: list[dict] = []
        self.started = self.seconds = 0.0
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
            **{k: result.get(k) for k in ("compile_s", "registers", "smem_bytes", "spill_bytes", "rel_err",
                                          "default_rel_err")},
            "trial": number, "study": name, "sampler": self.args.sampler, "gpu": result.get("gpu"),
        }
        return row

    def record(self, row: dict) -> None:
        self.csv.append(row)
        if row["status"] != "invalid":
            self.outcomes[row["status"]] += 1
            self.bar.update(1)

    # -- one study -------------------------------------------------------------------
    def open(self, order: int, job: Job) -> Lane:
        """The job's study, created or resumed, as the pipeline's lane `order`."""
        call = job.call
        lower = bool(self.args.lower_precision and job.space.lower_precision)
        # Studies that may pick a lower precision are other studies: their configs and winners differ.
        key = study_name("", self.target.name, call.op, job.backend, call.dtype, call.study_key) + (
            LOWER_PRECISION_SUFFIX if lower else "")
        name = self.args.study_prefix + key
        spec = StudySpec(self.args.storage, name, key, self.target.name, job.backend, call.op, call.dtype, lower,
                         self.args.sampler, self.budget, self.args.sampler in ORDINAL_SAMPLERS,
                         parallel=len(self.pool) + len(self.compilers) > 1)
        view, sampler, check = runner_parts(spec, self.target, job.space, self.args.seed)
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
            known = measured_elsewhere(self.storage, name, key, job.space.with_defaults)
            tried = [job.space.with_defaults(t.user_attrs["config"]) for t in
                     study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "config" in t.user_attrs]
        baselines: dict = {}
        runner = StudyRunner(study, view, self.budget, check,
                             make_row=lambda config, result, number: self.make_row(
                                 job, name, baselines, config, result, number),
                             record=self.record, ordinal=spec.ordinal, lock=self.lock, heartbeat=self.heartbeat,
                             known=known)
        return Lane(order, job, name, study, runner, baselines, runner.left(), runner.measured(), tried, spec)

    def _copy_missing_rows(self, study: optuna.Study, name: str) -> None:
        """Rows the study has but the CSV lacks, of trials whose process on this host died
        between the two writes. Read now: another process may share this CSV, and a live
        one writes its own rows (as other machines write theirs, to their own CSVs)."""
        have = self.csv.keys()
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if ((counts_toward_budget(t) or t.user_attrs.get("status") == "invalid")
                    and (name, str(t.number)) not in have and owner_dead(t.user_attrs.get("owner"))):
                self.csv.append(t.user_attrs["row"])

    def _incumbent(self, job: Job) -> dict | None:
        """The incumbent store's config for this call (best.json's, else the one shipped for this
        GPU), resolved, if the space and the target still take it, and the study its precision: a
        lower-precision winner (--lower-precision) is no incumbent of a study at the dtype's own,
        which would judge it at its tolerance and could keep it."""
        entry = self.incumbent_entries.get((job.call.op, job.backend, job.call.dtype, job.call.key))
        if entry is None:
            return None
        elt = DTYPES[job.call.dtype].itemsize
        try:
            config = job.space.resolve(entry["config"], elt, self.target.arch)
        except ValueError:
            return None
        if job.space.precision_of(config) and not self.args.lower_precision:
            return None
        return None if self.target.target_violation(job.space, config, elt) else config

    # -- the pipeline -----------------------------------------------------------------
    def _activate(self, lane: Lane) -> None:
        """Lists the study's baselines (under self.cond): the default config's time, torch's, and the
        incumbent's: the config best.json (else the store shipped for this GPU) already holds for this
        call (a valid one the study has not measured; the default's time when it is the default),
        which the study's winner must beat in this run to replace (_write_best). A re-tune after a
        kernel change, or with another seed or storage, draws other configs; its best of a budget can
        be slower than the entry it would overwrite, and times recorded in another run do not compare
        (experiments/FINDINGS.md, "Tuner budget and the study's winner"). A study resumed with a larger
        budget has its own earlier winner among its trials, and judges it by its trial like every
        other config."""
        lane.activated = True
        job, elt = lane.job, DTYPES[lane.job.call.dtype].itemsize
        default = job.space.default_for(self.target.arch)
        problem = self.target.target_violation(job.space, default, elt)
        incumbent = self._incumbent(job)
        if incumbent is not None and incumbent not in lane.tried:
            lane.baselines["incumbent"] = incumbent
            if problem or incumbent != job.space.resolve(default, elt, self.target.arch):
                lane.to_build.append((("incumbent",), incumbent))
        if problem:
            lane.baselines["default_problem"] = f"invalid: {problem}"
        else:
            same = "incumbent" in lane.baselines and not lane.to_build
            lane.to_build.insert(0, (("default", "incumbent") if same else ("default",), default))
        lane.waiting = len(lane.to_build) + 1  # and torch's
        shared = self.torch_times.get(job.call)
        if isinstance(shared, dict):  # timed for another backend's study of the call
            self._deliver(lane, ("torch",), shared)
        elif shared is not None:
            shared.append(lane)
        else:
            self.torch_times[job.call] = [lane]
            self._enqueue(Timing(lane, "torch", None, self.args.seed, labels=("torch",)))

    def _deliver(self, lane: Lane, labels: tuple[str, ...], result: dict) -> None:
        """A baseline's outcome (under self.cond); the caller then calls _settle."""
        for label in labels:
            if result.get("status") == "ok":
                lane.baselines[f"{label}_ms"] = result["time_ms"]
            else:
                lane.baselines[f"{label}_problem"] = f"{result.get('status')}: {result.get('error')}"
        lane.waiting -= 1

    def _settle(self, lanes: list[Lane]) -> None:
        """For each lane whose baselines are all in: stores them with its study (a resumed run reads
        them), opens its trials to the timing processes, and writes its best if nothing else is left.
        Not under self.cond: the storage may keep self.lock a while."""
        ready = [lane for lane in lanes if lane.activated and not lane.waiting and not lane.baselines_stored]
        for lane in ready:
            with self.lock:
                lane.study.set_user_attr("baselines", lane.baselines)
        with self.cond:
            for lane in ready:
                lane.baselines_stored = True
            finished = [lane for lane in lanes if self._finished(lane)]
            self.cond.notify_all()
        for lane in finished:
            self._write_best(lane)

    def _enqueue(self, task: Timing) -> None:
        self.queue.append(task)
        self.cond.notify_all()

    def _pick(self):
        """What a compile process does next (under self.cond): ("baseline", lane, labels, config),
        ("settle", lane): store its baselines, ("poll", lane): ask its study for a config, ("wait",), or
        None: no study has configs left."""
        now, open_lanes = time.monotonic(), False
        for lane in self.lanes:
            if lane.finished or lane.asks_over:
                continue
            open_lanes = True
            if not lane.activated:
                self._activate(lane)
                if not lane.waiting:  # every baseline known already (torch's timed for another study)
                    return ("settle", lane)
            if lane.to_build:
                return ("baseline", lane, *lane.to_build.pop(0))
            if lane.saturated_until > now or lane.in_flight + lane.polling >= IN_FLIGHT_PER_STUDY:
                continue  # the rest of its budget, or as much of it as may be, is in flight: on to the next study
            if len(self.queue) >= self.ahead:
                return ("wait",)
            lane.polling += 1
            return ("poll", lane)
        return ("wait",) if open_lanes else None

    def _next_work(self, index: int | None, block: bool):
        """("baseline", lane, labels, config) or ("trial", lane, candidate) to compile on compile
        process `index` (None: the timing process); None when no study has configs left, or the
        search stops, or compile process `index` was set aside; ("wait",) when there is nothing yet
        and `block` is False."""
        while not self.stop.is_set() and ("compile", index) not in self.retired:
            with self.cond:
                pick = self._pick()
                if pick is None or pick[0] == "baseline":
                    return pick
                if pick[0] == "wait":
                    if not block:
                        return pick
                    self.cond.wait(WAIT_S)
                    continue
            lane = pick[1]
            if pick[0] == "settle":
                self._settle([lane])
                continue
            try:
                candidate = lane.runner.poll() if index is None else self._ask(index, lane)
            except BaseException:
                with self.cond:
                    lane.polling -= 1
                raise
            with self.cond:
                lane.polling -= 1
                if candidate is WAIT:
                    # While this run's own configs in flight cover what the study has left, it is
                    # asked again when they end (_release), not every WAIT_S: each answer of WAIT
                    # costs the storage's lock a read of the study and a search for dead processes.
                    # A WAIT that other processes' claims cause is looked at again on the clock.
                    lane.saturated_until = math.inf if self._all_left_in_flight(lane) else \
                        time.monotonic() + WAIT_S
                elif candidate is None:
                    lane.asks_over = True
                else:
                    lane.in_flight += 1
                    return ("trial", lane, candidate)
                # Whatever it heard, the last thread to stop asking may be the one to finish the study:
                # another may have heard that its configs ran out while this one was asking.
                finished = self._finished(lane)
            if finished:
                self._write_best(lane)
        return None

    def _ask(self, index: int, lane: Lane):
        """The lane's next config as its runner's poll gives it (a Candidate, WAIT or None), asked for
        by compile process `index` (autotune.asking), which then compiles it; the trial is this
        process's from then on. A compile process that crashes or hangs while asking is counted
        against it, and the study asked again later: a claim it left is reaped with it."""
        row = self.make_row(lane.job, lane.name, lane.baselines, {}, {"status": "invalid"}, None)
        # Each process's sampler draws its own start, and so does a process restarted after a hang:
        # with its predecessor's seed it would propose its predecessor's configs again.
        restarts = self.compilers.restarts(index)
        seed = (self.args.seed + 7919 * (index + 1) + 104729 * restarts) % 2**32
        answer = self.compilers.ask(index, lane.spec.to_json(), seed, row, OWNER)
        if "asked" not in answer:
            if answer.get("status") in WORKER_FAILURES:
                if self._count_failure(("compile", index), answer):
                    self._check_workers()
                return WAIT
            raise SearchError(answer.get("error"))
        runner = lane.runner
        with self.lock:
            for row in answer["rows"]:
                self.record(row)
            runner.invalid += answer["invalid"]
            runner.reused += answer["reused"]
            if answer["asked"] == "none":
                runner.ended = runner.ended or answer["ended"]
                return None
            if answer["asked"] == "wait":
                return WAIT
            trial = optuna.Trial(lane.study, answer["trial_id"])
            try:
                trial.set_user_attr("owner", OWNER)
            except UpdateFinishedTrialError:  # its compile process died and was reaped: the config went back
                return WAIT
            self.heartbeat.add(trial)
        return Candidate(trial, answer["config"])

    @staticmethod
    def _all_left_in_flight(lane: Lane) -> bool:
        """Every config the study has left is in flight in this run: asked, it can only answer WAIT."""
        return lane.in_flight > 0 and lane.in_flight >= lane.left - lane.counted

    def _finished(self, lane: Lane) -> bool:
        """True once, when the study has nothing left to ask, time or tell (under self.cond). Not
        while the search stops: a study cut short is judged by the run that finishes it."""
        if (lane.finished or self.stop.is_set() or not lane.asks_over or lane.polling or lane.in_flight
                or not lane.baselines_stored):
            return False
        lane.finished = True
        self.cond.notify_all()
        return True

    def _seed(self, candidate: Candidate) -> int:
        return self.args.seed * 1_000_003 + candidate.trial.number + 1

    def _produce(self, index: int | None, block: bool) -> str:
        """One config compiled on compile process `index` (None: left to the timing process) and queued
        for timing: "ok", "wait" (nothing to compile yet), or "done": no study has configs left, the
        search stops, or this compile process was set aside."""
        work = self._next_work(index, block)
        if work is None:
            return "done"
        if work[0] == "wait":
            return "wait"
        kind, lane, *rest = work
        call, backend = lane.job.call, lane.job.backend
        if kind == "baseline":
            labels, config = rest
            built = None if index is None else self.compilers.build(index, call, backend, config, self.args.seed)
            if self.stop.is_set():
                return "done"
            with self.cond:
                if built is None or built.get("ok"):
                    self._enqueue(Timing(lane, backend, config, self.args.seed, labels=labels, built=built))
                    return "ok"
                self._deliver(lane, labels, built)  # the config does not compile: that is its baseline
            self._settle([lane])
            return "ok"
        (candidate,) = rest
        seed = self._seed(candidate)
        if index is None:
            with self.cond:
                self._enqueue(Timing(lane, backend, candidate.config, seed, candidate=candidate))
            return "ok"
        try:
            built = self.compilers.build(index, call, backend, candidate.config, seed)
        except BaseException:
            self._drop(lane, candidate)  # no outcome: the slot goes back to the budget
            raise
        if self.stop.is_set():
            self._drop(lane, candidate)
            return "done"
        if built.get("ok"):
            self._count_failure(("compile", index), built)
            with self.cond:
                self._enqueue(Timing(lane, backend, candidate.config, seed, candidate=candidate, built=built))
            return "ok"
        self._tell(lane, candidate, built)  # a config that does not compile is a trial's outcome
        if self._count_failure(("compile", index), built):
            self._check_workers()
            return "done"
        return "ok"

    def _tell(self, lane: Lane, candidate: Candidate, result: dict) -> None:
        self._release(lane, counted=lane.runner.complete(candidate, result))

    def _drop(self, lane: Lane, candidate: Candidate) -> None:
        lane.runner.abandon(candidate)
        self._release(lane, counted=False)

    def _release(self, lane: Lane, counted: bool) -> None:
        """A candidate of the lane told, its outcome `counted` toward the budget or not (`invalid`,
        or failed meanwhile by another process), or given back (not counted)."""
        with self.cond:
            lane.in_flight -= 1
            lane.counted += counted
            # Asked now, a study whose every config left is in flight here would answer WAIT: it is
            # asked again when the last of them ends (other processes only ever leave it less to do).
            # One that did not count leaves a slot free, and the study is asked at once.
            if not self._all_left_in_flight(lane):
                lane.saturated_until = 0.0
            finished = self._finished(lane)
            self.cond.notify_all()
        if finished:
            self._write_best(lane)

    def _pop(self) -> Timing | None:
        """The next measurement for a GPU (under self.cond): studies in the plan's order, a study's
        baselines before its trials, which wait until every baseline of their study is in."""
        ready = [t for t in self.queue if t.labels or t.lane.baselines_stored]
        if not ready:
            return None
        task = min(ready, key=lambda t: (t.lane.order, not t.labels))
        self.queue.remove(task)
        self.cond.notify_all()  # a slot ahead is free
        return task

    def _compile_loop(self, index: int) -> None:
        while not self.stop.is_set() and ("compile", index) not in self.retired:
            if self._produce(index, block=True) == "done":
                return

    def _time_loop(self, index: int) -> None:
        try:
            self._time_tasks(index)
        finally:
            with self.cond:
                self.timing_loops -= 1
                self.cond.notify_all()

    def _time_tasks(self, index: int) -> None:
        compiling_here = not len(self.compilers)
        while not self.stop.is_set() and ("timing", index) not in self.retired:
            with self.cond:
                task = self._pop()
                if task is None:
                    if all(lane.finished for lane in self.lanes):
                        return
                    if not compiling_here:
                        self.cond.wait(WAIT_S)
                        continue
            if task is None:
                if self._produce(None, block=False) != "ok":
                    with self.cond:
                        self.cond.wait(WAIT_S)
                continue
            self._time(index, task)

    def _time(self, index: int, task: Timing) -> None:
        lane, call = task.lane, task.lane.job.call
        self.bar.set_description(f"{call.op}:{lane.job.backend}:{call.dtype}:{call.key}")
        try:
            result = self.pool.evaluate(index, call, task.backend, task.config, task.seed)
        except BaseException:
            if task.candidate is not None:
                self._drop(lane, task.candidate)
            raise
        if task.built is not None:  # the compile's time, not the timing process's load from the disk cache
            result["compile_s"] = task.built.get("compile_s")
        if self.stop.is_set():  # the workers were killed: an outcome now would be theirs, not the config's
            if task.candidate is not None:
                self._drop(lane, task.candidate)
            return
        if task.candidate is None:
            with self.cond:
                lanes = self.torch_times.pop(call) if task.backend == "torch" else [lane]
                if task.backend == "torch":
                    self.torch_times[call] = result
                for waiting in lanes:
                    self._deliver(waiting, task.labels, result)
            self._settle(lanes)
            return
        with self.cond:
            self.told.append((lane, task.candidate, result))
            self.cond.notify_all()
        if self._count_failure(("timing", index), result):
            self._check_workers()

    def _tell_loop(self, _: int) -> None:
        """Tells each study the outcomes the timing processes measured, in their order, while the GPUs
        go on to their next measurements: a tell is a few storage round trips, each as long as timing
        a small kernel, and the GPU would otherwise wait through them. Ends once every timing thread
        has ended and every outcome is told (so also after a stop: a measured outcome is kept), or when
        the run ends first (a second Ctrl-C): what it has not taken then is abandoned, and redone by the
        next run."""
        while True:
            with self.cond:
                while not self.told and self.timing_loops and not self.closing:
                    self.cond.wait(WAIT_S)
                if not self.told or self.closing:
                    return
                lane, candidate, result = self.told.pop(0)
            self._tell(lane, candidate, result)

    def _check_workers(self) -> None:
        """A SearchStopped when no GPU is left to time on, or no compile process to compile on."""
        timing = [i for i in range(len(self.pool)) if ("timing", i) not in self.retired]
        compiling = [i for i in range(len(self.compilers)) if ("compile", i) not in self.retired]
        if not timing or (len(self.compilers) and not compiling):
            raise SearchStopped("no worker left to run trials: " + "; ".join(self.retired.values())
                                + ". The trials so far are saved: once the GPU works again, the same command resumes")

    def _count_failure(self, worker: tuple[str, int], result: dict) -> bool:
        """Counts a trial's outcome against its worker; True when the worker is to be set aside."""
        if result.get("status") not in WORKER_FAILURES:
            self.failures_in_a_row[worker] = 0
            return False
        self.failures_in_a_row[worker] += 1
        n = self.failures_in_a_row[worker]
        if n < self.args.max_failures_in_a_row:
            return False
        kind, index = worker
        gpu = result.get("gpu")
        why = (f"{kind} worker {index}{f' (GPU {gpu})' if gpu is not None else ''}: {n} trials in a row ended "
               f"{result['status']} (the last: {str(result.get('error'))[:200]})")
        with self.lock:
            self.retired[worker] = why
        tqdm.write(f"{console.PREFIX}: {why}; it gets no more trials", file=sys.stderr)
        return True

    def _guarded(self, loop, index: int) -> None:
        try:
            loop(index)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.crashed.append(exc)
            self.stop.set()
            with self.cond:
                self.cond.notify_all()

    def _write_best(self, lane: Lane) -> None:
        job, name, study, runner = lane.job, lane.name, lane.study, lane.runner
        done_now = runner.measured() - lane.start_measured
        with self.lock:
            # The bar counted the configs the study needed; an early end (all valid configs measured)
            # leaves fewer.
            self.bar.total -= max(0, lane.left - done_now)
            self.bar.refresh()
            best = best_trial(study)
            counts = outcome_counts(study)
            measured = sum(v for k, v in counts.items() if k != "invalid")
        failures = {k: v for k, v in counts.items() if v and k not in ("ok", "invalid")}
        baselines = study.user_attrs.get("baselines", {})
        summary = {"order": lane.order, "op": job.call.op, "backend": job.backend, "dtype": job.call.dtype, "shape": job.call.key,
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
            winner = baselines["incumbent"] if kept else job.space.with_defaults(best.user_attrs["config"])
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
                merge_into_store(self.best_path, self.target, [self.incumbent_entries[key]], lock=self._lock_path())
        elif best is not None:
            row = best.user_attrs["row"]
            entry = {**base, "config": job.space.with_defaults(best.user_attrs["config"]),
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

    def _judge_studies_told_in_full(self) -> None:
        """After a stop, with the teller ended: a study whose whole budget was told (the teller tells the
        last outcomes after the stop too) is judged now, as the search would have judged it. A failure
        here is reported, not raised: the stop's own cause is what the run ends with."""
        try:
            for lane in self.lanes:
                if not lane.finished and lane.baselines_stored and not lane.in_flight and not lane.runner.left():
                    lane.asks_over = lane.finished = True
                    self._write_best(lane)
        except Exception as exc:  # noqa: BLE001 - the storage or best.json failing as the search stops
            tqdm.write(f"{console.PREFIX}: a study told in full could not be judged ({exc}); the next run "
                       "judges it", file=sys.stderr)

    def _incumbent_name(self) -> str:
        return "the shipped store's" if self.incumbents.kind == "shipped" else "best.json's"

    def _lock_path(self) -> Path:
        return self.args.out / "logs" / self.target.name / "best.json.lock"

    # -- the whole run ---------------------------------------------------------------
    def run(self) -> bool:
        """Every study of the plan; True when a Ctrl-C ended them (its trials in flight dropped)."""
        try:
            self.pool.start()  # the workers import torch while the studies open
            self.compilers.start()
            self.lanes = [self.open(order, job) for order, job in enumerate(self.plan.jobs)]
        except BaseException:
            close_pools(self.pool, self.compilers)
            raise
        self.bar = console.bar(total=sum(lane.left for lane in self.lanes), unit="trial")
        threads = [threading.Thread(target=self._guarded, args=(self._compile_loop, i), daemon=True)
                   for i in range(len(self.compilers))]
        threads += [threading.Thread(target=self._guarded, args=(self._time_loop, i), daemon=True)
                    for i in range(len(self.pool))]
        teller = threading.Thread(target=self._guarded, args=(self._tell_loop, 0), daemon=True)
        threads.append(teller)
        self.timing_loops = len(self.pool)
        self.started = time.monotonic()
        interrupted = stopped = False
        try:
            for lane in self.lanes:
                if not lane.left:  # finished in an earlier run: its entry is judged on what it recorded
                    lane.asks_over = lane.finished = True
                    self._write_best(lane)
            for t in threads:
                t.start()
            try:
                for t in threads:
                    while t.is_alive() and not self.crashed:
                        t.join(0.5)
            finally:
                if self.crashed or any(t.is_alive() for t in threads):  # a Ctrl-C, or what ended a thread
                    self.stop.set()
                    self.pool.interrupt()  # unblocks the threads, which drop their trials
                    self.compilers.interrupt()
                    for t in threads:
                        t.join(30)
            if self.crashed:
                stopped = isinstance(self.crashed[0], SearchStopped)
                raise self.crashed[0]  # the search stops: a bug, or no worker left
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self.seconds = time.monotonic() - self.started
            with self.cond:
                self.closing = True  # the teller takes no more outcomes: those it has not taken are abandoned
                untimed = [(task.lane, task.candidate) for task in self.queue if task.candidate is not None]
                untold = [(lane, candidate) for lane, candidate, _ in self.told]
                self.told.clear()
                self.cond.notify_all()
            if teller.is_alive():
                teller.join()  # its tell under way ends before the storage and the CSV close
            for lane, candidate in untimed + untold:  # a later run measures them
                lane.runner.abandon(candidate)
            if interrupted or stopped:
                self._judge_studies_told_in_full()
            self.bar.close()
            close_pools(self.pool, self.compilers)
            self.heartbeat.stop()
            self.csv.close()
            self.summary.sort(key=lambda row: row.pop("order"))
        return interrupted


@dataclass(eq=False)
class Lane:
    """A study as it moves through the pipeline."""

    order: int  # in the plan
    job: Job
    name: str
    study: optuna.Study
    runner: StudyRunner
    baselines: dict  # the default's, torch's and the incumbent's times, as make_row reads them
    left: int  # configs it needed measured when this run opened it
    start_measured: int
    tried: list  # the configs its earlier runs measured
    spec: StudySpec  # how a compile process opens the study to ask it for configs
    activated: bool = False  # its baselines listed
    to_build: list = field(default_factory=list)  # (labels, config) of baselines not yet compiled
    waiting: int = 0  # baselines not yet in
    baselines_stored: bool = False  # all in and stored with the study: its trials may be timed
    asks_over: bool = False  # its runner has no config left to hand out
    saturated_until: float = 0.0  # the rest of its budget is in flight: not asked before this time
    polling: int = 0  # threads asking its runner for a config now
    in_flight: int = 0  # configs handed out, outcome not yet told
    counted: int = 0  # outcomes this run told it that count toward its budget
    finished: bool = False


@dataclass(eq=False)
class Timing:
    """A measurement waiting for a GPU: a baseline (labels) or a trial (candidate)."""

    lane: Lane
    backend: str
    config: dict | None
    seed: int
    labels: tuple[str, ...] = ()
    candidate: Candidate | None = None
    built: dict | None = None  # the compile process's answer; None where the timing process compiles
