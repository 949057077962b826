"""The samplers a study can use, and a kernel's space as they see it.

Each tunable ranges over the values that appear in at least one valid config of the target
(view_space): as an index into its sorted values for the samplers that model order
(ORDINAL_SAMPLERS), as a categorical for the others. Optuna's GridSampler counts a failed
trial's point as visited and ends a study through `Study.stop`, which works only inside
`optimize`: _GridOrder walks the grid instead.
"""
from __future__ import annotations

import collections
import itertools
import random
import warnings
from dataclasses import dataclass

import numpy as np
import optuna
from optuna.trial import TrialState

from autotune.errors import SearchError
from kernels_core.targets import Target
from kernels_core.space import Space

SAMPLERS = ("tpe", "tpe-startup20", "tpe-ei64", "tpe-valid", "qmc", "random", "grid", "cmaes", "gp")
# The replay of the H200's three full grids picked it (experiments/FINDINGS.md, "Tuner samplers and search quality"): within 3% of each
# grid's best in 10% of the grid for 100 of 100 seeds on all three (tpe-ei64: 91-94), and the fewest asks.
DEFAULT_SAMPLER = "tpe-valid"
# Spaces whose product of values is at most this are enumerated to prune values and count valid
# configs (Space.configs walks them depth first, pruned by the rules, in 0.14 s on the CPU machine
# for the largest: the CUDA fp32 space's 1,512,000 combinations are three kernels' spaces side by
# side, 10,700 valid at sm_90).
ENUMERATE_LIMIT = 4_000_000

# Optuna calls QMCSampler experimental, and the storage's heartbeat and its reaper
# (autotune.storage): the tuner uses them on purpose.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

# Samplers that see tunables as ordered (an index into the sorted values) rather than as
# unordered categories. CMA-ES has no categorical support at all; for TPE, replaying the
# H200's measured grid (experiments/FINDINGS.md, "Tuner samplers and search quality") showed that knowing 64 lies between
# 32 and 128 lets it reach the best tiles in fewer trials than categories do. Sobol points
# spread over the indices cover small and large tiles alike; over categories they would not.
ORDINAL_SAMPLERS = ("tpe", "tpe-startup20", "tpe-ei64", "tpe-valid", "qmc", "cmaes", "gp")


def make_sampler(name: str, seed: int | None, values: dict[str, list[int]], *,
                 parallel: bool = False, valid: list[dict[str, int]] | None = None,
                 families: tuple[str, ...] = ()) -> optuna.samplers.BaseSampler:
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
        return _ValidTPE(values, valid, families, **ei64)
    if name == "qmc":
        # Scrambled, so each seed walks its own sequence; the first trial is the random sampler's
        # (QMCSampler learns the search space from it).
        return optuna.samplers.QMCSampler(qmc_type="sobol", scramble=True, seed=seed,
                                          independent_sampler=optuna.samplers.RandomSampler(seed=seed))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return _GridOrder(values, seed=seed, valid=valid)
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
    enumerated space (`valid` None) it is tpe-ei64. Where the space has `families` (Space.families:
    the tunables that pick a kernel), the study's first trials draw each a rare family no trial of the
    study holds yet, the first trial the first family: rare, one that TPE's uniform start would leave
    out more often than not (the CUDA fp32 wgmma kernel's 22 configs beside 9,364 others). A family of a fair share is
    left to the uniform draws: forcing every family in cost the common ones' searches more than it
    found (experiments/FINDINGS.md, "Tuner samplers and search quality").

    It overrides TPESampler._compute_acquisition_func, a private method (as of Optuna 5.0, the
    version on the GPU machine): tests/test_autotune_units.py fails if a release renames it.
    """

    REDRAWS = 8  # candidate batches with no valid, free config before a uniform one is taken

    def __init__(self, values: dict[str, list[int]], valid: list[dict[str, int]] | None,
                 families: tuple[str, ...] = (), **tpe):
        super().__init__(**tpe)
        self._space = {f"{n}#index": optuna.distributions.IntDistribution(0, len(v) - 1) for n, v in values.items()}
        index = {n: {v: i for i, v in enumerate(vs)} for n, vs in values.items()}
        self._valid = None if valid is None else frozenset(tuple(index[n][c[n]] for n in values) for c in valid)
        self._free: frozenset[tuple] = frozenset()  # valid and not taken, for the proposal under way
        self._pick = random.Random(tpe["seed"])
        self._at = [i for i, n in enumerate(values) if n in families]
        shares = collections.Counter(self._family(p) for p in self._valid or ())
        start = self._n_startup_trials
        self._rare = {f for f, n in shares.items() if len(shares) > 1 and (1 - n / len(self._valid)) ** start > 0.5}

    def _point(self, params: dict) -> tuple | None:
        return tuple(params[p] for p in self._space) if all(p in params for p in self._space) else None

    def infer_relative_search_space(self, study, trial):
        return super().infer_relative_search_space(study, trial) if self._valid is None else self._space

    def sample_relative(self, study, trial, search_space):
        if self._valid is None or not search_space:
            return super().sample_relative(study, trial, search_space)
        # Through the study's per-ask cache of its trials (a private method, as of Optuna 5.0), which
        # TPE's own sample_relative then reads: one round trip to the storage an ask fewer.
        trials = study._get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING),
                                   use_cache=True)
        taken = {self._point(t.params) for t in trials} - {None}
        self._free = self._valid - taken
        if not self._free:  # the study ends on its own; any valid config is a repeat
            self._free = self._valid
        for _ in range(self.REDRAWS):
            params = super().sample_relative(study, trial, search_space)  # {} during TPE's random start
            if self._point(params) in self._free:
                return params
            if not params:
                break
        return dict(zip(self._space, self._uniform(taken, trial.number)))

    def _family(self, point: tuple) -> tuple:
        return tuple(point[i] for i in self._at)

    def _uniform(self, taken: set[tuple], number: int) -> tuple:
        """A free point drawn uniformly: from a rare family no point `taken` is of, where this is the
        study's trial of that family's rank (0 for the first): compile processes ask a study at once,
        each before the others' configs are stored, and each would draw the family."""
        due = set(sorted(self._rare)[number:number + 1])
        untried = due - {self._family(p) for p in taken}
        pool = [p for p in self._free if self._family(p) in untried] if untried else []
        if pool:
            family = self._pick.choice(sorted({self._family(p) for p in pool}))
            return self._pick.choice(sorted(p for p in pool if self._family(p) == family))
        return self._pick.choice(sorted(self._free))

    def _compute_acquisition_func(self, samples, mpe_below, mpe_above):
        score = super()._compute_acquisition_func(samples, mpe_below, mpe_above)
        points = zip(*(samples[p].round().astype(int).tolist() for p in self._space))
        return np.where([point in self._free for point in points], score, -np.inf)


class _GridOrder(optuna.samplers.BaseSampler):
    """Every point of the grid in a shuffled order: the first one that no trial holds.
    A FAILed trial (dropped, interrupted, or its process died) measured nothing, so its
    point stays to visit; once all are held, any point (a repeat, which costs nothing).
    The grid is the valid configs where the space is enumerated (a union of kernels is a
    sparse product: CUDA's fp32 space holds 10,700 valid configs among 1,512,000 points), else
    the product of the values."""

    def __init__(self, values: dict[str, list[int]], seed: int | None = None, valid: list[dict] | None = None):
        self._points = ([dict(c) for c in valid] if valid is not None else
                        [dict(zip(values, combo)) for combo in itertools.product(*values.values())])
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


def view_space(space: Space, target: Target, elt: int, lower_precision: bool = False) -> SpaceView:
    """lower_precision: keep the values that compute below the dtype's precision (Space.lower_precision),
    which a search leaves out unless asked."""
    params = {k: tuple(v for v in values if lower_precision or v not in space.lower_precision.get(k, {}))
              for k, values in space.params.items()}
    if space.size() > ENUMERATE_LIMIT:
        return SpaceView(space, {k: list(v) for k, v in params.items()}, None, space.size())
    names = list(params)
    valid = [c for c in space.configs(elt, target.arch) if all(c[n] in params[n] for n in names)
             and target.cost_violation(space, c, elt) is None]  # configs() has judged the rules
    values = {n: [v for v in params[n] if any(c[n] == v for c in valid)] for n in names}
    return SpaceView(space, values, valid, space.size())


def config_key(config: dict) -> tuple:
    return tuple(sorted(config.items()))
