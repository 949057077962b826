"""A study's asks made in a compile process, through the storage the search shares.

An ask is a trial's dearest bookkeeping: the sampler, then a dozen round trips to the storage (the
trial, its parameters, the claim) and reads of the study's trials, 25-45 ms of one core each
(experiments/FINDINGS.md, "Tuner pipeline: compile pool and timing process"). Made by the search
process for every compile process, the asks capped the pipeline near 12 trials a second on the H200
whatever its cores. So each compile process asks for the configs it is about to compile itself,
as the processes of several machines already share a study: StudyRunner's claims keep the budget
exact and no config measured twice whichever process asks, and each process opens the study once,
with a sampler seeded for it.

The search process then takes the trial over (its owner and heartbeat): a compile process restarted
after a hang does not take the configs it handed out down with it.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import optuna

from autotune.samplers import make_sampler, view_space
from autotune.storage import Heartbeat, measured_elsewhere, open_storage
from autotune.studies import WAIT, StudyRunner
from kernels_core import backends
from kernels_core.contract import DTYPES
from kernels_core.provenance import utc_now
from kernels_core.targets import TARGETS


@dataclass(frozen=True)
class StudySpec:
    """What another process needs to open a study's runner as the search opened it."""

    storage: str  # the URL
    name: str
    key: str  # the name without --study-prefix: other prefixes' studies of the same call share results
    target: str
    backend: str
    op: str
    dtype: str
    lower_precision: bool
    sampler: str
    budget: int
    ordinal: bool
    parallel: bool

    def to_json(self) -> dict:
        return asdict(self)


def runner_parts(spec: StudySpec, target, space, sampler_seed: int | None):
    """The view, sampler and rule check of a study's runner: the search's and a compile process's."""
    elt = DTYPES[spec.dtype].itemsize
    view = view_space(space, target, elt, spec.lower_precision)
    sampler = make_sampler(spec.sampler, sampler_seed, view.values, parallel=spec.parallel, valid=view.valid,
                           families=space.families)
    return view, sampler, lambda config: target.target_violation(space, config, elt)


class Asker:
    """The studies this process asks for configs, each opened on its first ask."""

    def __init__(self):
        self.storage = self.heartbeat = None
        self.runners: dict[str, StudyRunner] = {}
        self.lock = threading.Lock()  # the runners' lock: only the heartbeat's thread runs beside the asks

    def ask(self, spec: StudySpec, sampler_seed: int | None, row: dict, recorder: str) -> dict:
        """The study's next config, as {"asked": "trial", "number", "trial_id", "config"}, "wait" (the
        rest of its budget is in flight) or "none" (with why it ended, if early); "rows" are the
        invalid suggestions told on the way, each `row` with its config, outcome and trial number,
        for `recorder` (the search process: autotune.storage.OWNER) to write to its CSV."""
        runner = self.runners.get(spec.name) or self._open(spec, sampler_seed)
        runner.recorder = recorder
        told: list[dict] = []
        runner.make_row = lambda config, result, number: {
            **row, **config, "status": result["status"], "error": result.get("error"), "trial": number,
            "utc": utc_now()}
        runner.record = told.append
        invalid, reused = runner.invalid, runner.reused
        candidate = runner.poll()
        answer = {"rows": told, "invalid": runner.invalid - invalid, "reused": runner.reused - reused}
        if candidate is WAIT:
            return {**answer, "asked": "wait"}
        if candidate is None:
            return {**answer, "asked": "none", "ended": runner.ended}
        self.heartbeat.discard(candidate.trial)  # the search process's heartbeat keeps it from now on
        return {**answer, "asked": "trial", "number": candidate.trial.number, "trial_id": candidate.trial._trial_id,
                "config": candidate.config}

    def _open(self, spec: StudySpec, sampler_seed: int | None) -> StudyRunner:
        if self.storage is None:
            self.storage = open_storage(spec.storage, one_connection=True)
            self.heartbeat = Heartbeat(self.storage)
        target, space = TARGETS[spec.target], backends.load(spec.backend).space(spec.op, spec.dtype)
        view, sampler, check = runner_parts(spec, target, space, sampler_seed)
        study = optuna.load_study(study_name=spec.name, storage=self.storage, sampler=sampler)
        known = measured_elsewhere(self.storage, spec.name, spec.key, space.with_defaults)
        runner = StudyRunner(study, view, spec.budget, check, make_row=None, ordinal=spec.ordinal, lock=self.lock,
                             heartbeat=self.heartbeat, known=known)
        self.runners[spec.name] = runner
        return runner


_asker: Asker | None = None  # this process's


def ask(spec: dict, sampler_seed: int | None, row: dict, recorder: str) -> dict:
    """Asker.ask on this process's studies: what a compile process answers to the search's `ask`."""
    global _asker
    _asker = _asker or Asker()
    return _asker.ask(StudySpec(**spec), sampler_seed, row, recorder)
