"""Optuna plumbing shared by the search and the search-quality replay.

One study per (target, op, backend, dtype, shape; SGD's also per momentum or none,
kernels_core.mlp.Call.study_key). Each tunable ranges over
the values that appear in at least one valid config of the target: as an
index into its sorted values for the samplers that model order
(ORDINAL_SAMPLERS), as a categorical for the others.

The budget counts configs measured: trials that reached (or are reaching) a
device, in every process sharing the storage, so re-running a command resumes
where it stopped and several machines share one study through an RDB URL.
A repeat is never a trial:
- a suggestion that breaks a rule is told to Optuna as PRUNED at once (TPE ranks
  pruned trials below every completed one, so it learns to avoid such regions);
- a config measured already, in this study or in another study of the storage
  for the same target, op, backend, dtype and shape (another --study-prefix), is
  told its recorded result;
- a config another trial is measuring now is dropped (FAIL, which samplers
  ignore): its result reaches the sampler when that trial ends;
and the sampler is asked again, at most `max(50, 2 * budget)` times in a row. A
study whose valid configs are all measured ends early and says so.

Optuna provides the storage (which numbers trials under a row lock), ask/tell,
and, for processes on other hosts that die, the heartbeat table with
`fail_stale_trials`. What it cannot do is kept here:
- An exact budget over several processes, and no config measured twice:
  `MaxTrialsCallback` counts trials as they end, so processes that start trials
  together overrun it, and no sampler knows what another process is about to
  measure. Trial numbers order the claims instead (StudyRunner._place).
- A heartbeat outside `Study.optimize`, which alone runs Optuna's: Heartbeat.
- Same-host deaths found at once by pid rather than after the grace period, so
  a killed search resumes without waiting: the trial's owner (owner_dead).
- `enqueue_trial` and `RetryFailedTrialCallback` (which enqueues) are not used:
  two processes on SQLite can both start one WAITING trial (Optuna claims it
  with SELECT ... FOR UPDATE, which SQLite ignores). A dead trial's config goes
  back to the sampler instead.
- GridSampler counts a failed trial's point as visited and ends a study through
  `Study.stop`, which works only inside `optimize`: _GridOrder.
"""
from __future__ import annotations

import itertools
import os
import random
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import optuna
import sqlalchemy.event
import sqlalchemy.exc
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from kernels_core.targets import Target
from kernels_core.space import Space

OUTCOMES = ("ok", "invalid", "compile_error", "wrong_result", "launch_error", "timeout")
SAMPLERS = ("tpe", "tpe-startup20", "tpe-ei64", "tpe-valid", "qmc", "random", "grid", "cmaes", "gp")
# The replay of the H200's three full grids picked it (experiments/FINDINGS.md, "Tuner samplers and search quality"): within 3% of each
# grid's best in 10% of the grid for 100 of 100 seeds on all three (tpe-ei64: 91-94), and the fewest asks.
DEFAULT_SAMPLER = "tpe-valid"
ENUMERATE_LIMIT = 200_000  # spaces up to this size are enumerated to prune values and count valid configs
HEARTBEAT_S, GRACE_S = 30, 120
WAIT_S = 0.5  # how often a runner whose budget is all in flight looks again
DECIDE_POLL_S = 0.05  # how often a claim looks again for later claims to decide
REAP_EVERY_S = 2.0  # how often a waiting claim looks for dead processes


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
    """A search refused as asked (its flags, or the files and storage they name): exit 2."""


class SearchStopped(SearchError):
    """A search that cannot go on though it was asked for correctly: exit 1. The trials so far are saved."""


def study_name(prefix: str, target: str, op: str, backend: str, dtype: str, shape: str) -> str:
    return f"{prefix}{target}:{op}:{backend}:{dtype}:{shape}"


def open_storage(url: str) -> optuna.storages.RDBStorage:
    kwargs = {}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs = {"connect_args": {"timeout": 120}}  # writers from other processes wait, not fail
    for attempt in range(3):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S,
                                                 grace_period=GRACE_S)
            if kwargs:
                sqlalchemy.event.listen(storage.engine, "connect", _sqlite_fast_commits)
                storage.engine.dispose()  # the connections opened already lack it
            return storage
        except sqlalchemy.exc.DBAPIError as exc:
            # Processes that open a new storage at once race to create its tables and
            # version row; the loser finds them made and opens the storage as it now is.
            racing = isinstance(exc, sqlalchemy.exc.IntegrityError) or "already exists" in str(exc)
            if not racing or attempt == 2:
                raise
            time.sleep(0.5)


def _sqlite_fast_commits(connection, _record) -> None:
    """Write-ahead log, synced at checkpoints rather than at every commit: a trial's few commits
    took longer than timing its kernel. A killed process still loses nothing (the log is in the
    OS's hands); a power cut may lose the last commits, never the database. Readers and the one
    writer no longer block each other, so processes sharing the file wait less too."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


# Samplers that see tunables as ordered (an index into the sorted values) rather than as
# unordered categories. CMA-ES has no categorical support at all; for TPE, replaying the
# H200's measured grid (experiments/FINDINGS.md, "Tuner samplers and search quality") showed that knowing 64 lies between
# 32 and 128 lets it reach the best tiles in fewer trials than categories do. Sobol points
# spread over the indices cover small and large tiles alike; over categories they would not.
ORDINAL_SAMPLERS = ("tpe", "tpe-startup20", "tpe-ei64", "tpe-valid", "qmc", "cmaes", "gp")


def make_sampler(name: str, seed: int | None, values: dict[str, list[int]], *,
                 parallel: bool = False, valid: list[dict[str, int]] | None = None) -> optuna.samplers.BaseSampler:
    # multivariate: tile sizes interact (restrictions, occupancy); constant liar
    # keeps parallel workers from all proposing the same config.
    tpe = dict(seed=seed, multivariate=True, constant_liar=parallel)
    # Each proposal the best of 64 draws from the good configs' density rather than 24: greedier,
    # and a repeat it proposes costs nothing (it is told its result).
    ei64 = dict(tpe, n_ei_candidates=64)
    if name == "tpe":
        return optuna.samplers.TPESampler(**tpe)
    if name == "tpe-startup20":
        # Invalid suggestions count toward TPE's start too: 20 random ones measure a handful more
        # configs before the model narrows, so it narrows on a better picture.
        return optuna.samplers.TPESampler(**tpe, n_startup_trials=20)
    if name == "tpe-ei64":
        return optuna.samplers.TPESampler(**ei64)
    if name == "tpe-valid":
        return _ValidTPE(values, valid, **ei64)
    if name == "qmc":
        # Scrambled, so each seed walks its own sequence; the first trial is the random sampler's
        # (QMCSampler learns the search space from it).
        return optuna.samplers.QMCSampler(qmc_type="sobol", scramble=True, seed=seed,
                                          independent_sampler=optuna.samplers.RandomSampler(seed=seed))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return _GridOrder(values, seed=seed)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    raise SearchError(f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")


class _ValidTPE(optuna.samplers.TPESampler):
    """tpe-ei64 whose every proposal is a valid config not yet measured or claimed.

    Told only PRUNED trials, TPE learns the restrictions slowly: on the CUDA fp32 space most of
    its proposals broke one, and each cost a storage round trip (ask, tell) that took longer than
    timing the kernel (experiments/FINDINGS.md, "Tuner samplers and search quality"). Here the start is drawn uniformly from
    the valid configs instead of from the product of the values, and later the model's candidates
    that are invalid or taken score -inf, so its choice is the best of the others. Without an
    enumerated space (`valid` None) it is tpe-ei64.

    It overrides TPESampler._compute_acquisition_func, a private method (as of Optuna 5.0, the
    version on the GPU machine): tests/test_autotune_units.py fails if a release renames it.
    """

    REDRAWS = 8  # candidate batches with no valid, free config before a uniform one is taken

    def __init__(self, values: dict[str, list[int]], valid: list[dict[str, int]] | None, **tpe):
        super().__init__(**tpe)
        self._space = {f"{n}#index": optuna.distributions.IntDistribution(0, len(v) - 1) for n, v in values.items()}
        index = {n: {v: i for i, v in enumerate(vs)} for n, vs in values.items()}
        self._valid = None if valid is None else frozenset(tuple(index[n][c[n]] for n in values) for c in valid)
        self._free: frozenset[tuple] = frozenset()  # valid and not taken, for the proposal under way
        self._pick = random.Random(tpe["seed"])

    def _point(self, params: dict) -> tuple | None:
        return tuple(params[p] for p in self._space) if all(p in params for p in self._space) else None

    def infer_relative_search_space(self, study, trial):
        return super().infer_relative_search_space(study, trial) if self._valid is None else self._space

    def sample_relative(self, study, trial, search_space):
        if self._valid is None or not search_space:
            return super().sample_relative(study, trial, search_space)
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        self._free = self._valid - {self._point(t.params) for t in trials}
        if not self._free:  # the study ends on its own; any valid config is a repeat
            self._free = self._valid
        for _ in range(self.REDRAWS):
            params = super().sample_relative(study, trial, search_space)  # {} during TPE's random start
            if self._point(params) in self._free:
                return params
            if not params:
                break
        return dict(zip(self._space, self._pick.choice(sorted(self._free))))

    def _compute_acquisition_func(self, samples, mpe_below, mpe_above):
        score = super()._compute_acquisition_func(samples, mpe_below, mpe_above)
        points = zip(*(samples[p].round().astype(int).tolist() for p in self._space))
        return np.where([point in self._free for point in points], score, -np.inf)


class _GridOrder(optuna.samplers.BaseSampler):
    """Every point of the grid in a shuffled order: the first one that no trial holds.
    A FAILed trial (dropped, interrupted, or its process died) measured nothing, so its
    point stays to visit; once all are held, any point (a repeat, which costs nothing)."""

    def __init__(self, values: dict[str, list[int]], seed: int | None = None):
        self._points = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
        self._rng = random.Random(seed)
        self._rng.shuffle(self._points)
        self._picked: dict[int, dict] = {}  # trial number -> its point, while its params are suggested

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        if trial.number not in self._picked:
            held = {config_key(t.params) for t in study.get_trials(deepcopy=False)
                    if t.state != TrialState.FAIL and t.number != trial.number}
            free = (p for p in self._points if config_key(p) not in held)
            self._picked[trial.number] = next(free, None) or self._rng.choice(self._points)
        return self._picked[trial.number][param_name]

    def after_trial(self, study, trial, state, values) -> None:
        self._picked.pop(trial.number, None)


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


def reap_dead(study: optuna.Study) -> None:
    """Fail the trials left RUNNING by dead processes: on this host by pid, on others by a
    heartbeat older than the grace period. Their configs go back to the sampler; an outcome
    written just before the death never reached a CSV, so measuring it again repeats nothing.

    A trial killed between `ask` and its owner's first write has neither owner nor
    heartbeat: it stays RUNNING, but without a config it holds no claim (StudyRunner)."""
    optuna.storages.fail_stale_trials(study)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if owner_dead(trial.user_attrs.get("owner")):
            try:
                study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            except UpdateFinishedTrialError:
                pass  # another process reaped it first


def counts_toward_budget(trial: optuna.trial.FrozenTrial) -> bool:
    """A finished trial that measured its config: an outcome other than `invalid`, not a copy."""
    return (trial.state in (TrialState.COMPLETE, TrialState.PRUNED) and "reused_from" not in trial.user_attrs
            and trial.user_attrs.get("status") not in (None, "invalid"))


def measured_elsewhere(storage: optuna.storages.BaseStorage, name: str,
                       key: str) -> dict[tuple, tuple[str, optuna.trial.FrozenTrial]]:
    """Config -> ("study#trial", trial) of the trials that measured it in the storage's other
    studies of the same target/op/backend/dtype/shape `key` (other --study-prefix values)."""
    found = {}
    for other in optuna.get_all_study_names(storage):
        if other != name and other.endswith(key):
            for t in optuna.load_study(study_name=other, storage=storage).get_trials(deepcopy=False):
                if counts_toward_budget(t):
                    found.setdefault(config_key(t.user_attrs["config"]), (f"{other}#{t.number}", t))
    return found


def _claims(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Live trials that hold a config: each may be measuring it or about to."""
    return [t for t in trials if t.state == TrialState.RUNNING and "config" in t.user_attrs]


_WAIT = object()  # StudyRunner: the rest of the budget is in flight; look again soon


@dataclass
class Candidate:
    trial: optuna.Trial
    config: dict[str, int]


@dataclass
class StudyRunner:
    """ask -> check -> (repeat: tell its result, ask again | claim -> measure) -> tell,
    safe for several threads and processes."""

    study: optuna.Study
    view: SpaceView
    budget: int
    check: Callable[[dict], str | None]  # why a config cannot run, or None
    make_row: Callable[[dict, dict, int], dict]  # (config, result, trial number) -> CSV row
    record: Callable[[dict], None] = lambda row: None
    ordinal: bool = False  # suggest value indices instead of categories (see ORDINAL_SAMPLERS)
    lock: threading.Lock = field(default_factory=threading.Lock)
    heartbeat: "Heartbeat | None" = None
    known: dict = field(default_factory=dict)  # measured_elsewhere()
    invalid: int = 0
    reused: int = 0
    ended: str = ""  # why the study ended before its budget

    def __post_init__(self) -> None:
        self._valid = None if self.view.valid is None else {config_key(c) for c in self.view.valid}

    def measured(self) -> int:
        """Finished trials that count toward the budget, from every process."""
        with self.lock:
            return sum(counts_toward_budget(t) for t in self.study.get_trials(deepcopy=False))

    def _done_keys(self, trials) -> set[tuple]:
        return {config_key(t.user_attrs["config"]) for t in trials if counts_toward_budget(t)} | set(self.known)

    def _exhausted(self, done: set[tuple]) -> bool:
        if self._valid is None or not self._valid <= done:
            return False
        self.ended = f"all {len(self._valid)} valid configs measured"
        return True

    def left(self) -> int:
        """Configs the study still needs measured: the budget not yet finished, capped by the
        valid configs not yet measured. Trials in flight elsewhere are not deducted: their
        processes may die, and a runner waits for them (next_candidate)."""
        with self.lock:
            trials = self.study.get_trials(deepcopy=False)
        left = self.budget - sum(counts_toward_budget(t) for t in trials)
        done = self._done_keys(trials)
        if left <= 0 or self._exhausted(done):
            return 0
        return left if self._valid is None else min(left, len(self._valid - done))

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
        streak = 0  # suggestions in a row that measure nothing new
        while True:
            trials = self.study.get_trials(deepcopy=False)
            measured = sum(counts_toward_budget(t) for t in trials)
            claims = _claims(trials)
            done = self._done_keys(trials)
            if measured >= self.budget or self._exhausted(done):
                return None
            if measured + len(claims) >= self.budget or (
                    self._valid is not None and self._valid <= done | {config_key(t.user_attrs["config"]) for t in claims}):
                reap_dead(self.study)  # what is in flight may fill the budget, or may be dead
                return _WAIT
            trial = self.study.ask()
            trial.set_user_attr("owner", OWNER)
            if self.heartbeat:
                self.heartbeat.add(trial)  # from now on other hosts can tell if it dies
            config = self._suggest(trial)
            problem = self.check(config)
            if problem:
                self._finish(trial, config, {"status": "invalid", "error": problem})
                self.invalid += 1
            else:
                trial.set_user_attr("config", config)  # the claim: from now on others see it
                verdict, previous = self._place(trial, config)
                if verdict == "measure":
                    return Candidate(trial, config)
                if verdict == "full":  # the slots left are claimed by trials asked before this one
                    self._drop(trial)
                    return _WAIT
                if verdict == "reuse":
                    self._reuse(trial, *previous)
                else:  # "in flight": its result reaches the sampler when the trial measuring it ends
                    self._drop(trial)
            streak += 1
            if streak >= max(50, 2 * self.budget):
                self.ended = f"the sampler proposed {streak} invalid or measured configs in a row"
                return None

    def _place(self, trial: optuna.Trial, config: dict) -> tuple[str, tuple | None]:
        """What a trial that claimed `config` does, among the processes sharing the storage.

        ("reuse", (source, t)): t measured the config; ("in flight", None): a claim ahead of this
        one holds it; ("full", None): the claims ahead fill the budget; ("measure", None).

        A claim is the config written to a live trial; one is ahead of this trial if its
        number is lower, or if it is marked as measuring. Before deciding, a trial waits
        for every later claim to decide: a later claim decides without waiting for earlier
        ones, so waiting never goes round in a circle, and only a dead process stalls it
        (reaped by pid or heartbeat). Why the budget holds: every trial writes its claim
        before it reads the others', so of two trials deciding at once at least one sees the
        other's claim; if the later-numbered one missed the earlier, the earlier sees it, waits
        for its decision and counts it. Each measuring trial is then counted by the one that
        decided after it, and the same rule keeps two claims of one config from both measuring.
        """
        key = config_key(config)
        reaped = time.monotonic()
        while True:
            trials = self.study.get_trials(deepcopy=False)
            for t in trials:
                if counts_toward_budget(t) and config_key(t.user_attrs["config"]) == key:
                    return "reuse", (t.number, t)
            if key in self.known:
                return "reuse", self.known[key]
            others = [t for t in _claims(trials) if t.number != trial.number]
            ahead = [t for t in others if t.number < trial.number or t.user_attrs.get("measuring")]
            if any(config_key(t.user_attrs["config"]) == key for t in ahead):
                return "in flight", None
            if len(ahead) == len(others):
                break
            time.sleep(DECIDE_POLL_S)  # a later claim is a read and a write away from deciding
            if time.monotonic() - reaped > REAP_EVERY_S:
                reap_dead(self.study)
                reaped = time.monotonic()
        if sum(counts_toward_budget(t) for t in trials) + len(ahead) >= self.budget:
            return "full", None
        trial.set_user_attr("measuring", True)
        return "measure", None

    def _reuse(self, trial: optuna.Trial, source: int | str, previous: optuna.trial.FrozenTrial) -> None:
        """Tell the sampler a measured config's result, at no budget cost and with no CSV row."""
        trial.set_user_attr("reused_from", source)
        self.reused += 1
        # The measurement's own row, unchanged: its study, trial, time and commit say where it was made.
        self._tell(trial, previous.user_attrs["status"], previous.user_attrs["row"], previous.value, record=False)

    def complete(self, candidate: Candidate, result: dict) -> dict:
        with self.lock:
            return self._finish(candidate.trial, candidate.config, result)

    def abandon(self, candidate: Candidate) -> None:
        """An interrupted trial: failed without an outcome, so a later run redoes it."""
        with self.lock:
            self._drop(candidate.trial)

    def _drop(self, trial: optuna.Trial) -> None:
        if self.heartbeat:
            self.heartbeat.discard(trial)
        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)

    def _finish(self, trial: optuna.Trial, config: dict, result: dict) -> dict:
        row = self.make_row(config, result, trial.number)
        self._tell(trial, result["status"], row, result.get("time_ms"))
        return row

    def _tell(self, trial: optuna.Trial, status: str, row: dict, value: float | None, record: bool = True) -> None:
        # The outcome before the state, the state before the CSV: a kill in between leaves a
        # RUNNING trial that is reaped and redone, or a finished one whose row the next run
        # copies into the CSV (Search._copy_missing_rows), never a CSV row the study lacks.
        if self.heartbeat:
            self.heartbeat.discard(trial)
        try:
            trial.set_user_attr("row", row)
            trial.set_user_attr("status", status)
            if status == "ok":
                self.study.tell(trial, value)
            else:
                self.study.tell(trial, state=TrialState.PRUNED)
        except (UpdateFinishedTrialError, ValueError):
            # Another process took it for dead and failed it (its heartbeat went unrecorded
            # for the grace period): the outcome is lost and the config goes back to the sampler.
            print(f"autotune: trial {trial.number} was ended elsewhere; its result is dropped", file=sys.stderr)
            return
        if record:
            self.record(row)


class Heartbeat:
    """Keeps in-flight trials alive in the storage, so other machines can tell
    a slow trial from a dead one. Its own lock: a runner busy with a slow
    sampler must not starve it past the grace period."""

    def __init__(self, storage: optuna.storages.RDBStorage):
        self.storage = storage
        self.ids: dict[tuple[str, int], int] = {}  # (study, trial number) -> trial id
        self._study_ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, trial: optuna.Trial) -> None:
        name = trial.study.study_name
        if name not in self._study_ids:
            self._study_ids[name] = self.storage.get_study_id_from_name(name)
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self._study_ids[name], trial.number)
        with self._lock:
            self.ids[(name, trial.number)] = trial_id
        self.storage.record_heartbeat(trial_id)

    def discard(self, trial: optuna.Trial) -> None:
        with self._lock:
            self.ids.pop((trial.study.study_name, trial.number), None)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                ids = list(self.ids.values())
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
    """Outcomes of the trials that measured (copies left out) and of invalid suggestions."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for t in study.get_trials(deepcopy=False):
        status = t.user_attrs.get("status")
        if status in counts and (counts_toward_budget(t) or status == "invalid"):
            counts[status] += 1
    return counts
