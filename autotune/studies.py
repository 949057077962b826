"""Running one study: StudyRunner asks Optuna for configs, claims them among the processes that
share the storage, and tells Optuna what they measured.

One study per (target, op, backend, dtype, shape; SGD's also per momentum or none,
kernels_core.mlp.Call.study_key).

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
and the sampler is asked again, at most `max(50, 2 * budget)` times in a row (more in a
sparse space: StudyRunner.patience). A study whose valid configs are all measured ends early
and says so.

Optuna provides ask/tell. What it cannot do is kept here:
- An exact budget over several processes, and no config measured twice:
  `MaxTrialsCallback` counts trials as they end, so processes that start trials
  together overrun it, and no sampler knows what another process is about to
  measure. Trial numbers order the claims instead (StudyRunner._place).
- `enqueue_trial` and `RetryFailedTrialCallback` (which enqueues) are not used:
  two processes on SQLite can both start one WAITING trial (Optuna claims it
  with SELECT ... FOR UPDATE, which SQLite ignores). A dead trial's config goes
  back to the sampler instead.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from autotune.errors import SearchError
from autotune.samplers import SpaceView, config_key
from autotune.storage import OWNER, Heartbeat, counts_toward_budget, reap_dead

OUTCOMES = ("ok", "invalid", "compile_error", "wrong_result", "less_accurate", "launch_error", "timeout")
WAIT_S = 0.5  # how often a runner whose budget is all in flight looks again
DECIDE_POLL_S = 0.05  # how often a claim looks again for later claims to decide
REAP_EVERY_S = 2.0  # how often a waiting claim looks for dead processes

# Optuna logs each study created and each trial told at INFO: a line per trial.
optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_name(prefix: str, target: str, op: str, backend: str, dtype: str, shape: str) -> str:
    return f"{prefix}{target}:{op}:{backend}:{dtype}:{shape}"


# Ends the name of a study whose space keeps its lower-precision values (search --lower-precision).
LOWER_PRECISION_SUFFIX = ":lower-precision"


def _claims(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Live trials that hold a config: each may be measuring it or about to."""
    return [t for t in trials if t.state == TrialState.RUNNING and "config" in t.user_attrs]


WAIT = object()  # StudyRunner.poll: the rest of the budget is in flight; look again soon


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
    heartbeat: Heartbeat | None = None
    known: dict = field(default_factory=dict)  # measured_elsewhere()
    # The process that writes the CSV rows of this runner's outcomes, where it is not the one asking
    # (autotune.asking): an outcome's trial becomes its, so a search copies an outcome's row into its
    # CSV (Search._copy_missing_rows) only once the process that was to record it has died.
    recorder: str | None = None
    invalid: int = 0
    reused: int = 0
    ended: str = ""  # why the study ended before its budget

    def __post_init__(self) -> None:
        self._valid = None if self.view.valid is None else {config_key(c) for c in self.view.valid}
        # A trial from before a tunable existed measured that tunable's default (Space.with_defaults).
        self._complete = self.view.space.with_defaults if self.view.space is not None else dict
        # A sampler that suggests each tunable on its own hits a valid config once in 1 / density
        # suggestions (the valid share of the product of the values it draws from): 10 / density in
        # a row all invalid has a chance of e^-10, however sparse the space (a union of kernels,
        # each with tunables the other fixes). Invalid suggestions cost a rule check, no compile.
        self.patience = max(50, 2 * self.budget)
        if self.view.valid:
            product = math.prod(len(values) for values in self.view.values.values())
            self.patience = max(self.patience, math.ceil(10 * product / len(self.view.valid)))

    def measured(self) -> int:
        """Finished trials that count toward the budget, from every process."""
        with self.lock:
            return sum(counts_toward_budget(t) for t in self.study.get_trials(deepcopy=False))

    def _done_keys(self, trials) -> set[tuple]:
        return {self._key(t) for t in trials if counts_toward_budget(t)} | set(self.known)

    def _key(self, trial) -> tuple:
        """The key of the config `trial` claimed or measured."""
        return config_key(self._complete(trial.user_attrs["config"]))

    def _exhausted(self, done: set[tuple]) -> bool:
        if self._valid is None or not self._valid <= done:
            return False
        self.ended = f"all {len(self._valid)} valid configs measured"
        return True

    def left(self) -> int:
        """Configs the study still needs measured: the budget not yet finished, capped by the
        valid configs not yet measured. Trials in flight elsewhere are not deducted: their
        processes may die: next_candidate waits for them, poll answers WAIT."""
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
            candidate = self.poll()
            if candidate is not WAIT:
                return candidate
            if stop.wait(WAIT_S):
                return None

    def poll(self):
        """The next config to measure, None when the budget or the space is used up, or WAIT
        while the rest of the budget is in flight."""
        with self.lock:
            return self._next_or_wait()

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
                    self._valid is not None and self._valid <= done | {self._key(t) for t in claims}):
                reap_dead(self.study)  # what is in flight may fill the budget, or may be dead
                return WAIT
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
                    return WAIT
                if verdict == "reuse":
                    self._reuse(trial, *previous)
                else:  # "in flight": its result reaches the sampler when the trial measuring it ends
                    self._drop(trial)
            streak += 1
            if streak >= self.patience:
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
                if counts_toward_budget(t) and self._key(t) == key:
                    return "reuse", (t.number, t)
            if key in self.known:
                return "reuse", self.known[key]
            others = [t for t in _claims(trials) if t.number != trial.number]
            ahead = [t for t in others if t.number < trial.number or t.user_attrs.get("measuring")]
            if any(self._key(t) == key for t in ahead):
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

    def complete(self, candidate: Candidate, result: dict) -> bool:
        """Tells the study a candidate's outcome; True when it counts toward the budget (not
        `invalid`, and not failed meanwhile by another process that took this one for dead)."""
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

    def _finish(self, trial: optuna.Trial, config: dict, result: dict) -> bool:
        row = self.make_row(config, result, trial.number)
        return self._tell(trial, result["status"], row, result.get("time_ms")) and result["status"] != "invalid"

    def _tell(self, trial: optuna.Trial, status: str, row: dict, value: float | None, record: bool = True) -> bool:
        # The outcome before the state, the state before the CSV: a kill in between leaves a
        # RUNNING trial that is reaped and redone, or a finished one whose row the next run
        # copies into the CSV (Search._copy_missing_rows), never a CSV row the study lacks.
        if self.heartbeat:
            self.heartbeat.discard(trial)
        try:
            if record and self.recorder:
                trial.set_user_attr("owner", self.recorder)
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
            return False
        if record:
            self.record(row)
        return True


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
