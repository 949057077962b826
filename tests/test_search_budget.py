"""experiments.search_budget end to end on the CPU: the fake backend's matmul on a tiny
workload, a default budget of 1 against a long run, a run cut short and resumed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
# Seed 0's first uniform pick is the fake matmul's fastest config; seed 2's is not, so a default
# budget of one config leaves the long run something to find.
FLAGS = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--hidden", "16", "--batch-size", "8", "--seed", "2"]


def budget(tmp_path: Path, *args: str, search: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, AUTOTUNE_BACKENDS="fake=tests.fake_backend", TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "experiments.search_budget", "--out", str(tmp_path / "out"),
                           "--results", str(tmp_path), "--label", "t", *args, "--", *FLAGS, *search],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # the tuner runs in subprocesses
def test_the_default_winner_is_judged_against_the_long_run_after_retiming(tmp_path):
    cut = budget(tmp_path, "--default-trials", "1", "--long-trials", "12", "--seconds", "0.5")
    assert cut.returncode == 3 and "run again to resume" in cut.stdout, cut.stdout + cut.stderr
    done = budget(tmp_path, "--default-trials", "1", "--long-trials", "12", "--rounds", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    runs = pd.read_csv(tmp_path / "out" / "search_budget_runs.csv")
    assert list(runs["step"]) == ["default", "default", "long"] and list(runs["rc"])[1:] == [0, 0]
    table = pd.read_csv(tmp_path / "search_budget_t.csv")
    assert len(table) == 8 and (table["default_trials"] == 1).all() and (table["long_trials"] == 12).all()
    # The long run's best of 12 is at least as fast, as recorded, as the first config it resumed from.
    assert (table["long_ms"] <= table["default_ms"]).all()
    differ = table[table["default_config"] != table["long_config"]]
    assert len(differ) > 0 and differ["default_retimed_ms"].notna().all() and differ["long_retimed_ms"].notna().all()
    ratio = differ["default_retimed_ms"] / differ["long_retimed_ms"]
    assert ((differ["ratio"] - ratio).abs() <= 1e-5 * ratio).all()  # the CSV keeps 6 digits
    same = table[table["default_config"] == table["long_config"]]
    assert (same["ratio"] == 1.0).all() and same["default_retimed_ms"].isna().all()
    assert (table["within_3pct"] == (table["ratio"] <= 1.03)).all()
    assert (table["long_budget"] == 12).all() and (table["default_wall_s"] > 0).all()
    kept = json.loads((tmp_path / "out" / "cpu" / "best_default.json").read_text())["entries"]
    assert {e["trials"] for e in kept} == {1}
    assert f"of {len(table)} studies" in done.stdout


def test_flags_the_experiment_sets_itself_are_refused(tmp_path):
    result = budget(tmp_path, "--long-trials", "5", search=("--trials", "3"))
    assert result.returncode == 2 and "--trials and --out are this command's to set" in result.stderr
