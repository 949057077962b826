"""`python -m autotune.search` end to end, as a user runs it, on tiny shapes.

The fake backend (tests/fake_backend.py) provides configs that fail in every
way a real kernel can; the real Triton backend runs under the interpreter.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch

from autotune.storage import counts_toward_budget
from kernels_core.store import ConfigStore, load_store, save_store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fake_registered(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")  # for load_store in this process


def env(**extra) -> dict:
    e = dict(os.environ, AUTOTUNE_BACKENDS="fake=tests.fake_backend", TRITON_INTERPRET="1", **extra)
    e.pop("KERNEL_TEST_SEED", None)
    return e


def cli(tmp_path: Path, *args: str) -> list[str]:
    storage = [] if "--compile-only" in args else ["--storage", f"sqlite:///{tmp_path / 'tuning.db'}"]  # it keeps no study
    return [sys.executable, "-m", "autotune.search", "--out", str(tmp_path / "out"), *storage, *args]


def search(tmp_path: Path, *args: str, timeout: float = 180, **extra) -> subprocess.CompletedProcess:
    result = subprocess.run(cli(tmp_path, *args), cwd=REPO, env=env(**extra), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def trials(tmp_path: Path, target: str = "cpu") -> pd.DataFrame:
    return pd.read_csv(tmp_path / "out" / target / "trials.csv")


def counted(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[rows["status"] != "invalid"]


def this_run(stdout: str) -> tuple[int, int]:
    """(trials measured, suggestions of measured configs told their results) from the summary."""
    found = re.search(r"This run: (\d+) trials measured, (\d+) suggestions of configs measured before", stdout)
    assert found, stdout
    return int(found[1]), int(found[2])


@pytest.mark.slow  # the tuner in subprocesses
def test_every_failure_is_recorded_and_the_search_finishes(tmp_path):
    # The default config (BLOCK=64) 5 ms slower than the other that runs: the winner beats it.
    out = search(tmp_path, "--target", "cpu", "--backends", "fake", "--ops", "relu", "--dtypes", "fp32",
                 "--shapes", "32x64", "--sampler", "grid", "--trials", "20", "--timeout", "3", FAKE_RELU_DEFAULT_MS="5")
    rows = trials(tmp_path)
    by_mode = {int(r.MODE): r for r in rows.itertuples()}
    assert len(rows) == 10 and set(rows["BLOCK"]) == {64, 128}  # BLOCK=256 breaks the fp32 rule: never tried
    status = rows.groupby("MODE")["status"].agg(set).to_dict()
    assert status == {0: {"ok"}, 1: {"compile_error"}, 2: {"wrong_result"}, 3: {"timeout"}, 4: {"launch_error"}}
    assert "ptxas" in by_mode[1].error and "relative error" in by_mode[2].error
    assert "no answer within 3 s" in by_mode[3].error and "exit code 9" in by_mode[4].error
    ok = rows[rows["status"] == "ok"]
    assert (ok["time_ms"] > 0).all() and ok["speedup_vs_default"].notna().all() and ok["speedup_vs_torch"].notna().all()
    assert (ok["metric"] == "gbps").all() and ok["gbps"].notna().all() and ok["commit"].notna().all()
    assert rows["study"].eq("cpu:relu:fake:fp32:32x64").all() and sorted(rows["trial"]) == list(range(10))
    best = load_store(tmp_path / "out" / "cpu" / "best.json", "cpu")
    config, source = best.lookup("relu", "fake", "fp32", "32x64")
    assert source == "tuned" and config["MODE"] == 0 and config["BLOCK"] == 128
    raw = json.loads((tmp_path / "out" / "cpu" / "best.json").read_text())["entries"][0]
    assert raw["trials"] == 10 and raw["failures"] == {"compile_error": 2, "wrong_result": 2, "timeout": 2,
                                                       "launch_error": 2}
    # The CSV holds the float's shortest round-trip text, which pandas before 3.0 parses to within
    # an ulp, not exactly (the H200's pandas read one time 1 ulp off best.json's).
    assert raw["time_ms"] == pytest.approx(ok["time_ms"].min(), rel=1e-15, abs=0) and raw["provenance"]["python"]
    assert "compile_error:2" in out.stdout and "relu" in out.stdout  # the summary table
    assert "all 10 valid configs measured" in out.stdout  # budget 20: the study ended early, and says so


@pytest.mark.slow  # the tuner in subprocesses
def test_lower_precision_is_tried_only_when_asked_and_emulation_must_match_the_default(tmp_path):
    """The fake matmul with the twins' TF32 tunable: TF32 = 1 (tf32, 3e-3 off) is left out of a
    search unless --lower-precision asks for it, and then passes at tf32's tolerance, in studies
    of their own; TF32 = 3 (emulated) must be as accurate as the default config on the same
    inputs, and trials.csv shows both errors."""
    args = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes", "16x16x16",
            "--sampler", "grid", "--trials", "80"]
    search(tmp_path, *args, FAKE_TF32="1", FAKE_TF32X3_REL="1e-5")
    rows = counted(trials(tmp_path))
    assert set(rows["TF32"]) == {0, 3} and len(rows) == 52  # every valid config but the lower-precision ones
    exact, emulated = rows[rows["TF32"] == 0], rows[rows["TF32"] == 3]
    assert (exact["status"] == "ok").all() and exact["default_rel_err"].isna().all()
    assert (emulated["status"] == "less_accurate").all()
    assert emulated["error"].str.contains("above the exact default config's").all()
    assert (emulated["rel_err"] > emulated["default_rel_err"]).all() and (emulated["default_rel_err"] < 1e-6).all()

    search(tmp_path, *args, "--lower-precision", FAKE_TF32="1")
    rows = counted(trials(tmp_path))
    lower = rows[rows["study"] == "cpu:matmul:fake:fp32:16x16x16:nn:lower-precision"]
    assert len(lower) == 78 and set(lower["TF32"]) == {0, 1, 3} and (lower["status"] == "ok").all()
    assert (lower.loc[lower["TF32"] == 1, "rel_err"] > 2e-3).all()  # beyond fp32's tolerance, within tf32's
    emulated = lower[lower["TF32"] == 3]
    assert (emulated["rel_err"] <= emulated["default_rel_err"]).all()
    assert len(rows) == 52 + 78  # the first search's study is its own


@pytest.mark.slow  # the tuner in subprocesses
def test_a_lower_precision_entry_is_no_incumbent_of_an_exact_study(tmp_path, monkeypatch):
    """best.json holds a plain TF32 config (from a --lower-precision run) at the fake matmul's fastest
    tiles; a search at the dtype's own precision neither times it as the entry to beat nor keeps it."""
    monkeypatch.setenv("FAKE_TF32", "1")
    store = ConfigStore("cpu")
    store.put({"op": "matmul", "backend": "fake", "dtype": "fp32", "shape": "16x16x16:nn",
               "config": {"BLOCK_M": 32, "BLOCK_N": 64, "SPLIT": 1, "TF32": 1}})
    save_store(tmp_path / "out" / "cpu" / "best.json", store)
    search(tmp_path, "--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes",
           "16x16x16", "--trials", "3", FAKE_TF32="1")
    entry = load_store(tmp_path / "out" / "cpu" / "best.json", "cpu").entries[("matmul", "fake", "fp32", "16x16x16:nn")]
    assert entry["config"]["TF32"] != 1 and "trial" in entry


@pytest.mark.slow  # the tuner in subprocesses
def test_a_tunable_added_since_a_study_ran_takes_its_default_in_its_old_trials(tmp_path, monkeypatch):
    """A study resumed after its space gained a tunable (the fake matmul's TF32): its earlier trials
    ran that tunable's default, so none of them is measured again, and the store the first run
    wrote, without the tunable, still loads."""
    args = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes", "16x16x16",
            "--sampler", "grid", "--seed", "3"]
    search(tmp_path, *args, "--trials", "8")
    first = tmp_path / "first.json"
    shutil.copy(tmp_path / "out" / "cpu" / "best.json", first)
    search(tmp_path, *args, "--trials", "20", FAKE_TF32="1")
    rows = counted(trials(tmp_path))
    configs = rows[["BLOCK_M", "BLOCK_N", "SPLIT"]].assign(TF32=rows["TF32"].fillna(0).astype(int))
    assert len(rows) == 20 and not configs.duplicated().any(), configs
    monkeypatch.setenv("FAKE_TF32", "1")
    assert load_store(first, "cpu").lookup("matmul", "fake", "fp32", "16x16x16:nn")[0]["TF32"] == 0
    load_store(tmp_path / "out" / "cpu" / "best.json", "cpu")


@pytest.mark.slow  # the tuner in subprocesses
@pytest.mark.parametrize("workers", [0, 2])  # the timing process fails, or each compile process
def test_a_lost_gpu_stops_the_search_after_failures_in_a_row_not_at_the_budget(tmp_path, workers):
    args = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes",
            "16x16x16", "--sampler", "random", "--trials", "20", "--max-failures-in-a-row", "3",
            "--workers", str(workers)]
    result = subprocess.run(cli(tmp_path, *args), cwd=REPO, env=env(FAKE_LOST_GPU="1"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr  # the flags were fine; the run cannot go on
    assert "no worker left to run trials" in result.stderr and "3 trials in a row ended launch_error" in result.stderr
    failing = max(workers, 1)
    set_aside = [line for line in result.stderr.splitlines() if line.endswith("it gets no more trials")]
    assert len(set_aside) == failing and all(("compile worker" if workers else "timing worker") in line
                                              for line in set_aside)
    rows = counted(trials(tmp_path))
    assert set(rows["status"]) == {"launch_error"}
    assert len(rows) == 3 * failing  # each worker's 3 in a row, then none
    # The trials are saved: the search resumes from them once the GPU is back.
    search(tmp_path, *args[:-4])
    after = counted(trials(tmp_path))
    assert len(after) == 20 and (after["status"] == "ok").sum() == 20 - len(rows)


@pytest.mark.slow  # the tuner in subprocesses
@pytest.mark.parametrize("workers", [0, 2])
def test_the_compile_pool_compiles_each_config_once_and_the_timing_process_none(tmp_path, workers):
    """Several studies through the pipeline (two compile processes, one timing process) or without it
    (the timing process compiles): each study measures exactly its budget, no config twice, every
    row carries its study's baselines, and every config was compiled once, by the compile pool
    when there is one (the fake backend's disk cache says who compiled each)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    out = search(tmp_path, "--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32",
                 "--shapes", "16x16x16,8x24x40,16x8x8", "--sampler", "random", "--trials", "5", "--workers", str(workers),
                 FAKE_COMPILE_S="0.2", FAKE_CACHE_DIR=str(cache))
    rows = counted(trials(tmp_path))
    assert rows.groupby("study").size().tolist() == [5, 5, 5] and set(rows["status"]) == {"ok"}
    assert not rows.duplicated(["study", "BLOCK_M", "BLOCK_N", "SPLIT"]).any()
    assert rows["default_ms"].notna().all() and rows["torch_ms"].notna().all()
    configs = {f"matmul-BLOCK_M{r.BLOCK_M}-BLOCK_N{r.BLOCK_N}-SPLIT{r.SPLIT}" for r in rows.itertuples()}
    compiled = {p.name: p.read_text() for p in cache.iterdir()}
    assert configs <= set(compiled) and set(compiled.values()) == {"compile_only" if workers else "call"}
    assert f"{'2 compile processes' if workers else 'no compile pool'}, 1 timing process" in out.stdout
    assert re.search(r"Tuning took [\d.]+ s: [\d.]+ trials a second", out.stdout)


@pytest.mark.slow  # the tuner in subprocesses
def test_the_default_out_and_storage_work_from_any_directory_through_the_compile_pool(tmp_path):
    """As a user types it: no --out, no --storage, run from their own directory. The compile processes,
    which run in the repository's directory and ask the studies for configs, open the search's
    database under ./experiments, not one of their own."""
    cache = tmp_path / "cache"
    cache.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    argv = [sys.executable, "-m", "autotune.search", "--target", "cpu", "--backends", "fake", "--ops", "matmul",
            "--dtypes", "fp32", "--shapes", "16x16x16,8x24x40", "--sampler", "random", "--trials", "4",
            "--workers", "2"]
    done = subprocess.run(argv, cwd=work, env=env(FAKE_COMPILE_S="0.05", FAKE_CACHE_DIR=str(cache), PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = counted(pd.read_csv(work / "experiments" / "cpu" / "trials.csv"))
    assert rows.groupby("study").size().tolist() == [4, 4] and set(rows["status"]) == {"ok"}
    assert (work / "experiments" / "tuning.db").is_file()


@pytest.mark.slow  # the tuner in subprocesses
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_sigkill_redoes_nothing(tmp_path, workers):
    args = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32",
            "--shapes", "16x16x16", "--sampler", "random", "--trials", "10", "--seed", "3", "--workers", str(workers)]
    csv = tmp_path / "out" / "cpu" / "trials.csv"
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = subprocess.Popen(cli(tmp_path, *args), cwd=REPO, env=env(FAKE_COMPILE_S="0.7", FAKE_CACHE_DIR=str(cache)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if csv.exists() and len(counted(pd.read_csv(csv))) >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the search wrote no trials in 120 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first = counted(pd.read_csv(csv))
    assert 3 <= len(first) < 10
    out = search(tmp_path, *args)
    rows = trials(tmp_path)
    assert not rows.duplicated(["study", "trial"]).any()
    measured = counted(rows)
    assert len(measured) == 10 and "reused_from" not in rows  # a repeat is never a trial, nor a row
    assert not measured.duplicated(["BLOCK_M", "BLOCK_N", "SPLIT"]).any()  # nothing measured twice
    # The same seed replays the random sampler's first suggestions: told their results, at no cost.
    now, told = this_run(out.stdout)
    assert now == 10 - len(first) and told >= len(first)
    kept = measured.merge(first[["trial", "utc"]], on=["trial", "utc"])
    assert len(kept) == len(first)  # the first run's rows stand as they were

    # A kill between the study write and the CSV write: the next run restores the row.
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text("".join(lines[:-1]))
    out = search(tmp_path, *args)
    assert len(trials(tmp_path)) == len(rows) and this_run(out.stdout) == (0, 0)
    study = optuna.load_study(study_name="cpu:matmul:fake:fp32:16x16x16:nn", storage=f"sqlite:///{tmp_path / 'tuning.db'}")
    # None left RUNNING with an owner (a kill between `ask` and the owner's write leaves one
    # without: it holds no claim, autotune.storage.reap_dead).
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING and "owner" in t.user_attrs]
    assert load_store(tmp_path / "out" / "cpu" / "best.json", "cpu").lookup(
        "matmul", "fake", "fp32", "16x16x16:nn")[1] == "tuned"


@pytest.mark.slow  # the tuner in subprocesses
def test_a_re_tune_keeps_the_store_entry_its_winner_does_not_beat(tmp_path):
    """A study's winner replaces best.json's entry for its call only if it beats that entry's
    config timed in the same run. The fake matmul is fastest at BLOCK_M=32, BLOCK_N=64, SPLIT=1 by
    2 ms or more a call; written into every entry, it survives a re-tune of two configs per study,
    where each study's own best would have replaced it."""
    shapes = ["16x16x16", "16x32x16", "32x16x16", "32x32x16"]
    args = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes",
            ",".join(shapes), "--sampler", "random", "--trials", "2"]
    path = tmp_path / "out" / "cpu" / "best.json"
    fastest = {"BLOCK_M": 32, "BLOCK_N": 64, "SPLIT": 1}
    store = ConfigStore("cpu")
    for shape in shapes:
        store.put({"op": "matmul", "backend": "fake", "dtype": "fp32", "shape": f"{shape}:nn", "config": dict(fastest)})
    path.parent.mkdir(parents=True)
    save_store(path, store)
    out = search(tmp_path, *args, "--seed", "2", "--study-prefix", "again:")
    assert [e["config"] for e in json.loads(path.read_text())["entries"]] == [fastest] * 4, out.stdout
    rows = counted(trials(tmp_path))
    drawn = rows[(rows["BLOCK_M"] == 32) & (rows["BLOCK_N"] == 64) & (rows["SPLIT"] == 1)]
    assert rows["shape"].nunique() > drawn["shape"].nunique()  # some study never measured it itself
    assert "best.json's entry kept: the study's best took" in out.stdout


@pytest.mark.slow  # the tuner in subprocesses
def test_a_study_whose_best_loses_to_the_default_config_writes_the_default_config(tmp_path):
    """With the fake matmul fastest at its default config (16, 16, 1), a study of two random configs
    that are not it finds only slower ones: best.json's entry is the default config, timed in the
    run, so callers never run slower than they would on no entry."""
    args = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes",
            "16x16x16,32x32x16", "--sampler", "random", "--seed", "3", "--trials", "2"]
    default = {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT": 1}
    out = search(tmp_path, *args, FAKE_BEST="16,16,1")
    rows = counted(trials(tmp_path))
    drawn = (rows["BLOCK_M"] == 16) & (rows["BLOCK_N"] == 16) & (rows["SPLIT"] == 1)
    assert not drawn.any() and len(rows) == 4  # the seed draws no default config: every winner loses
    path = tmp_path / "out" / "cpu" / "best.json"
    entries = json.loads(path.read_text())["entries"]
    assert [e["config"] for e in entries] == [default] * 2, out.stdout
    assert all(e["time_ms"] == e["default_ms"] < rows["time_ms"].min() for e in entries)
    assert out.stdout.count("the default config (") == 2
    # An entry best.json already holds that the default config beats goes too, even where it beats
    # the study's best (the fake's (16, 32, 1) sleeps 2 ms a call here, the study's draws 6 or more,
    # the default none).
    store = ConfigStore("cpu")
    for shape in ("16x16x16", "32x32x16"):
        store.put({"op": "matmul", "backend": "fake", "dtype": "fp32", "shape": f"{shape}:nn",
                   "config": {"BLOCK_M": 16, "BLOCK_N": 32, "SPLIT": 1}})
    save_store(path, store)
    out = search(tmp_path, *args, "--study-prefix", "again:", FAKE_BEST="16,16,1")
    assert [e["config"] for e in json.loads(path.read_text())["entries"]] == [default] * 2, out.stdout
    assert out.stdout.count("the default config (") == 2 and "entry kept" not in out.stdout
    (tmp_path / "usual").mkdir()
    out = search(tmp_path / "usual", *args)  # the best config away from the default: the winners written
    entries = json.loads((tmp_path / "usual" / "out" / "cpu" / "best.json").read_text())["entries"]
    assert len(entries) == 2 and default not in [e["config"] for e in entries], out.stdout


@pytest.mark.slow  # the tuner in subprocesses
def test_a_study_resumed_with_a_larger_budget_judges_its_own_winner_by_its_trial(tmp_path):
    """The entry a study wrote is one of its trials: resumed with more trials, the study's best
    (by the trials' times) is the entry, whether or not it is the first run's winner."""
    args = ["--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes",
            "16x16x16,32x32x16", "--sampler", "random", "--seed", "4"]
    search(tmp_path, *args, "--trials", "2")
    out = search(tmp_path, *args, "--trials", "6")
    assert "entry kept" not in out.stdout
    rows = counted(trials(tmp_path))
    best = rows.loc[rows.groupby("shape")["time_ms"].idxmin()].set_index("shape")
    for entry in json.loads((tmp_path / "out" / "cpu" / "best.json").read_text())["entries"]:
        assert entry["config"] == {k: int(best.loc[entry["shape"], k]) for k in ("BLOCK_M", "BLOCK_N", "SPLIT")}


@pytest.mark.slow  # the tuner in subprocesses
def test_two_workers_share_a_study_without_losing_or_repeating_trials(tmp_path):
    search(tmp_path, "--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32",
           "--shapes", "16x16x16:tn", "--trials", "12", "--workers", "2", "--sampler", "random")
    rows = trials(tmp_path)
    measured = counted(rows)
    assert len(measured) == 12 and not rows.duplicated(["trial"]).any()
    assert not measured.duplicated(["BLOCK_M", "BLOCK_N", "SPLIT"]).any()
    study = optuna.load_study(study_name="cpu:matmul:fake:fp32:16x16x16:tn", storage=f"sqlite:///{tmp_path / 'tuning.db'}")
    # A row per trial that measured or was pruned as invalid; repeats are trials of the study only.
    assert sorted(t.number for t in study.trials if counts_toward_budget(t)
                  or t.user_attrs.get("status") == "invalid") == sorted(rows["trial"])
    assert (measured["status"] == "ok").all()


@pytest.mark.slow  # the tuner in subprocesses
def test_two_machines_share_a_study_through_one_storage(tmp_path, storage_url):
    """Two searches started at once on a new storage, as two machines would (each with two
    workers; configs take 0.2 s to "compile"), on SQLite and on a PostgreSQL server: together
    they measure exactly the budget, and no config twice."""
    shared = ["--storage", storage_url, "--target", "cpu", "--backends", "fake", "--ops", "matmul",
              "--dtypes", "fp32", "--shapes", "16x32x16", "--trials", "12", "--workers", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "autotune.search", "--out", str(tmp_path / f"m{i}"),
                               "--seed", str(i), *shared], cwd=REPO, env=env(FAKE_COMPILE_S="0.2"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (1, 2)]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(logs)
    rows = pd.concat([pd.read_csv(tmp_path / f"m{i}" / "cpu" / "trials.csv") for i in (1, 2)])
    measured = counted(rows)
    assert len(measured) == 12 and not rows.duplicated(["trial"]).any()
    assert not measured.duplicated(["BLOCK_M", "BLOCK_N", "SPLIT"]).any()
    assert (measured["status"] == "ok").all(), measured[["status", "error"]]
    assert sum(this_run(log)[0] for log in logs) == 12


@pytest.mark.gpu
def test_both_twins_tune_on_the_gpu_through_the_compile_pool(tmp_path):
    """The real twins on the GPU, through two compile processes and the timing process: every study
    measures its budget, each trial correct, and records the compile process's compile time."""
    cache = {var: str(tmp_path / var) for var in ("CUPY_CACHE_DIR", "TRITON_CACHE_DIR")}  # cold: every config compiles
    result = subprocess.run(
        cli(tmp_path, "--backends", "cuda,triton", "--ops", "matmul,relu", "--dtypes", "fp16", "--shapes",
            "96x80x72,70x130", "--sampler", "random", "--trials", "3", "--workers", "2"),
        cwd=REPO, env=dict(os.environ, **cache), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = counted(trials(tmp_path, next(p.name for p in (tmp_path / "out").iterdir() if p.name != "logs")))
    assert rows.groupby("study").size().tolist() == [3] * 4 and (rows["status"] == "ok").all(), rows
    assert (rows["compile_s"] > 0).all() and rows["default_ms"].notna().all() and rows["torch_ms"].notna().all()
    assert "2 compile processes, 1 timing process" in result.stdout


@pytest.mark.gpu
def test_both_twins_tune_the_persistent_kernel_on_the_gpu_per_step(tmp_path):
    """The persistent kernel at the default protocol's H = 128 net, through two compile processes
    (which compile, never launch) and the timing process: every trial correct against float64, a
    step's time beside the default config's and torch's, and the winner in the store."""
    result = subprocess.run(
        cli(tmp_path, "--backends", "cuda,triton", "--ops", "persistent", "--hidden", "128", "--sampler", "random",
            "--trials", "3", "--workers", "2"),
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    target = next(p.name for p in (tmp_path / "out").iterdir() if p.name != "logs")
    rows = counted(trials(tmp_path, target))
    assert rows.groupby("backend").size().tolist() == [3, 3] and (rows["status"] == "ok").all(), rows
    assert set(rows["shape"]) == {"128x2x128:mlp"} and (rows["rel_err"] < 1e-3).all()
    assert rows["default_ms"].notna().all() and rows["torch_ms"].notna().all()
    entries = json.loads((tmp_path / "out" / target / "best.json").read_text())["entries"]
    assert sorted((e["op"], e["backend"]) for e in entries) == [("persistent", "cuda"), ("persistent", "triton")]


def test_timing_without_a_gpu_is_refused_with_what_to_run(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for target, words in (("sm_90", "cannot be timed"), ("auto", "no CUDA GPU is visible")):
        result = subprocess.run(cli(tmp_path, "--target", target, "--backends", "fake"), cwd=REPO, env=env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and words in result.stderr and "--compile-only" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.slow  # the tuner in subprocesses
def test_compile_only_with_the_fake_backend_batches_prunes_and_resumes(tmp_path):
    args = ["--target", "sm_75", "--compile-only", "--backends", "fake", "--ops", "relu,matmul",
            "--dtypes", "fp32", "--workers", "1"]
    out = search(tmp_path, *args)
    rows = trials(tmp_path, "sm_75")
    relu = rows[rows["op"] == "relu"]
    assert len(relu) == 10 and set(relu.loc[relu["MODE"] == 1, "status"]) == {"compile_error"}
    assert set(relu.loc[relu["MODE"] != 1, "status"]) == {"ok"}  # the batch failed, one by one it did not
    mm = rows[rows["op"] == "matmul"]
    assert len(mm) == 26 and (mm["registers"] > 0).all() and (mm.loc[mm["BLOCK_M"] * mm["BLOCK_N"] > 2048, "spill_bytes"] > 0).all()
    assert "pruned before compiling: 11" in out.stdout  # 5 relu (BLOCK=256) + 6 matmul tiles over 4096
    search(tmp_path, *args)
    assert len(trials(tmp_path, "sm_75")) == len(rows)  # nothing compiled twice


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "the interpreter path is CI's (no GPU); on the H200's image (Triton 3.6, numpy 2.5) the interpreter "
    "fails scalar atomics: TypeError: only 0-dimensional arrays can be converted to Python scalars"))
@pytest.mark.slow  # the tuner in subprocesses
def test_real_triton_backend_under_the_interpreter(tmp_path):
    try:
        __import__("kernels_triton")
    except Exception as exc:  # noqa: BLE001 - any import failure means there is nothing to test yet
        pytest.skip(f"kernels_triton does not import: {exc}")
    search(tmp_path, "--target", "cpu", "--backends", "triton", "--ops", "matmul,relu,softmax_cross_entropy",
           "--dtypes", "fp32", "--shapes", "16x32x16,8x16", "--trials", "2", "--workers", "1", timeout=300)
    rows = counted(trials(tmp_path))
    assert set(rows["op"]) == {"matmul", "relu", "softmax_cross_entropy"}
    # 3xTF32 matmuls are held to the exact default's error, which under the interpreter is numpy's
    # fp32 product: they may come out less accurate, never wrong.
    emulated = rows["TF32"] == 3
    assert (rows.loc[~emulated, "status"] == "ok").all(), rows[["op", "status", "error"]]
    assert rows.loc[emulated, "status"].isin(["ok", "less_accurate"]).all(), rows[["op", "status", "error"]]
    assert rows.loc[emulated, "default_rel_err"].notna().all()
    best = load_store(tmp_path / "out" / "cpu" / "best.json", "cpu")
    assert len(best.entries) == 3 and best.lookup("matmul", "triton", "fp32", "16x32x16:nn")[1] == "tuned"


@pytest.mark.slow  # the tuner in subprocesses
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is CI's (no GPU): see above")
def test_the_seed_protocols_sgd_is_tuned_without_buffers_in_studies_of_its_own(tmp_path):
    """--momentum 0 (the seed protocol's SGD) tunes sgd_update and linear_sgd as the trainer runs
    them, without momentum buffers, in studies of their own: a later run with momentum measures
    afresh instead of reusing their times. The store keeps one entry per shape."""
    args = ["--target", "cpu", "--backends", "triton", "--ops", "sgd_update,linear_sgd", "--dtypes", "fp16",
            "--shapes", "1000,9x5x7:tn", "--trials", "2", "--workers", "1"]
    search(tmp_path, *args, "--momentum", "0", timeout=300)
    rows = counted(trials(tmp_path))
    assert (rows["status"] == "ok").all(), rows[["op", "status", "error"]]
    assert set(rows["study"]) == {"cpu:sgd_update:triton:fp16:1000:no-momentum",
                                  "cpu:linear_sgd:triton:fp16:9x5x7:tn:no-momentum"}
    sgd = rows[rows["op"] == "sgd_update"]
    # 10 bytes an element: the fp32 weight read and written, the fp16 gradient read; no buffer.
    assert sgd["gbps"].to_numpy() == pytest.approx(1000 * 10 / sgd["time_ms"].to_numpy() / 1e6, rel=1e-6)
    out = search(tmp_path, *args, timeout=300)
    assert this_run(out.stdout) == (4, 0)  # nothing told from the buffer-less studies
    rows = counted(trials(tmp_path))
    assert len(rows) == 8 and rows["study"].nunique() == 4
    entries = json.loads((tmp_path / "out" / "cpu" / "best.json").read_text())["entries"]
    assert sorted(e["shape"] for e in entries) == ["1000", "9x5x7:tn"]


@pytest.mark.slow  # the tuner in subprocesses
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_compile_only_for_sm_75_with_a_real_backend(tmp_path, backend):
    if backend == "cuda" and shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    try:
        __import__(f"kernels_{backend}")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"kernels_{backend} does not import: {exc}")
    out = search(tmp_path, "--target", "sm_75", "--compile-only", "--backends", backend, "--ops", "relu,matmul",
                 "--dtypes", "fp16,bf16", "--trials", "2", "--workers", "2", timeout=400)
    rows = trials(tmp_path, "sm_75")
    assert set(rows["op"]) == {"relu", "matmul"} and not ((rows["op"] == "matmul") & (rows["dtype"] == "bf16")).any()
    assert (rows["status"] == "ok").all(), rows[["op", "dtype", "status", "error"]]
    assert (rows["registers"] > 0).all() and rows["spill_bytes"].notna().all()
    assert "bf16 tensor cores start at sm_80" in out.stdout
