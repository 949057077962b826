"""trainer.run given a bad input: one clear line and a non-zero exit, never a traceback or a silent default."""
from __future__ import annotations

import importlib
import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from trainer.config import Config, from_args
from trainer.run import main
from trainer.stepper import Stepper

REPO = Path(__file__).resolve().parent.parent
train_module = importlib.import_module("trainer.train")  # the module; `trainer.train` the package exports is the function


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "--lr must be from 1.18e-38 to 3.4e+38 (fp32's normal range: the step applies it in fp32), "
                     "got -1.0"),
    (["--lr", "0"], "--lr must be from 1.18e-38 to 3.4e+38 (fp32's normal range"),
    (["--lr", "nan"], "--lr must be from 1.18e-38 to 3.4e+38 (fp32's normal range"),
    (["--lr", "inf"], "--lr must be from 1.18e-38 to 3.4e+38 (fp32's normal range"),
    (["--lr", "1e39"], "--lr must be from 1.18e-38 to 3.4e+38 (fp32's normal range"),
    (["--lr", "1e308"], "--lr must be from 1.18e-38 to 3.4e+38 (fp32's normal range"),
    (["--lr", "1e-320"], "--lr must be from 1.18e-38 to 3.4e+38 (fp32's normal range"),
    (["--lr", "3.40282347e+38"], "--lr must be from 1.18e-38 to 3.4e+38"),  # rounds to fp32's largest; torch refuses it
    (["--momentum", "-0.5"], "--momentum must be 0 or from 1.18e-38 to 0.99999994 (fp32's normal range: the step "
                             "applies it in fp32, where anything closer to 1 is 1), got -0.5"),
    (["--momentum", "1"], "--momentum must be 0 or from 1.18e-38 to 0.99999994"),
    (["--momentum", "0.99999999"], "--momentum must be 0 or from 1.18e-38 to 0.99999994"),
    (["--momentum", "nan"], "--momentum must be 0 or from 1.18e-38 to 0.99999994"),
    (["--weight-decay", "-0.0001"], "--weight-decay must be 0 or from 1.18e-38 to 3.4e+38 (fp32's normal range: "
                                    "the step applies it in fp32), got -0.0001"),
    (["--weight-decay", "nan"], "--weight-decay must be 0 or from 1.18e-38"),
    (["--weight-decay", "1e39"], "--weight-decay must be 0 or from 1.18e-38 to 3.4e+38"),
    (["--seed", "99999999999999999999999"], "--seed must be a whole number from 0 to 2**64 - 1, "
                                            "got 99999999999999999999999"),
    (["--seed", "-1"], "--seed must be a whole number from 0 to 2**64 - 1, got -1"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--hidden", "0"], "--hidden must be from 1 to 2147483647, got 0"),
    (["--train-subset", "70000"], "argument --train-subset: '70000' is not a whole number from 1 to 60000"),
    (["--train-subset", "0"], "argument --train-subset: '0' is not a whole number from 1 to 60000"),
    (["--batch-size", "60001"], "--batch-size 60001 is larger than the training set (60000 images)"),
    (["--train-subset", "256", "--batch-size", "512"], "--batch-size 512 is larger than the training set (256 images)"),
    (["--backend", "triton", "--target", "sm_99"], "--target 'sm_99' is not auto or one of sm_75, sm_80"),
    (["--no-graph"], "--no-graph applies to the cuda and triton backends only"),
    (["--out", ""], "--out must name a folder, got ''"),
    (["--out", "  "], "--out must name a folder, got '  '"),
    (["--tuned-configs", "best.json"], "the torch backend has none"),
    (["--backend", "torch", "--allow-default-configs"], "the torch backend has none"),
    (["--backend", "torch", "--target", "sm_90"], "the torch backend has none"),
    (["--no-fuse"], "--no-fuse applies to the cuda and triton backends only"),
])
def test_bad_flags_exit_2_with_one_line_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        from_args(argv)  # what main() parses with, without training if a value slipped through
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("python -m trainer.run: error: ") and message in err, err


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
@pytest.mark.parametrize("field, value", [("lr", -1.0), ("lr", float("nan")), ("momentum", -0.1),
                                          ("weight_decay", float("-inf"))])
def test_optimizer_values_are_checked_for_every_backend(backend, field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be"):
        Config(backend=backend, **{field: value})


def test_good_values_pass():
    config = Config(backend="triton", lr=1e-4, momentum=0.0, weight_decay=0.0, steps=1, target="sm_80",
                    train_subset=60000, batch_size=60000)
    assert config.steps == 1 and config.target == "sm_80"
    assert from_args(["--steps", "7"]).steps == 7 and from_args([]).steps is None


def test_progress_bar_only_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert from_args([]).progress is False
    monkeypatch.setattr(sys, "stderr", Tty())
    assert from_args([]).progress is True
    assert from_args(["--no-progress"]).progress is False


def test_a_model_too_large_for_memory_is_refused_in_one_line(tmp_path, capsys):
    # 1.59e12 parameters, 25 TB in fp32 with momentum: refused before anything is allocated (and were
    # the check gone, the first layer's allocation would fail at once instead of filling this memory).
    hidden = 2 * 10**9
    code = main(["--hidden", str(hidden), "--layers", "1", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --hidden {hidden} --layers 1 does not fit: its 1,590,000,000,010 parameters")


def test_the_memory_bound_is_the_fp32_state(tmp_path, monkeypatch):
    # H=64, L=1: (784 + 1) * 64 + (64 + 1) * 10 = 50,890 parameters; with momentum 4 fp32 copies each.
    need = 50_890 * 16
    config = Config(hidden=64, layers=1, steps=1, out=str(tmp_path), progress=False)
    monkeypatch.setattr(train_module, "_available_bytes", lambda device: need - 1)
    with pytest.raises(train_module.RunError, match="50,890 parameters"):
        train_module.train(config)
    monkeypatch.setattr(train_module, "_available_bytes", lambda device: need)
    assert train_module.train(config).steps == 1


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 16000000000000 bytes. Error code 12 (Cannot allocate memory)"),
])
def test_out_of_memory_during_the_run_is_one_line(error, tmp_path, monkeypatch, capsys):
    def oom(config, device):
        raise error

    monkeypatch.setattr(train_module, "make_backend", oom)
    code = main(["--steps", "1", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    assert "out of memory" in err and "--hidden" in err


def test_unwritable_out_is_refused_in_one_line_before_setup(tmp_path, monkeypatch, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setattr(train_module, "load_mnist", lambda *a: pytest.fail("loaded data before checking --out"))
    code = main(["--steps", "1", "--out", str(not_a_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --out {not_a_dir}: cannot write {not_a_dir / 'runs'} (Not a directory)")


def test_ctrl_c_mid_segment_keeps_the_steps_so_far(tmp_path, monkeypatch, capsys):
    calls, real_call = [], Stepper.__call__

    def step_then_interrupt(self):
        calls.append(1)
        if len(calls) == 27:  # in the second segment of 20 steps
            raise KeyboardInterrupt
        if len(calls) > 20:  # the second segment's steps are slower: its group's mean tells it apart
            time.sleep(0.02)
        real_call(self)

    monkeypatch.setattr(Stepper, "__call__", step_then_interrupt)
    try:
        code = main(["--steps", "50", "--eval-every", "20", "--hidden", "32", "--out", str(tmp_path), "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped trainer.run.main as a traceback")
    err = capsys.readouterr().err
    run_csv = next((tmp_path / "runs").glob("*.csv"))
    assert code == 130 and err == f"interrupted at step 26; the steps so far are in {run_csv}\n"
    steps = pd.read_csv(run_csv)
    assert steps["step"].tolist() == list(range(1, 27)) and steps["loss"].notna().all()
    # Groups 0-15 and 16-19 of the first segment, and 20-25 of the second, closed by the interrupt.
    times = steps["step_time_us"].tolist()
    assert all(t > 0 for t in times) and len(set(times[16:20])) == 1 and len(set(times[20:26])) == 1
    assert times[20] >= 20_000 and times[20] != times[19]


def test_ctrl_c_during_setup_is_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "load_mnist", interrupted)
    try:
        code = main(["--steps", "5", "--out", str(tmp_path), "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped trainer.run.main as a traceback")
    assert code == 130 and capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_between_segments_names_the_steps_written(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the test-set accuracy after the second segment (rows for steps 1-6 written) is
    reported as the step loop's is: the CSV and the steps it holds, not a bare "interrupted"."""
    calls = []

    def accuracy(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return 0.5

    monkeypatch.setattr(train_module, "accuracy", accuracy)
    code = main(["--steps", "30", "--eval-every", "3", "--hidden", "16", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    run_csv = next((tmp_path / "runs").glob("*.csv"))
    assert code == 130 and err.startswith("interrupted at step 6; ") and err.strip().endswith(str(run_csv)), err
    assert pd.read_csv(run_csv)["step"].tolist() == list(range(1, 7))


@pytest.mark.slow  # a trainer process: torch loads, trains, is interrupted
def test_sigint_to_a_running_trainer(tmp_path, interruptible):
    """Ctrl-C once steps are in the CSV, wherever it lands (in a step loop or between segments: rows
    written every 50 steps, the test-set accuracy), names the CSV and its step count. A fixed sleep
    after the CSV appeared once let the signal land before the first step on a loaded machine."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.run", "--steps", "1000000", "--hidden", "64", "--eval-every", "50",
         "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=interruptible,
    )
    try:
        deadline = time.monotonic() + 120

        def rows() -> int:
            found = list((tmp_path / "runs").glob("*.csv"))
            return len(found[0].read_text().splitlines()) - 1 if found else -1

        while rows() < 1:  # the first segment's steps written: well into the step loop
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    run_csv = next((tmp_path / "runs").glob("*.csv"))
    assert proc.returncode == 130 and len(err.splitlines()) == 1, err
    assert err.startswith("interrupted at step ") and err.strip().endswith(str(run_csv))
    step = int(err.split()[3].rstrip(";"))
    assert step > 0 and pd.read_csv(run_csv)["step"].tolist() == list(range(1, step + 1))
