"""Optuna plumbing shared by the search and the search-quality replay.

One study per (target, op, backend, dtype, shape). Each tunable ranges over
the values that appear in at least one valid config of the target: as an
index into its sorted values for the samplers that model order
(ORDINAL_SAMPLERS), as a categorical for the others. A suggestion that breaks a rule is told to Optuna as PRUNED at once
(TPE ranks pruned trials below every completed one, so it learns to avoid
such regions) and costs no budget; so does every failed trial, with its real
outcome kept in the trial's user attributes. A config already measured in the
study is not measured again: its result is copied into the new trial.

The budget counts trials that reached (or are reaching) a device, across every
process sharing the storage, so re-running a command resumes where it stopped
and several machines can share one study through an RDB URL; trial numbers
decide who takes the last slots, so together they never overrun it.
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
import itertools
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
import sqlalchemy.exc
from optuna.trial import TrialState

from autotune.targets import Target
from kernels_core.provenance import utc_now
from kernels_core.space import Space

OUTCOMES = ("ok", "invalid", "compile_error", "wrong_result", "launch_error", "timeout")
SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp")
ENUMERATE_LIMIT = 200_000  # spaces up to this size are enumerated to prune values and count valid configs
HEARTBEAT_S, GRACE_S = 30, 120
# A config is written right after `ask` and the sampler's suggestion; a RUNNING trial without one
# for this long lost its process (longer than SQLite's 120 s busy timeout, so a slow write is not
# mistaken for death).
ORPHAN_S = 300
CLAIM_WAIT_S = 10  # how long a trial waits for earlier ones of other processes to pick their configs
WAIT_S = 0.5  # how often a runner whose budget is all in flight looks again


def _host_id() -> str:
    """This host as its processes see it: containers sharing a hostname differ in pid
    namespace, and a reboot changes the boot id (pids start over)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(path).read_text().strip()[:8] if "boot" in path else str(os.stat(path).st_ino))
        except OSError:
            pass
    return "/".join(parts)


HOST = _host_id()
OWNER = f"{HOST}:{os.getpid()}"

warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
optuna.logging.set_verbosity(optuna.logging.WARNING)


class SearchError(RuntimeError):
    pass


def study_name(prefix: str, target: str, op: str, backend: str, dtype: str, shape: str) -> str:
    return f"{prefix}{target}:{op}:{backend}:{dtype}:{shape}"


def open_storage(url: str) -> optuna.storages.RDBStorage:
    kwargs = {}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs = {"connect_args": {"timeout": 120}}  # writers from other processes wait, not fail
    for attempt in range(3):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S,
                                              grace_period=GRACE_S)
        except sqlalchemy.exc.DBAPIError as exc:
            # Processes that open a new storage at once race to create its tables and
            # version row; the loser finds them made and opens the storage as it now is.
            racing = isinstance(exc, sqlalchemy.exc.IntegrityError) or "already exists" in str(exc)
            if not racing or attempt == 2:
                raise
            time.sleep(0.5)


# Samplers that see tunables as ordered (an index into the sorted values) rather than as
# unordered categories. CMA-ES has no categorical support at all; for TPE, replaying the
# H200's measured grid (experiments/NOTES.md, section 7) showed that knowing 64 lies between
# 32 and 128 lets it reach the best tiles in fewer trials than categories do.
ORDINAL_SAMPLERS = ("tpe", "cmaes", "gp")


def make_sampler(name: str, seed: int | None, values: dict[str, list[int]], *,
                 parallel: bool = False) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        # multivariate: tile sizes interact (restrictions, occupancy); constant liar
        # keeps parallel workers from all proposing the same config.
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=parallel)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return _Grid(values, seed=seed)
    if name == "cmaes":
        if importlib.util.find_spec("cmaes") is None:
            raise SearchError("--sampler cmaes needs the cmaes package: pip install cmaes")
        return optuna.samplers.CmaEsSampler(seed=seed)
    if name == "gp":
        if importlib.util.find_spec("scipy") is None:
            raise SearchError("--sampler gp needs scipy: pip install scipy")
        return optuna.samplers.GPSampler(seed=seed)
    raise SearchError(f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")


class _Grid(optuna.samplers.GridSampler):
    # GridSampler stops the study when the grid is done, which only works inside
    # study.optimize; the runner stops by itself once every valid config is tried.
    def after_trial(self, study, trial, state, values) -> None:
        pass

    # A FAILed trial (dropped, interrupted, or reaped after its process died) measured
    # nothing: its grid point stays to visit, where GridSampler counts it as done.
    def _get_unvisited_grid_ids(self, study) -> list[int]:
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False)
        told = {t.system_attrs.get("grid_id") for t in trials if t.state.is_finished() and t.state != TrialState.FAIL}
        failed = {t.system_attrs.get("grid_id") for t in trials if t.state == TrialState.FAIL} - told - {None}
        return sorted(set(super()._get_unvisited_grid_ids(study)) | failed)


@dataclass
class SpaceView:
    """A space as one target sees it: values worth suggesting and the valid configs."""

    space: Space
    values: dict[str, list[int]]
    valid: list[dict[str, int]] | None  # None when the space is too large to enumerate
    total: int


def view_space(space: Space, target: Target, elt: int) -> SpaceView:
    if space.size() > ENUMERATE_LIMIT:
        return SpaceView(space, {k: list(v) for k, v in space.params.items()}, None, space.size())
    names = list(space.params)
    valid = []
    for combo in itertools.product(*(space.params[n] for n in names)):
        config = dict(zip(names, combo))
        if target.target_violation(space, config, elt) is None:
            valid.append(config)
    values = {n: [v for v in space.params[n] if any(c[n] == v for c in valid)] for n in names}
    return SpaceView(space, values, valid, space.size())


def config_key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


def owner_dead(owner: str | None) -> bool:
    host, _, pid = (owner or "").rpartition(":")
    if host != HOST or not pid.isdigit():
        return False  # another machine's trial: its heartbeat decides
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


_CONFIGLESS_SINCE: dict[int, float] = {}  # storage id -> when this process first saw it without a config


def _on_this_host(study: optuna.Study) -> bool:
    """A SQLite storage is a local file: every process using it runs on this host, so
    the start times Optuna records (naive local time) are on this host's clock."""
    storage = getattr(study._storage, "_backend", study._storage)
    return str(getattr(storage, "url", "")).startswith("sqlite")


def _configless_for(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> float | None:
    """Seconds `trial` has been without a config; None once it has one. By its start time
    when that is on this host's clock (SQLite), else by how long this process has seen it
    so (the asking host's clock and time zone are unknown)."""
    if "config" in trial.user_attrs:
        return None
    now = time.monotonic()
    seen = now - _CONFIGLESS_SINCE.setdefault(trial._trial_id, now)
    if trial.datetime_start is not None and _on_this_host(study):
        return max(seen, (_dt.datetime.now() - trial.datetime_start).total_seconds())
    return seen


def _orphaned(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
    """Asked for but never given a config: its process died in the first writes after
    `ask`, before a heartbeat could speak for it on other hosts."""
    age = _configless_for(study, trial)
    return age is not None and age > ORPHAN_S


def reap_stale(study: optuna.Study) -> int:
    """End trials left RUNNING by a dead process: on this host by pid, on others
    by a stale heartbeat (judged by the storage's clock), and orphans.

    A trial whose outcome was written before its process died is told that
    outcome, so the measurement stands; any other is failed and redone.
    """
    stale = set(study._storage._get_stale_trial_ids(study._study_id))
    reaped = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not (trial._trial_id in stale or owner_dead(trial.user_attrs.get("owner")) or _orphaned(study, trial)):
            continue
        try:
            status = trial.user_attrs.get("status")
            if status == "ok":
                study.tell(trial.number, trial.user_attrs["row"]["time_ms"])
            elif status is not None:
                study.tell(trial.number, state=TrialState.PRUNED)
            else:
                study.tell(trial.number, state=TrialState.FAIL)
            reaped += 1
        except (ValueError, RuntimeError):
            pass  # finished meanwhile by its owner after all
    return reaped


def counts_toward_budget(trial: optuna.trial.FrozenTrial) -> bool:
    """A finished trial with an outcome other than `invalid`. Live trials are weighed apart,
    by who asked first (StudyRunner._place)."""
    return trial.state != TrialState.RUNNING and trial.user_attrs.get("status") not in (None, "invalid")


_WAIT = object()  # StudyRunner: the rest of the budget is in flight; look again soon


@dataclass
class Candidate:
    trial: optuna.Trial
    config: dict[str, int]
    twin: int | None = None  # storage id of a running trial measuring the same config


@dataclass
class StudyRunner:
    """ask -> check -> (reuse | hand out) -> tell, safe for several threads."""

    study: optuna.Study
    view: SpaceView
    budget: int
    check: Callable[[dict], str | None]  # why a config cannot run, or None
    make_row: Callable[[dict, dict, int], dict]  # (config, result, trial number) -> CSV row
    record: Callable[[dict], None] = lambda row: None
    ordinal: bool = False  # suggest value indices instead of categories (see ORDINAL_SAMPLERS)
    lock: threading.Lock = field(default_factory=threading.Lock)
    heartbeat: "Heartbeat | None" = None
    invalid: int = 0
    reused: int = 0
    gave_up: str = ""

    def measured(self) -> int:
        """Finished trials that count toward the budget, from every process."""
        with self.lock:
            return sum(counts_toward_budget(t) for t in self.study.get_trials(deepcopy=False))

    def left(self) -> int:
        """Trials the study still needs: the budget not yet finished, capped by the valid
        configs no finished trial has taken. Trials in flight elsewhere are not deducted:
        their processes may die, and a runner waits for them (next_candidate)."""
        with self.lock:
            finished = [t for t in self.study.get_trials(deepcopy=False) if counts_toward_budget(t)]
        left = self.budget - len(finished)
        if self.view.valid is not None:
            left = min(left, len(self.view.valid) - len({config_key(t.user_attrs["config"]) for t in finished}))
        return max(0, left)

    def _suggest(self, trial: optuna.Trial) -> dict[str, int]:
        try:
            if self.ordinal:
                return {n: v[trial.suggest_int(f"{n}#index", 0, len(v) - 1)] for n, v in self.view.values.items()}
            return {n: trial.suggest_categorical(n, v) for n, v in self.view.values.items()}
        except ValueError as exc:
            self._drop(trial)
            raise SearchError(f"study {self.study.study_name}: {exc}. The backend's space changed since the "
                              "study was created; pass --study-prefix to start new studies.") from None

    def next_candidate(self, stop: threading.Event | None = None) -> Candidate | None:
        """The next config to measure, or None when the budget or the space is used up
        (or `stop` is set).

        While the rest of the budget is in flight (in other threads or processes)
        it waits, without the lock, for those trials to end or their owners to die.
        """
        stop = stop or threading.Event()
        while True:
            with self.lock:
                candidate = self._next_or_wait()
            if candidate is not _WAIT:
                return candidate
            if stop.wait(WAIT_S):
                return None

    def _next_or_wait(self):
        streak = 0
        while True:
            trials = self.study.get_trials(deepcopy=False)
            finished = [t for t in trials if counts_toward_budget(t)]
            live = [t for t in trials if t.state == TrialState.RUNNING and not _orphaned(self.study, t)]
            tried = {config_key(t.user_attrs["config"]) for t in finished + live if "config" in t.user_attrs}
            exhausted = self.view.valid is not None and len(tried) >= len(self.view.valid)
            if len(finished) >= self.budget or (exhausted and not live):
                return None
            if len(finished) + len(live) >= self.budget or exhausted:
                reap_stale(self.study)  # what is in flight may fill the budget, or may be dead
                return _WAIT
            trial = self._ask_owned()
            if self.heartbeat:
                self.heartbeat.add(trial._trial_id)  # from now on other hosts can tell if it dies
            config = self._suggest(trial)
            trial.set_user_attr("config", config)
            problem = self.check(config)
            if problem:
                self._finish(trial, config, {"status": "invalid", "error": problem})
                self.invalid += 1
                streak += 1
                if streak > max(50, 2 * self.budget):
                    self.gave_up = f"the sampler proposed {streak} invalid configs in a row"
                    return None
                continue
            verdict, other = self._place(trial, config)
            if verdict == "full":  # a process asked just before this one took the last slot
                self._drop(trial)
                return _WAIT
            if verdict == "reuse":
                self._reuse(trial, other)
                continue
            return Candidate(trial, config, other._trial_id if verdict == "twin" else None)

    def _ask_owned(self) -> optuna.Trial:
        """`study.ask()`, except that the trial is created RUNNING with its owner in one storage
        write: a kill can never leave a started trial that names no owner (which only a long
        wait could then tell from a live one). Optuna's own `ask` writes the trial first."""
        template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={"owner": OWNER})
        if hasattr(self.study, "_thread_local"):
            self.study._thread_local.cached_all_trials = None  # as `ask` does: samplers see fresh trials
        trial_id = self.study._storage.create_new_trial(self.study._study_id, template_trial=template)
        return optuna.Trial(self.study, trial_id)

    def _place(self, trial: optuna.Trial, config: dict) -> tuple[str, optuna.trial.FrozenTrial | None]:
        """Where a claimed trial stands among the processes sharing the storage.

        ("full", None): the budget is taken; ("reuse", t): t measured the config;
        ("twin", t): t, asked earlier and still live, measures it; ("measure", None).
        Trial numbers order the claims. A trial waits (briefly) until every live
        trial asked before it has picked its config, then goes ahead only if the
        finished trials that count plus those earlier live ones leave a slot: the
        highest-numbered of budget + 1 trials always sees the other budget, so
        together the processes never overrun it, and the lowest-numbered
        contender is never held back, so the search goes on. A config is measured
        by the earliest live trial that picked it; later ones wait and copy.
        """
        while True:
            trials = self.study.get_trials(deepcopy=False)
            earlier = [t for t in trials if t.state == TrialState.RUNNING and t.number < trial.number
                       and not _orphaned(self.study, t)]
            ages = [_configless_for(self.study, t) for t in earlier]
            if all(age is None or age > CLAIM_WAIT_S for age in ages):
                break  # every earlier trial has its config, or is late enough to be presumed dead
            time.sleep(0.05)  # a config is a suggestion and a storage write away
        finished = [t for t in trials if counts_toward_budget(t)]
        if len(finished) + len(earlier) >= self.budget:
            return "full", None
        key = config_key(config)
        for t in finished:
            if "row" in t.user_attrs and config_key(t.user_attrs["config"]) == key:
                return "reuse", t
        # A trial marked as measuring never waits, so waiting never goes round in a circle; the
        # mark also catches an earlier trial whose sampler took longer than CLAIM_WAIT_S.
        live = earlier + [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get("measuring")
                          and t.number != trial.number]
        for t in sorted(live, key=lambda t: (not t.user_attrs.get("measuring"), t.number)):
            if config_key(t.user_attrs.get("config", {})) == key:
                return "twin", t
        trial.set_user_attr("measuring", True)
        return "measure", None

    def reuse_twin(self, candidate: Candidate, stop: threading.Event) -> bool:
        """Wait for the twin measuring the same config and copy its result.

        False when the twin ended without a result (its process died): the
        caller then measures the config itself.
        """
        polls = 0
        while not stop.wait(0.2):
            polls += 1
            with self.lock:
                if polls % 25 == 0:
                    reap_stale(self.study)  # the twin's process may have died
                twin = self.study._storage.get_trial(candidate.twin)
                if twin.state == TrialState.RUNNING:
                    continue
                if not (counts_toward_budget(twin) and "row" in twin.user_attrs):
                    return False
                self._reuse(candidate.trial, twin)
                return True
        return False

    def _reuse(self, trial: optuna.Trial, previous: optuna.trial.FrozenTrial) -> None:
        row = dict(previous.user_attrs["row"], trial=trial.number, reused_from=previous.number,
                   utc=utc_now())
        self.reused += 1
        self._tell(trial, previous.user_attrs["status"], row, previous.value)

    def complete(self, candidate: Candidate, result: dict) -> dict:
        with self.lock:
            return self._finish(candidate.trial, candidate.config, result)

    def abandon(self, candidate: Candidate) -> None:
        """An interrupted trial: failed without an outcome, so a later run redoes it."""
        with self.lock:
            self._drop(candidate.trial)

    def _drop(self, trial: optuna.Trial) -> None:
        if self.heartbeat:
            self.heartbeat.discard(trial._trial_id)
        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)

    def _finish(self, trial: optuna.Trial, config: dict, result: dict) -> dict:
        row = self.make_row(config, result, trial.number)
        self._tell(trial, result["status"], row, result.get("time_ms"))
        return row

    def _tell(self, trial: optuna.Trial, status: str, row: dict, value: float | None) -> None:
        # Row before status, both before the state and the CSV: the status marks
        # an outcome as complete, so a kill anywhere here leaves either a trial
        # the next run redoes or one whose row it copies into the CSV, never a
        # CSV row the study lacks.
        if self.heartbeat:
            self.heartbeat.discard(trial._trial_id)
        try:
            trial.set_user_attr("row", row)
            trial.set_user_attr("status", status)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another process took it for dead and failed it (its heartbeat went unrecorded
            # for the grace period): the outcome is lost and the config goes back to the sampler.
            print(f"autotune: trial {trial.number} was ended elsewhere; its result is dropped", file=sys.stderr)
            return
        if status == "ok":
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=TrialState.PRUNED)
        self.record(row)


class Heartbeat:
    """Keeps in-flight trials alive in the storage, so other machines can tell
    a slow trial from a dead one. Its own lock: a runner busy with a slow
    sampler must not starve it past the grace period."""

    def __init__(self, storage: optuna.storages.RDBStorage):
        self.storage = storage
        self.ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, trial_id: int) -> None:
        with self._lock:
            self.ids.add(trial_id)
        self.storage.record_heartbeat(trial_id)

    def discard(self, trial_id: int) -> None:
        with self._lock:
            self.ids.discard(trial_id)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                ids = list(self.ids)
            for trial_id in ids:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception as exc:  # noqa: BLE001 - a storage hiccup must not end the heartbeat
                    print(f"autotune: heartbeat of trial {trial_id} not recorded: {exc}", file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    ok = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
          if t.user_attrs.get("status") == "ok"]
    return min(ok, key=lambda t: t.value) if ok else None


def outcome_counts(study: optuna.Study) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for t in study.get_trials(deepcopy=False):
        status = t.user_attrs.get("status")
        if status in counts:
            counts[status] += 1
    return counts
