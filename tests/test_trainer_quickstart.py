"""`make run`'s closing summary: where the outputs went, each run's accuracy and step time, what to try next."""
from __future__ import annotations

import sys
from pathlib import Path

from experiments import quickstart

REPO = Path(__file__).resolve().parent.parent


def test_summary_names_outputs_accuracy_step_time_and_the_next_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # this checkout's trainer, run from elsewhere
    results: list = []
    cmd = [sys.executable, "-m", "trainer.run", "--steps", "3", "--hidden", "16", "--train-subset", "256",
           "--no-progress"]
    assert quickstart.run(cmd, results)
    assert quickstart.run([sys.executable, "-c", "raise SystemExit(3)"], results) is False
    (cmd_text, status, seconds, summary), failed = results
    assert cmd_text == "trainer.run --steps 3 --hidden 16 --train-subset 256 --no-progress" and status == "ok"
    assert summary["steps"] == 3 and failed[1] == "FAILED" and failed[3] is None

    lines = quickstart.summary_lines(results, ["experiments/runs/ (runs)"], ["the cuda backend"], "python -m x")
    run_line = next(line for line in lines if line.strip().startswith("torch"))
    assert f"test accuracy {summary['test_accuracy']:7.2%}" in run_line
    assert f"step {summary['median_step_us'] / 1e3:9.2f} ms" in run_line
    assert run_line.endswith(summary["csv"]) and (tmp_path / summary["csv"]).is_file()
    assert "outputs: experiments/runs/ (runs)" in lines and "skipped: the cuda backend" in lines
    assert lines[-1] == "next:    python -m x"
    assert any(line.startswith("FAILED") and "SystemExit(3)" in line for line in lines)
