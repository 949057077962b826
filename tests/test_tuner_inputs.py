"""The tuner in a careless user's hands: its files survive crashes and neighbours, and every
bad input gets one clear line that names what is wrong (never a traceback, never silence).

Most of these run `autotune.search.main` in this process (it returns the exit code and prints
its one line to stderr); the ones that need a real process (Ctrl-C, a second process sharing
trials.csv) start one.
"""
from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from autotune import search
from autotune.plan import build_plan
from kernels_core.store import ConfigStore, StoreError, load_store, save_store
from autotune.trials_csv import TrialsCsv, TrialsCsvError, columns
from trainer.config import Config

REPO = Path(__file__).resolve().parent.parent
BASE = columns(["BLOCK", "MODE"])


@pytest.fixture(autouse=True)
def fake_registered(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")


@pytest.fixture
def rand(rng) -> random.Random:
    """Python's RNG seeded from the test's seed (conftest's `rng`), so a failure replays."""
    import torch

    return random.Random(int(torch.randint(0, 2**62, (1,), generator=rng)))


def row(rand: random.Random, study: str, trial: int, **extra) -> dict:
    """A row as the search writes it: an error text with the characters CSV must quote."""
    return {"utc": f"2025-01-01T00:00:{trial:02d}Z", "target": "cpu", "op": "relu", "backend": "fake",
            "dtype": "fp32", "shape": "32x64", "BLOCK": rand.choice([64, 128]), "MODE": rand.randrange(5),
            "status": "compile_error", "error": f'ptxas, "line {rand.randrange(99)}":\nerror\r\nend',
            "time_ms": rand.random(), "trial": trial, "study": study, **extra}


def read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, keep_default_na=False, dtype=str)


def one_error_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("autotune: error: "), err
    for word in words:
        assert word in err, err
    return err


def run_main(tmp_path: Path, *args: str, storage: str | None = None, out: Path | None = None) -> int:
    return search.main(["--out", str(out or tmp_path / "out"),
                        "--storage", storage or f"sqlite:///{tmp_path / 'tuning.db'}", *args])


FAKE_RELU = ("--target", "cpu", "--backends", "fake", "--ops", "relu", "--dtypes", "fp32", "--shapes", "32x64",
             "--trials", "1")


# -- trials.csv: neighbours ---------------------------------------------------------------

def test_a_search_that_widens_trials_csv_loses_no_row_of_one_already_appending(tmp_path, rand):
    """Two searches on one --out whose backends have different tunables: the second widens the
    file (a new one renamed over it) while the first holds the old one open."""
    path = tmp_path / "trials.csv"
    first = TrialsCsv(path, BASE)
    written = [row(rand, "a", 0)]
    first.append(written[-1])
    second = TrialsCsv(path, columns(["BLOCK", "MODE", "VEC"]))
    written.append(row(rand, "b", 0, VEC=4))
    second.append(written[-1])
    written.append(row(rand, "a", 1))
    first.append(written[-1])  # once: into the replaced file, lost
    first.close()
    second.close()
    rows = read(path)
    assert list(rows.columns) == BASE + ["VEC"]  # a new column goes at the end
    assert [(r.study, r.trial) for r in rows.itertuples()] == [(w["study"], str(w["trial"])) for w in written]
    for got, want in zip(rows.to_dict("records"), written):
        assert got == {c: str(want.get(c, "")) for c in rows.columns}


def test_writers_that_append_and_widen_at_once_lose_no_row(tmp_path, rand):
    """Four writers on one file, three of them widening it while the others append. Each has
    its own TrialsCsv, so its own open file, and flock excludes them as it would processes."""
    path, n = tmp_path / "trials.csv", 150
    plans = [("a", ["BLOCK", "MODE"], 0), ("b", ["BLOCK", "MODE", "VEC"], 20),
             ("c", ["BLOCK", "MODE", "num_warps"], 60), ("d", ["BLOCK", "MODE", "VEC", "ITEMS"], 100)]
    seeds = [rand.randrange(2**32) for _ in plans]
    written = {study: threading.Event() for study, _, _ in plans}
    failures = []

    def write(study, tunables, after, seed):
        try:
            mine = random.Random(seed)
            for other, _, _ in plans[:plans.index((study, tunables, after))]:
                written[other].wait(60)  # open (and widen) while the earlier ones are still writing
            out = TrialsCsv(path, columns(tunables))
            for i in range(n):
                out.append(row(mine, study, i, **{t: i for t in tunables if t not in ("BLOCK", "MODE")}))
                if i == after:
                    written[study].set()
            written[study].set()
            out.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)
            written[study].set()

    threads = [threading.Thread(target=write, args=(*plan, seed)) for plan, seed in zip(plans, seeds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    rows = read(path)
    assert set(rows.columns) >= {"VEC", "num_warps", "ITEMS"}
    for study, tunables, _ in plans:
        mine = rows[rows["study"] == study]
        assert sorted(mine["trial"].astype(int)) == list(range(n)), study
        for t in tunables[2:]:
            assert (mine[t].astype(int) == mine["trial"].astype(int)).all()


# -- trials.csv: crashes ------------------------------------------------------------------

def test_a_cut_off_last_row_is_set_aside_and_appends_start_on_a_line_boundary(tmp_path, rand, capsys):
    """A crash or a full disk can cut the last row at any byte, inside its quoted error text too."""
    path, partial = tmp_path / "trials.csv", tmp_path / "trials.csv.partial"
    out = TrialsCsv(path, BASE)
    kept = [row(rand, "s", i) for i in range(3)]
    for r in kept[:2]:
        out.append(r)
    last = path.stat().st_size  # where the last row starts
    out.append(kept[2])
    out.close()
    whole = path.read_bytes()
    assert whole.count(b"\n", last) == 3  # two inside its quoted error text
    for cut in range(last, len(whole) + 1):
        path.write_bytes(whole[:cut])
        partial.unlink(missing_ok=True)
        again = TrialsCsv(path, BASE)
        extra = row(rand, "s", 99)
        again.append(extra)
        again.close()
        rows = read(path)
        want = kept + [extra] if cut == len(whole) else kept[:2] + [extra]
        assert list(rows["trial"]) == [str(w["trial"]) for w in want], cut
        assert rows.iloc[-1]["error"] == extra["error"] and rows.iloc[-1]["MODE"] == str(extra["MODE"]), cut
        err = capsys.readouterr().err
        if cut in (last, len(whole)):
            assert not err and not partial.exists(), cut
        else:
            assert str(path) in err and "cut-off" in err and str(partial) in err, (cut, err)
            assert partial.read_bytes().startswith(whole[last:cut]), cut


def test_a_neighbour_that_dies_mid_row_does_not_glue_the_next_row_to_its_piece(tmp_path, rand, capsys):
    path = tmp_path / "trials.csv"
    out = TrialsCsv(path, BASE)
    out.append(row(rand, "s", 0))
    with open(path, "ab") as neighbour:  # another process, killed in the middle of its write
        neighbour.write(b"2025-01-01T00:00:00Z,cpu,,relu,fake,fp32,32x64,64,1,compile_error,\"ptxas\n")
    out.append(row(rand, "s", 1))
    out.close()
    assert list(read(path)["trial"]) == ["0", "1"]
    assert "cut-off" in capsys.readouterr().err


def test_a_trials_csv_of_random_bytes_is_refused_naming_the_file(tmp_path, rand, capsys):
    junk = tmp_path / "out" / "cpu" / "trials.csv"
    junk.parent.mkdir(parents=True)
    for content in (bytes(rand.randrange(256) for _ in range(3000)), b"name,colour\nbob,red\n", b"\x00\x01"):
        junk.write_bytes(content)
        with pytest.raises(TrialsCsvError, match="not a trials CSV") as info:
            TrialsCsv(junk, BASE)
        assert str(junk) in str(info.value)
        assert run_main(tmp_path, *FAKE_RELU) == 2
        one_error_line(capsys, str(junk), "not a trials CSV")
        assert junk.read_bytes() == content  # refused, not repaired


# -- file modes ---------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_best_json_and_trials_csv_get_the_umasks_mode(tmp_path, umask, rand):
    old = os.umask(umask)
    try:
        best = tmp_path / "best.json"
        save_store(best, ConfigStore("cpu"))
        save_store(best, ConfigStore("cpu"))  # replacing keeps it so
        out = TrialsCsv(tmp_path / "trials.csv", BASE)
        out.append(row(rand, "s", 0))
        out.close()
        created = stat.S_IMODE((tmp_path / "trials.csv").stat().st_mode)
        TrialsCsv(tmp_path / "trials.csv", columns(["BLOCK", "MODE", "VEC"])).close()  # widened: a new file
        widened = stat.S_IMODE((tmp_path / "trials.csv").stat().st_mode)
    finally:
        os.umask(old)
    assert stat.S_IMODE(best.stat().st_mode) == created == widened == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.json", "trials.csv"]  # no temporary left


# -- bad inputs: one line each ------------------------------------------------------------

@pytest.mark.parametrize("url,words", [
    ("notaurl", ["Could not parse"]),
    ("foo://x", ["foo"]),
    # Nothing listens on port 1 (or the driver is not installed): either way, one line.
    ("postgresql://tuner:s3cret@127.0.0.1:1/db", ["tuner:***@"]),
    ("mysql://tuner:s3cret@127.0.0.1:1/db", ["tuner:***@"]),
    ("corrupt", ["file is not a database"]),
    ("directory", ["unable to open database file"]),
])
def test_a_bad_storage_gets_one_line_naming_it(tmp_path, capsys, url, words, rand):
    if url == "corrupt":
        db = tmp_path / "corrupt.db"
        db.write_bytes(b"SQLite format 3\x00" + bytes(rand.randrange(256) for _ in range(4096)))
        url = f"sqlite:///{db}"
    elif url == "directory":
        (tmp_path / "dir.db").mkdir()
        url = f"sqlite:///{tmp_path / 'dir.db'}"
    assert run_main(tmp_path, *FAKE_RELU, storage=url) == 2
    err = one_error_line(capsys, "--storage", *words)
    assert "s3cret" not in err


def test_a_database_that_opens_but_fails_later_gets_one_line(tmp_path, capsys):
    """Mangled where opening does not look: a table of the schema with other columns."""
    import sqlite3

    import optuna

    from autotune.storage import open_storage

    db = tmp_path / "tuning.db"
    study = optuna.create_study(storage=open_storage(f"sqlite:///{db}"), study_name="cpu:relu:fake:fp32:32x64")
    study.ask()
    with sqlite3.connect(db) as con:
        con.executescript("DROP TABLE trial_user_attributes; CREATE TABLE trial_user_attributes (x INTEGER);")
    assert run_main(tmp_path, *FAKE_RELU) == 2
    one_error_line(capsys, "--storage", str(db), "trial_user_attributes")


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_an_out_that_is_not_a_directory_gets_one_line(tmp_path, capsys, where):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    out = afile if where == "file" else afile / "runs"
    assert run_main(tmp_path, *FAKE_RELU, out=out) == 2
    one_error_line(capsys, "--out", str(afile))
    assert afile.read_text() == "mine\n"


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-1", "0", "soon"])
def test_timeout_must_be_a_finite_positive_number_of_seconds(value, capsys):
    with pytest.raises(SystemExit) as info:
        search.parse_args(["--timeout", value])
    assert info.value.code == 2
    assert "--timeout" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1", "-0.1", "nan", "inf", "none"])
def test_momentum_must_be_in_zero_to_one(value, capsys):
    with pytest.raises(SystemExit) as info:
        search.parse_args(["--momentum", value])
    assert info.value.code == 2 and "is not a momentum in [0, 1)" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_failures_in_a_row_must_be_at_least_one(value, capsys):
    with pytest.raises(SystemExit) as info:
        search.parse_args(["--max-failures-in-a-row", value])
    assert info.value.code == 2
    assert "--max-failures-in-a-row" in capsys.readouterr().err
    assert search.parse_args([]).max_failures_in_a_row == search.MAX_FAILURES_IN_A_ROW


@pytest.mark.parametrize("flags", [["--shapes", "64x64"], ["--storage", "sqlite:///x.db"], ["--hidden", "64"],
                                   ["--layers", "3"], ["--batch-size", "32"], ["--sampler", "random"],
                                   ["--momentum", "0"]])
def test_compile_only_refuses_the_flags_it_would_ignore(flags, capsys):
    with pytest.raises(SystemExit) as info:
        search.parse_args(["--compile-only", "--target", "sm_75", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flags[0] in err and "--compile-only" in err
    search.parse_args(flags)  # without --compile-only each is fine


def test_defaults_stay_what_the_help_says():
    args = search.parse_args([])
    assert (args.hidden, args.layers, args.batch_size, args.sampler) == ((1024,), 2, 128, "tpe-valid")
    assert args.momentum == Config.momentum  # the trainer's default protocol's
    assert args.storage.startswith("sqlite:///") and args.storage.endswith("experiments/tuning.db")


def nested(depth: int) -> str:
    return '{"target": "cpu", "format": 1, "entries": ' + "[" * depth + "]" * depth + "}"


def test_a_deeply_nested_best_json_is_refused_in_one_line(tmp_path, capsys):
    best = tmp_path / "out" / "cpu" / "best.json"
    best.parent.mkdir(parents=True)
    best.write_text(nested(200_000))
    with pytest.raises(StoreError, match="nested too deeply") as info:
        load_store(best, "cpu")
    assert str(best) in str(info.value)
    assert run_main(tmp_path, *FAKE_RELU) == 2
    one_error_line(capsys, str(best), "nested too deeply")


def test_the_trainer_runs_on_defaults_past_a_deeply_nested_store_when_allowed(tmp_path, capsys):
    from trainer.config import Config
    from trainer.tuned_configs import ConfigStoreRefused, open_store, target_name

    best = tmp_path / "best.json"
    best.write_text(nested(200_000))
    config = Config(backend="triton", target=target_name("auto"), tuned_configs=str(best))
    with pytest.raises(ConfigStoreRefused, match="nested too deeply"):
        open_store(config)
    config.allow_default_configs = True
    assert open_store(config) == (None, "none")
    assert "nested too deeply" in capsys.readouterr().err


def test_cpu_target_skips_the_twin_that_needs_a_gpu_with_a_note():
    plan = build_plan(search.parse_args(["--target", "cpu", "--ops", "relu_backward", "--dtypes", "fp32",
                                         "--shapes", "32x64"]))
    assert {job.backend for job in plan.jobs} == {"triton"}
    assert any(line.startswith("cuda:") and "GPU" in line for line in plan.skipped), plan.skipped


def test_an_op_the_trainer_never_calls_is_explained_with_the_flag_that_tunes_it(tmp_path, capsys):
    plan = build_plan(search.parse_args(["--target", "cpu", "--backends", "fake", "--ops", "relu,matmul",
                                         "--hidden", "96", "--batch-size", "40"]))
    assert {job.call.op for job in plan.jobs} == {"matmul"}
    (note,) = [line for line in plan.skipped if line.startswith("relu:")]
    assert "fused" in note and "--shapes 40x96" in note
    assert run_main(tmp_path, "--target", "cpu", "--backends", "fake", "--ops", "relu") == 2
    one_error_line(capsys, "nothing to tune", "fused", "--shapes 128x1024")
    plan = build_plan(search.parse_args(["--target", "cpu", "--backends", "fake", "--ops", "relu",
                                         "--shapes", "4096"]))
    assert not plan.jobs and "relu: --shapes has no shape of 2 dimensions" in plan.skipped[0]


# -- Ctrl-C -------------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_in_compile_only_stops_cleanly_and_the_next_run_resumes(tmp_path, interruptible):
    env = dict(os.environ, AUTOTUNE_BACKENDS="fake=tests.fake_backend")
    env.pop("KERNEL_TEST_SEED", None)
    cmd = [sys.executable, "-m", "autotune.search", "--out", str(tmp_path / "out"), "--target", "sm_75",
           "--compile-only", "--backends", "fake", "--ops", "relu,matmul", "--dtypes", "fp32", "--workers", "1"]
    log = tmp_path / "out" / "logs" / "sm_75" / "compile-0.log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    deadline = time.monotonic() + 120
    while not log.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "interrupted" in out, out + err
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read(tmp_path / "out" / "sm_75" / "trials.csv")
    assert len(rows) == 36 and not rows.duplicated(["study", "trial"]).any()


@pytest.mark.slow  # the tuner in subprocesses
def test_ctrl_c_in_a_search_through_the_compile_pool_drops_the_trials_in_flight_and_the_rerun_finishes(
        tmp_path, interruptible):
    env = dict(os.environ, AUTOTUNE_BACKENDS="fake=tests.fake_backend", TRITON_INTERPRET="1", FAKE_COMPILE_S="0.5",
               FAKE_CACHE_DIR=str(tmp_path))
    env.pop("KERNEL_TEST_SEED", None)
    cmd = [sys.executable, "-m", "autotune.search", "--out", str(tmp_path / "out"), "--target", "cpu",
           "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes", "16x16x16,8x16x24",
           "--sampler", "random", "--trials", "6", "--workers", "2"]
    csv = tmp_path / "out" / "cpu" / "trials.csv"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    deadline = time.monotonic() + 120
    while not (csv.exists() and len(read(csv)) >= 2) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "interrupted: trials in flight were dropped" in out, out + err
    first = len(read(csv))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read(csv)
    measured = rows[rows["status"] != "invalid"]
    assert 2 <= first < len(rows) and measured.groupby("study").size().tolist() == [6, 6]
    assert not rows.duplicated(["study", "trial"]).any()
    assert not measured.duplicated(["study", "BLOCK_M", "BLOCK_N", "SPLIT"]).any()


def test_one_run_tunes_the_calls_of_several_widths_once_each():
    from kernels_core.mlp import mlp_calls

    plan = build_plan(search.parse_args(["--target", "cpu", "--backends", "fake", "--ops", "matmul",
                                         "--hidden", "96,160,96", "--batch-size", "40"]))
    want = {c.key for h in (96, 160) for c in mlp_calls(h, 2, 40, "fp32") if c.op == "matmul"}
    keys = [job.call.key for job in plan.jobs]
    assert sorted(keys) == sorted(want) and "40x10x160:nn" in keys and "40x96x784:nn" in keys
    for bad in ("0,128", "128,x", ""):
        with pytest.raises(SystemExit):
            search.parse_args(["--hidden", bad])


def test_a_trials_csv_from_another_storage_is_refused_not_tuned_twice(tmp_path, capsys):
    """A fresh storage beside a trials.csv that already holds a study's rows (a copied results
    folder, a lost tuning.db) would number that study's trials from 0 again beside the old rows:
    the search stops in one line instead, and the CSV keeps only the first run's rows."""
    fake_matmul = ("--target", "cpu", "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32",
                   "--shapes", "16x16x16", "--trials", "2")  # correct for every config: no hangs
    assert run_main(tmp_path, *fake_matmul) == 0
    csv_path = tmp_path / "out" / "cpu" / "trials.csv"
    before = csv_path.read_bytes()
    (tmp_path / "tuning.db").unlink()
    capsys.readouterr()
    assert run_main(tmp_path, *fake_matmul) == 2
    one_error_line(capsys, "holds rows of study", "lacks")
    assert csv_path.read_bytes() == before
