"""`make run`'s closing summary: where the outputs went, each run's accuracy and step time, what to try next."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from experiments import quickstart

REPO = Path(__file__).resolve().parent.parent


def test_summary_names_outputs_accuracy_step_time_and_the_next_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # this checkout's trainer, run from elsewhere
    results: list = []
    cmd = [sys.executable, "-m", "trainer.run", "--steps", "3", "--hidden", "16", "--train-subset", "256",
           "--no-progress"]
    # This process's environment, not child_env's (tested below): where Python may not write its bytecode,
    # child_env moves it under the working folder, here a fresh one, and the run would compile torch anew.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert quickstart.run(cmd, results, env)
    assert quickstart.run([sys.executable, "-c", "raise SystemExit(3)"], results, env) is False
    (cmd_text, status, seconds, summary), failed = results
    assert cmd_text == "trainer.run --steps 3 --hidden 16 --train-subset 256 --no-progress" and status == "ok"
    assert summary["steps"] == 3 and failed[1] == "FAILED" and failed[3] is None

    lines = quickstart.summary_lines(results, ["experiments/runs/ (runs)"], ["the cuda backend"], "python -m x")
    run_line = next(line for line in lines if line.strip().startswith("torch"))
    assert f"test accuracy {summary['test_accuracy']:7.2%}" in run_line and " eager  H=16 " in run_line
    assert f"step {summary['median_step_us'] / 1e3:9.2f} ms" in run_line
    assert run_line.endswith(summary["csv"]) and (tmp_path / summary["csv"]).is_file()
    assert "outputs: experiments/runs/ (runs)" in lines and "skipped: the cuda backend" in lines
    assert lines[-1] == "next:    python -m x"
    assert any(line.startswith("FAILED") and "SystemExit(3)" in line for line in lines)


@pytest.mark.parametrize("argv", [["--trials", "0"], ["--trials", "-1"], ["--trials", "abc"], ["--trails", "3"]])
def test_a_bad_flag_is_one_line_and_runs_nothing(argv, monkeypatch, capsys):
    monkeypatch.setattr(quickstart.subprocess, "Popen", lambda cmd, **pipes: pytest.fail(f"ran {cmd}"))
    with pytest.raises(SystemExit) as exc:
        quickstart.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("python -m experiments.quickstart: error: ") and argv[0] in err, err


def main_not_raising() -> int:
    try:
        return quickstart.main([])
    except KeyboardInterrupt:  # left to escape, it would stop the whole pytest run
        pytest.fail("Ctrl-C escaped quickstart.main as a traceback")


def test_ctrl_c_waits_for_the_command_to_report_it_and_ends_in_130(tmp_path, monkeypatch, capsys):
    waits = []

    class CtrlCInTheCommand:
        """A command the Ctrl-C reached as well: it ends with 130 once it has said what it kept."""

        def __init__(self, cmd, **pipes):
            self.stdout = []  # it printed nothing before the Ctrl-C

        def wait(self):
            waits.append(1)
            if len(waits) == 1:
                raise KeyboardInterrupt
            return 130

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(quickstart.subprocess, "Popen", CtrlCInTheCommand)
    assert main_not_raising() == 130
    out, err = capsys.readouterr()
    assert len(waits) == 2 and err == "" and "summary" not in out  # the command's own line is the one


def test_ctrl_c_between_commands_is_one_line_and_130(tmp_path, monkeypatch, capsys):
    def interrupted(cmd, **pipes):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(quickstart.subprocess, "Popen", interrupted)
    assert main_not_raising() == 130 and capsys.readouterr().err == "interrupted\n"


@pytest.mark.slow  # the tuner in a subprocess
def test_the_summary_gives_the_tuning_steps_trials_and_rate_and_the_total_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results: list = []
    assert quickstart.run([sys.executable, "-m", "autotune.search", "--target", "cpu", "--backends", "fake", "--ops",
                           "matmul", "--dtypes", "fp32", "--shapes", "8x16x8", "--trials", "3", "--sampler", "random"],
                          results)
    ((_, _, seconds, summary),) = results
    tuning = summary["tuning"]
    assert tuning["trials"] == 3 and tuning["workers"] == 0 and 0 < tuning["tuning_s"] < seconds
    lines = quickstart.summary_lines(results, [], [], "python -m x")
    assert f"tuning: 3 trials in {tuning['tuning_s']:.1f} s, {tuning['trials_per_s']:.2f} a second " \
           f"(0 compile processes, 1 timing, {tuning['cores']} cores)" in lines
    assert f"total   {seconds:7.1f}s" in lines


def test_a_commands_lines_pass_through_as_it_prints_them(capsys, monkeypatch):
    """The child writes into a pipe, which would buffer its lines until it ends (a training run's
    epochs, all at once): it runs unbuffered, whatever the caller's environment says."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    assert quickstart.run([sys.executable, "-c", "import sys; print('unbuffered', sys.stdout.write_through)"], [])
    assert "unbuffered True" in capsys.readouterr().out


def test_where_bytecode_may_not_be_written_the_commands_keep_theirs_under_the_runs_output():
    """An environment that forbids bytecode (PYTHONDONTWRITEBYTECODE) would have every command compile
    torch's modules from source: the commands get a cache of the run's own instead; an environment
    that allows it, or names its own cache, is left as it is (unbuffered output aside)."""
    forbidding = quickstart.child_env({"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin"})
    assert "PYTHONDONTWRITEBYTECODE" not in forbidding and forbidding["PATH"] == "/bin"
    assert forbidding["PYTHONPYCACHEPREFIX"] == str((quickstart.OUT / "pycache").resolve())
    for environ in ({"PATH": "/bin"}, {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/mine"},
                    {"PYTHONDONTWRITEBYTECODE": ""}):
        assert quickstart.child_env(environ) == {**environ, "PYTHONUNBUFFERED": "1"}
