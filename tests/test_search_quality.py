"""The search-quality harness on the CPU: the grid measurement (a fake pool, no subprocess),
its resume and aggregation, the replay of every candidate sampler, the figures and the CLI."""
from __future__ import annotations

import itertools
import math

import optuna
import pandas as pd
import pytest
import torch

from autotune import search
from autotune.samplers import DEFAULT_SAMPLER, SAMPLERS, config_key, view_space
from experiments import search_quality as sq

VALUES = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [16, 32, 64], "num_warps": [2, 4]}
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def fake_grid(rng: torch.Generator, shapes=("64x64x64:nn", "128x64x32:nn"), drop: int = 4) -> pd.DataFrame:
    """A measured table over VALUES, fresh random times, with `drop` configs left out (as a
    target's rules or a sample leave them out) and one failure per shape."""
    combos = [dict(zip(VALUES, c)) for c in itertools.product(*VALUES.values())]
    rows = []
    for shape in shapes:
        keep = torch.randperm(len(combos), generator=rng)[drop:].tolist()
        times = (torch.rand(len(keep), generator=rng, dtype=torch.float64) + 0.1).tolist()
        for i, (index, t) in enumerate(zip(keep, times)):
            rows.append({"shape": shape, "backend": "triton", "dtype": "fp16", **combos[index],
                         "status": "launch_error" if i == 0 else "ok", "time_ms": None if i == 0 else t})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("sampler", [s for s in SAMPLERS if s not in ("cmaes", "gp")])
def test_every_candidate_sampler_measures_distinct_configs_and_never_gets_worse(rng, sampler):
    grid = fake_grid(rng, shapes=("64x64x64:nn",))
    curve = sq.replay(grid, list(VALUES), sampler, int(torch.randint(0, 2**31, (1,), generator=rng)), budget=12)
    assert 1 <= len(curve) <= 12
    assert all(later <= earlier for earlier, later in zip(curve, curve[1:]))
    assert curve[-1] >= grid["time_ms"].min()


def test_a_replay_with_budget_for_the_whole_grid_finds_its_best(rng):
    grid = fake_grid(rng, shapes=("64x64x64:nn",))
    curve = sq.replay(grid, list(VALUES), "grid", 3, budget=len(grid) + 10)
    assert len(curve) == len(grid)  # every config once, the failed one included, and then it ends
    assert curve[-1] == grid["time_ms"].min()


def test_the_tuner_runs_the_default_sampler_without_a_sampler_flag():
    assert search.parse_args([]).sampler == DEFAULT_SAMPLER in SAMPLERS


def test_seed_figures_and_the_summary_count_distinct_configs_to_each_target():
    curve = [2.0, 1.5, 1.5, 1.02, 1.02, 1.0] + [1.0] * 24  # a replay of 30 configs of a 100-config grid
    figures = sq.seed_figures(curve, 1.0, 30, 100)
    assert figures["to_3%"] == 4 and figures["to_1%"] == 6
    assert figures["best_at_20"] == figures["best_at_10%"] == 1.0  # 10%: after 10 configs
    assert math.isnan(figures["best_at_45"])  # past the budget: never measured
    short = sq.seed_figures([3.0, 2.0], 1.0, 30, 100)
    assert math.isnan(short["to_3%"]) and short["best_at_20"] == 2.0  # measured all it could: its last best
    early = sq.seed_figures([1.5, 1.2, 1.1, 1.0, 1.0], 1.0, 5, 100)
    assert math.isnan(early["best_at_10%"]) and early["to_3%"] == 4  # 10% of the grid is past its budget
    seeds = pd.DataFrame([{"shape": "s", "sampler": "x", "seed": i, "grid_configs": 100, **f}
                          for i, f in enumerate([figures] * 19 + [short])])
    assert sq.summarize(seeds).iloc[0]["median_best_at_10%"] == 1.0
    row = sq.summarize(seeds).iloc[0]
    assert row["budget_10pct"] == 10 and row["success_3%_in_budget"] == 0.95 and row["median_to_3%"] == 4
    assert row["meets_bar"]  # 95% of seeds, median 4% of the grid
    seeds.loc[seeds["seed"] == 0, ["to_3%", "to_1%"]] = math.nan
    assert not sq.summarize(seeds).iloc[0]["meets_bar"]  # one more miss: 90%


def test_aggregate_keeps_the_median_and_the_spread_and_fails_a_flaky_config():
    runs = pd.DataFrame([
        {"shape": "s", "BLOCK_M": 16, "repeat": r, "status": "ok", "error": None, "time_ms": t}
        for r, t in enumerate([1.0, 3.0, 2.0])] + [
        {"shape": "s", "BLOCK_M": 32, "repeat": r, "status": s, "error": e, "time_ms": t}
        for r, (s, e, t) in enumerate([("ok", None, 1.0), ("timeout", "slow", None), ("ok", None, 1.0)])])
    table = sq.aggregate(runs, ["BLOCK_M"]).set_index("BLOCK_M")
    assert table.loc[16, "time_ms"] == 2.0 and table.loc[16, "time_spread"] == 1.0 and table.loc[16, "repeats"] == 3
    assert (table.loc[16, "time_min_ms"], table.loc[16, "time_max_ms"]) == (1.0, 3.0)
    assert table.loc[32, "status"] == "timeout" and table.loc[32, "repeats"] == 2


class FakePool:
    """The Evaluator's interface: a random time per call, no subprocess."""
    calls = 0

    def __init__(self, target, workers, timeout, log_dir, bench=None):
        self.gen = torch.Generator().manual_seed(FakePool.seed)

    def __len__(self):
        return 2

    def evaluate(self, index, call, backend, config, seed):
        FakePool.calls += 1
        return {"status": "ok", "time_ms": float(torch.rand(1, generator=self.gen)) + 0.1, "gpu": None}

    def close(self):
        pass


def test_the_full_grid_is_timed_repeats_times_and_a_rerun_measures_only_what_is_missing(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")
    monkeypatch.setattr(sq, "Evaluator", FakePool)
    FakePool.seed, FakePool.calls = int(torch.randint(0, 2**31, (1,), generator=rng)), 0
    argv = ["--backend", "fake", "--target", "cpu", "--full-grid", "--shapes", "32x32x32,64x32x16",
            "--samplers", "tpe,random", "--seeds", "2", "--out", str(tmp_path), "--label", "fake"]
    assert sq.main([*argv, "--repeats", "2"]) in (0, 1)  # 1: the bar missed on a random table
    valid = len(view_space(sq.backends.space("fake", "matmul", "fp32"), sq.TARGETS["cpu"], 2).valid)
    assert FakePool.calls == 2 * 2 * valid
    assert sq.main([*argv, "--repeats", "3", "--measure-only"]) == 0
    assert FakePool.calls == 3 * 2 * valid  # the third repeat only
    runs = pd.read_csv(tmp_path / "search_quality_grid_fake_runs.csv")
    assert len(runs) == 3 * 2 * valid and sorted(runs["repeat"].unique()) == [0, 1, 2]
    grid = pd.read_csv(tmp_path / "search_quality_grid_fake.csv")
    assert len(grid) == 2 * valid and (grid["repeats"] == 3).all() and (grid["time_spread"] >= 0).all()
    assert {"time_min_ms", "time_max_ms"} <= set(grid.columns) and "repeat" not in grid.columns
    for suffix in (".csv", "_seeds.csv", "_summary.csv", ".png"):
        assert (tmp_path / f"search_quality_fake{suffix}").exists()
    summary = pd.read_csv(tmp_path / "search_quality_fake_summary.csv")
    assert len(summary) == 4 and set(summary["sampler"]) == {"tpe", "random"}


def test_the_replay_reads_a_grid_timed_once_that_lacks_a_tunable(tmp_path, rng, capsys):
    """The committed H200 table predates SPLIT_K: it is replayed over the tunables it has."""
    path = tmp_path / "search_quality_grid_old.csv"
    fake_grid(rng).to_csv(path, index=False)
    grid, tunables, backend, dtype = sq.load_grid(path)
    assert (backend, dtype) == ("triton", "fp16") and tunables == ["BLOCK_M", "BLOCK_N", "num_warps"]
    assert "no BLOCK_K, GROUP_M, num_stages, SPLIT_K column" in capsys.readouterr().out
    assert sq.main(["--grid-csv", str(path), "--samplers", "random", "--seeds", "2", "--out", str(tmp_path)]) == 0
    seeds = pd.read_csv(tmp_path / "search_quality_old_seeds.csv")
    assert len(seeds) == 4 and (seeds["best_at_10%"] >= 1).all()  # 10% of 20 configs: 2, in a budget of 6
    assert seeds["best_at_20"].isna().all()  # past the budget


def test_budget_shares_round_down_to_whole_configs():
    assert [sq.budget_of(0.1, n) for n in (888, 860, 9)] == [88, 86, 1]
    assert sq.budget_of(0.29, 100) == 29 and sq.budget_of(0.3, 10) == 3 and sq.budget_of(1.0, 7) == 7


def test_each_replay_measures_exactly_its_budget(rng):
    grid = fake_grid(rng)  # 20 configs a shape
    curves, seeds = sq.run_replays(grid, list(VALUES), ["random", "tpe-valid"], 3, 0.35)
    assert set(seeds["grid_configs"]) == {20}
    assert (curves.groupby(["shape", "sampler", "seed"])["trial"].max() == 7).all()  # 35% of 20


def test_a_summary_cut_at_a_smaller_budget_is_that_budgets_replay(rng):
    grid = fake_grid(rng, drop=int(torch.randint(0, 8, (1,), generator=rng)))
    samplers = ["random", "tpe-valid", "grid"]
    curves, _ = sq.run_replays(grid, list(VALUES), samplers, 3, 0.9)
    seeds = sq.run_replays(grid, list(VALUES), samplers, 3, 0.5)[1]
    cut = sq.summary_at(curves, seeds, 0.5)
    pd.testing.assert_frame_equal(cut, sq.summarize(seeds))


GRID_CUDA = sq.RESULTS / "h200" / "search_quality_grid_cuda_fp32_full.csv"


def test_a_replay_takes_the_grids_backend_and_dtype(tmp_path, capsys):
    """The H200's CUDA fp32 grid, replayed without --backend and --dtype: over its own space's
    tunables, THREAD_M and THREAD_N among them, so each of its 888 configs stays one; it predates
    the TF32 and WGMMA tunables (and the tensor cores' num_warps in the fp32 space), and says so."""
    assert sq.main(["--grid-csv", str(GRID_CUDA), "--samplers", "random", "--seeds", "2", "--budget", "0.013",
                    "--out", str(tmp_path)]) in (0, 1)  # 1: random misses the bar
    out = capsys.readouterr().out
    assert "no num_warps, TF32, WGMMA column (measured before it existed)" in out and "THREAD_M" not in out
    curves = pd.read_csv(tmp_path / "search_quality_cuda_fp32_full.csv")
    assert (curves.groupby("seed")["trial"].max() == 11).all()  # 1.3% of 888, rounded down
    grid, tunables, backend, dtype = sq.load_grid(GRID_CUDA)
    assert (backend, dtype) == ("cuda", "fp32") and {"THREAD_M", "THREAD_N"} <= set(tunables)
    assert len({config_key({t: int(r[t]) for t in tunables}) for _, r in grid.iterrows()}) == len(grid) == 888


@pytest.mark.parametrize("flags, words", [(["--backend", "triton"], "measured with backend cuda, not --backend triton"),
                                          (["--dtype", "fp16"], "measured with dtype fp32, not --dtype fp16")])
def test_a_replay_refuses_a_backend_or_dtype_its_grid_was_not_measured_with(tmp_path, capsys, flags, words):
    assert sq.main(["--grid-csv", str(GRID_CUDA), *flags, "--seeds", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("search_quality: error: ") and words in err
    assert not list(tmp_path.iterdir())
    assert sq.main(["--grid-csv", str(GRID_CUDA), "--backend", "cuda", "--dtype", "fp32", "--samplers", "random",
                    "--seeds", "1", "--budget", "0.005", "--out", str(tmp_path)]) in (0, 1)  # the grid's own: fine


@pytest.mark.parametrize("argv, message", [
    (["--samplers", "tpe,bogus"], "unknown bogus"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--grid-csv", "/nonexistent.csv"], "no such file"),
    (["--grid-csv", "/nonexistent.csv", "--measure-only"], "pass one of them"),
])
def test_bad_flags_are_refused_with_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        sq.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
