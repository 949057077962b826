"""`python -m trainer.run` at its edges, in this process: every numeric flag given the extremes a
careless user types, flags that do not apply to the machine or backend, a Ctrl-C while torch
loads, a disk that fills during the run, and what the run's JSON records.

Refusals are one line on stderr with exit code 2 (a bad flag), 1 (a run that cannot go on) or 130
(Ctrl-C), never a traceback.
"""
from __future__ import annotations

import builtins
import errno
import importlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import quickstart
from kernels_core import provenance
from trainer import config as trainer_config
from trainer.config import from_args, parser
from trainer.run import main

REPO = Path(__file__).resolve().parent.parent
train_module = importlib.import_module("trainer.train")  # the module; `trainer.train` the package exports is the function

EXTREMES = ("0", "-0", "1e-320", "1e39", "1e308", "inf", "nan", str(2**64), "abc")
FLOAT_FLAGS = ("--lr", "--momentum", "--weight-decay")
INT_FLAGS = ("--hidden", "--layers", "--batch-size", "--epochs", "--steps", "--seed", "--train-subset",
             "--eval-every")
FP32 = np.finfo(np.float32)
TINY = dict(hidden=16, layers=1, batch_size=16, steps=6, eval_every=2, train_subset=256, progress=False)


def test_the_table_holds_every_numeric_flag():
    numeric = {a.option_strings[0] for a in parser()._actions
               if a.option_strings and a.type not in (None, str) and a.choices is None}
    assert numeric == set(FLOAT_FLAGS + INT_FLAGS)


def usable(flag: str, value) -> bool:
    """What an accepted value must be: a float the kernels can apply in fp32 (0, or a finite normal
    fp32 that rounds to no 0), an int the code takes as given."""
    if flag in FLOAT_FLAGS:
        as_fp32 = np.float32(value)
        return value == 0 or (np.isfinite(as_fp32) and abs(as_fp32) >= np.finfo(np.float32).tiny)
    return isinstance(value, int) and value >= 0


@pytest.mark.parametrize("text", EXTREMES)
@pytest.mark.parametrize("flag", FLOAT_FLAGS + INT_FLAGS)
def test_every_numeric_flag_takes_an_extreme_or_refuses_it_in_one_line(flag, text, capsys):
    try:
        config = from_args([flag, text])
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("python -m trainer.run: error: ") and flag in err and "Traceback" not in err, err
        return
    value = getattr(config, flag[2:].replace("-", "_"))
    assert value == (float(text) if flag in FLOAT_FLAGS else int(text)), "accepted, but not as given"
    assert usable(flag, value), f"{flag} {text} accepted as {value!r}"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag, text", [("--lr", "1e-320"), ("--lr", "1e39"), ("--weight-decay", "1e39"),
                                        ("--momentum", "1e-320"), ("--seed", str(2**64)),
                                        ("--train-subset", "0"), ("--hidden", str(2**31))])
def test_the_values_a_user_met_as_tracebacks_or_silent_no_ops_are_refused(flag, text, capsys):
    with pytest.raises(SystemExit) as exc:
        from_args([flag, text])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_the_bounds_the_messages_and_help_print_are_taken():
    config = from_args(["--lr", "3.4e+38", "--weight-decay", "1.18e-38", "--momentum", "0.99999994", "--seed",
                        str(2**64 - 1), "--train-subset", "60000", "--hidden", str(2**31 - 1)])
    assert (config.lr, config.weight_decay, config.momentum) == (3.4e38, 1.18e-38, 0.99999994)
    assert config.seed == 2**64 - 1 and config.train_subset == 60000 and config.hidden == 2**31 - 1


@pytest.mark.parametrize("hyper, code", [
    (["--lr", str(float(FP32.max)), "--weight-decay", str(float(FP32.max)), "--momentum", "0.99999994"], 1),  # diverges
    (["--lr", str(float(FP32.tiny)), "--weight-decay", str(float(FP32.tiny)), "--seed", str(2**64 - 1)], 0),
])
def test_the_extremes_taken_train_or_stop_in_one_line(hyper, code, tmp_path, capsys):
    assert main([*hyper, "--out", str(tmp_path), "--no-progress", "--hidden", "16", "--layers", "1", "--batch-size",
                 "16", "--steps", "2", "--train-subset", "256"]) == code
    err = capsys.readouterr().err
    assert ("loss became nan" in err and len(err.splitlines()) == 1) if code else err == "", err


@pytest.mark.parametrize("has_gpu", [False, True])
def test_torch_graph_needs_a_gpu(has_gpu, monkeypatch, capsys):
    monkeypatch.setattr(trainer_config, "_has_gpu", lambda: has_gpu)
    if has_gpu:
        assert from_args(["--torch-graph"]).torch_graph
        return
    with pytest.raises(SystemExit) as exc:
        from_args(["--torch-graph"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "needs a GPU" in err, err


@pytest.mark.parametrize("args", [["--backend", "triton", "--tf32"], ["--dtype", "fp16", "--tf32"]])
def test_tf32_is_refused_where_it_would_change_nothing(args, capsys):
    with pytest.raises(SystemExit) as exc:
        from_args(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "--tf32 applies to fp32 runs of the torch" in err


@pytest.mark.parametrize("tf32", [False, True])
def test_a_run_sets_torchs_tf32_flag_as_asked_and_puts_it_back(tf32, monkeypatch):
    import torch

    seen, flag = [], torch.backends.cuda.matmul
    monkeypatch.setattr(train_module, "_train", lambda config: seen.append(flag.allow_tf32))
    before = flag.allow_tf32
    flag.allow_tf32 = not tf32
    try:
        train_module.train(from_args(["--tf32"] if tf32 else []))
        assert seen == [tf32] and flag.allow_tf32 == (not tf32)
    finally:
        flag.allow_tf32 = before


CTRL_C_AT_TORCH = """\
import os, signal, sys

class CtrlCAtTorch:
    # A real SIGINT, as a terminal sends it, the moment the first `import torch` starts: no timer.
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCAtTorch())
"""


def python_ctrl_c_at_torch(args: list[str], tmp_path: Path, interruptible) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(CTRL_C_AT_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60, preexec_fn=interruptible)


@pytest.mark.parametrize("command", [["-m", "trainer.run", "--steps", "1", "--no-progress"],
                                     ["-m", "experiments.quickstart"]])
def test_ctrl_c_while_torch_loads_ends_in_one_line_and_130(command, tmp_path, interruptible):
    ran = python_ctrl_c_at_torch(command, tmp_path, interruptible)
    assert (ran.returncode, ran.stderr, ran.stdout) == (130, "interrupted\n", "")


def test_a_program_importing_the_trainer_reports_its_own_ctrl_c(tmp_path, interruptible):
    ran = python_ctrl_c_at_torch(["-c", "import trainer"], tmp_path, interruptible)
    assert ran.returncode == -signal.SIGINT and ran.stderr.endswith("KeyboardInterrupt\n"), ran.stderr


def test_a_full_disk_keeps_the_rows_written_and_says_where_they_are(tmp_path, monkeypatch, capsys):
    """The CSV's file takes `room` bytes, then answers ENOSPC, as a full disk does."""
    real_open = builtins.open
    room = 200  # the header and a few rows of the 6 steps

    class FillingUp(io.TextIOWrapper):
        def write(self, text):
            if self.buffer.tell() + len(text) > room:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(text)

    def open_(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if mode == "w" and str(path).endswith(".csv"):
            return FillingUp(f.detach(), newline="", write_through=True)
        return f

    monkeypatch.setattr(train_module, "open", open_, raising=False)
    code = main(["--out", str(tmp_path), "--no-progress", "--hidden", "16", "--layers", "1", "--batch-size", "16",
                 "--steps", "40", "--eval-every", "2", "--train-subset", "256"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    (csv,) = (tmp_path / "runs").glob("*.csv")
    rows = csv.read_text().splitlines()[1:]
    assert 0 < len(rows) < 40
    assert err == (f"error: cannot write the run's outputs (No space left on device); the steps so far, "
                   f"{len(rows)} of them, are in {csv}\n")
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, len(rows) + 1))


def test_the_run_json_records_what_ran(tmp_path, monkeypatch):
    summary = train_module.train(trainer_config.Config(out=str(tmp_path), **TINY))
    saved = json.loads((tmp_path / "runs" / summary.csv.split("/")[-1]).with_suffix(".json").read_text())
    assert saved["config"]["steps"] == 6 and saved["config"]["epochs"] is None
    assert saved["summary"]["steps"] == 6 and saved["summary"]["provenance"]["commit"] != "unknown"


@pytest.mark.parametrize("version, commit", [("0.1.0", "kernel-lab 0.1.0, installed (no git checkout)"),
                                             ("", "no git checkout, no SOURCE_COMMIT")])
def test_an_installed_copy_records_its_version_not_unknown(version, commit, tmp_path, monkeypatch):
    monkeypatch.delenv("SOURCE_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "REPO", tmp_path)  # no .git: as in site-packages, or a bare copy
    monkeypatch.setattr(provenance, "_version", lambda dist: version if dist == "kernel-lab" else "")
    assert provenance.git_commit() == commit
    monkeypatch.setenv("SOURCE_COMMIT", "abc1234")
    assert provenance.git_commit() == "abc1234"


@pytest.mark.parametrize("seconds, shown", [(0.4, "0 s"), (52.3, "52 s"), (119, "119 s"), (121, "2 min"),
                                            (900, "15 min")])
def test_the_quickstart_says_seconds_under_two_minutes(seconds, shown):
    assert quickstart._duration(seconds) == shown
