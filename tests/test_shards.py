"""tests/shards.py, the runner of one pytest selection in several processes, on a synthetic suite."""
import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.shards import ROOT, outcome_of

SUITE = '''
import os, time, pytest

@pytest.mark.parametrize("i", range(7))
def test_ok(i):
    pass

def test_fails():
    assert 0

@pytest.mark.skip(reason="skipped")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("setup fails")

def test_errors(broken):
    pass

@pytest.mark.xfail
def test_xfails():
    assert 0

def test_sleeps():
    if os.environ.get("PIDFILE"):
        with open(os.environ["PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("SLEEP", "0")))
'''


def run(tmp_path, *args, env=None):
    (tmp_path / "test_suite.py").write_text(SUITE)
    done = subprocess.run(
        [sys.executable, "-m", "tests.shards", "--log-dir", str(tmp_path / "logs"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    with open(tmp_path / "logs" / "outcomes.csv") as f:
        return done, {r["nodeid"].split("::")[-1]: r for r in csv.DictReader(f)}


def test_every_test_runs_once_in_some_shard_and_the_failures_are_named(tmp_path):
    done, rows = run(tmp_path, "--shards", "3", "--", str(tmp_path / "test_suite.py"))
    assert done.returncode == 1, done.stdout
    expected = {f"test_ok[{i}]" for i in range(7)} | {"test_fails", "test_skipped", "test_errors", "test_xfails",
                                                       "test_sleeps"}
    assert set(rows) == expected  # each once: outcomes.csv has one row per test
    assert {r["shard"] for r in rows.values()} == {"0", "1", "2"}
    assert [rows[f"test_ok[{i}]"]["shard"] for i in range(3)] == ["0", "1", "2"]  # neighbours split
    assert {n: r["outcome"] for n, r in rows.items() if not n.startswith("test_ok")} == {
        "test_fails": "failed", "test_skipped": "skipped", "test_errors": "error", "test_xfails": "xfailed",
        "test_sleeps": "passed"}
    assert "FAILED " in done.stdout and "test_fails" in done.stdout and "ERROR " in done.stdout
    assert "0 not run" in done.stdout


def test_the_shards_keep_the_selection_of_k_and_pass_when_it_passes(tmp_path):
    done, rows = run(tmp_path, "--shards", "4", "--", str(tmp_path / "test_suite.py"), "-k", "ok or skipped")
    assert done.returncode == 0, done.stdout
    assert set(rows) == {f"test_ok[{i}]" for i in range(7)} | {"test_skipped"}


def test_a_run_stopped_at_its_limit_says_what_did_not_finish(tmp_path):
    start = time.monotonic()
    done, rows = run(tmp_path, "--shards", "2", "--limit", "4", "--", str(tmp_path / "test_suite.py"),
                     env={"SLEEP": "120"})
    assert time.monotonic() - start < 60
    assert done.returncode == 1
    assert rows["test_sleeps"]["outcome"] == "unfinished"
    assert "stopped: --limit 4s" in done.stdout


def test_the_shards_die_with_the_runner_even_by_sigkill(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    pidfile = tmp_path / "pid"
    runner = subprocess.Popen(
        [sys.executable, "-m", "tests.shards", "--shards", "2", "--log-dir", str(tmp_path / "logs"), "--",
         str(tmp_path / "test_suite.py"), "-k", "sleeps"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "SLEEP": "120", "PIDFILE": str(pidfile)})
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        shard_pid = int(pidfile.read_text())
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(shard_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(shard_pid, signal.SIGKILL)
            pytest.fail("the shard outlived its runner")
    finally:
        runner.kill()


@pytest.mark.parametrize("phases, outcome", [
    ({"setup": "passed", "call": "passed", "teardown": "passed"}, "passed"),
    ({"setup": "passed", "call": "failed", "teardown": "passed"}, "failed"),
    ({"setup": "passed", "call": "passed", "teardown": "failed"}, "error"),
    ({"setup": "failed", "teardown": "passed"}, "error"),
    ({"setup": "skipped", "teardown": "passed"}, "skipped"),
    ({"setup": "passed"}, "unfinished"),
])
def test_outcome_of_phases(phases, outcome):
    assert outcome_of(phases) == outcome
