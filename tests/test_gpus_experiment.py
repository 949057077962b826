"""experiments.gpus end to end on the CPU: the fake backend's matmul on a tiny workload, its
"GPUs" two worker slots on the host, so the steps, the judging and the spread run as on a GPU
machine (the speed-up means nothing here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent


def gpus(tmp_path: Path, *args: str, search: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, AUTOTUNE_BACKENDS="fake=tests.fake_backend", TRITON_INTERPRET="1")
    flags = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--hidden", "16", "--batch-size", "8",
             "--trials", "5", *search]
    return subprocess.run([sys.executable, "-m", "experiments.gpus", "--out", str(tmp_path / "out"), "--results",
                           str(tmp_path), "--label", "t", "--gpus", "0,1", *args, "--", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # the tuner runs in subprocesses
def test_one_all_and_a_pair_measure_the_exact_budget_and_the_winners_are_timed_on_each_gpu(tmp_path):
    done = gpus(tmp_path, "--rounds", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = pd.read_csv(tmp_path / "gpus_t.csv")
    assert list(steps["step"]) == ["one", "all", "pair"] and list(steps["gpus"]) == [1, 2, 2]
    # 8 matmul studies of 5 configs each, in every step, the pair's two searches together included.
    assert (steps["measured"] == 8 * 5).all() and (steps["studies_not_exact"] == 0).all()
    assert (steps["configs_measured_twice"] == 0).all() and (steps["wall_s"] > 0).all()
    pair = [pd.read_csv(tmp_path / "out" / "pair" / f"gpu{g}" / "cpu" / "trials.csv") for g in (0, 1)]
    assert all(len(p[p["status"] != "invalid"]) > 0 for p in pair)  # both searches measured
    times = pd.read_csv(tmp_path / "gpus_spread_t.csv")
    assert set(times["gpu"]) == {0, 1} and (times["rounds"] == 2).all()
    assert (times["min_ms"] <= times["median_ms"]).all() and (times["median_ms"] <= times["max_ms"]).all()
    # Every study's all-GPU winner is timed on both GPUs; one's only where it differs.
    assert len(times[times["winner_of"] == "all"]) == 8 * 2
    assert "the speed of one" in done.stdout and "between repeats on one GPU" in done.stdout


def test_flags_the_experiment_sets_itself_are_refused(tmp_path):
    result = gpus(tmp_path, search=("--seed", "3"))
    assert result.returncode == 2 and "this command's to set" in result.stderr


def test_summary_names_the_studies_whose_two_winners_differ_beyond_the_noise():
    """The end-to-end test above meets such a study only on some draws of the fake timings (where
    it did, the summary's row.all was pandas' Series.all, not the column): here one always differs."""
    from experiments.gpus import summary

    steps = pd.DataFrame([{"step": s, "gpus": g, "wall_s": w, "measured": 10, "by_gpu": "{}", "studies_not_exact": 0,
                           "configs_measured_twice": 0} for s, g, w in (("one", 1, 20.0), ("all", 2, 11.0))])
    rows = [("matmul", "fake", "fp32", "16x16x8:nn", "all", 0.010), ("matmul", "fake", "fp32", "16x16x8:nn", "one", 0.010),
            ("matmul", "fake", "fp32", "16x10x8:tn", "all", 0.010), ("matmul", "fake", "fp32", "16x10x8:tn", "one", 0.013)]
    times = pd.DataFrame([{"op": op, "backend": b, "dtype": dt, "shape": sh, "winner_of": src, "gpu": gpu,
                           "median_ms": ms, "min_ms": ms * 0.99, "max_ms": ms * 1.01, "rounds": 3}
                          for op, b, dt, sh, src, ms in rows for gpu in (0, 1)])
    lines = summary(steps, times)
    assert lines[0].startswith("2 GPUs: 1.82x the speed of one")
    assert "studies whose two winners differ: 2; by more than that noise: 1" in lines[2]
    assert lines[2].endswith("matmul fake 16x10x8:tn: one's winner / all's = 1.300")
