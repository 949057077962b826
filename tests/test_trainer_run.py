"""Whole runs on the CPU: the CLI's files, learning, NaN stops, config stores, GPU-only errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import kernels_triton
from kernels_core.store import ConfigStore, save_store
from trainer.build import NeedsGpu
from trainer.config import Config, from_args
from trainer.tuned_configs import ConfigStoreRefused, target_name
from trainer.stepper import StepTimer
from trainer.train import Diverged, train

REPO = Path(__file__).resolve().parent.parent
TINY_TRITON = dict(backend="triton", hidden=16, layers=1, batch_size=16, steps=2, progress=False)


@pytest.mark.slow  # a trainer process: torch's import and 50 steps
def test_cli_end_to_end_writes_csv_and_summary(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trainer.run", "--backend", "torch", "--steps", "50", "--hidden", "64",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr, "a progress bar redrawn into a captured log"
    csvs = list((tmp_path / "runs").glob("*_torch_h64.csv"))
    assert len(csvs) == 1
    steps = pd.read_csv(csvs[0])
    assert list(steps.columns) == ["step", "epoch", "loss", "step_time_us"]
    assert steps["step"].tolist() == list(range(1, 51)) and (steps["epoch"] == 1).all()
    assert steps["loss"].notna().all() and (steps["step_time_us"] > 0).all()
    saved = json.loads(csvs[0].with_suffix(".json").read_text())
    summary = saved["summary"]
    assert summary["steps"] == 50 and summary["hidden"] == 64 and summary["backend"] == "torch"
    assert 0.5 < summary["test_accuracy"] <= 1.0 and summary["median_step_us"] > 0
    assert summary["provenance"]["torch"] and summary["provenance"]["commit"]
    assert saved["config"]["steps"] == 50
    assert "test accuracy" in result.stdout


def test_torch_backend_learns_the_full_training_set(tmp_path):
    summary = train(Config(hidden=128, layers=1, batch_size=128, epochs=1, out=str(tmp_path), progress=False))
    assert summary.test_accuracy > 0.95
    assert summary.steps == 468 and summary.epochs == 1.0


def test_steps_are_timed_in_groups_that_stay_inside_a_segment(tmp_path, monkeypatch):
    # 480 images in batches of 16: epochs of 30 steps. Evaluations every 23 steps and at each
    # epoch's end cut steps 0-53 into segments 0-22, 23-29 | 30-45, 46-53 (slots restart at 0 in
    # epoch 2), and groups of at most 16 start at each segment's first slot.
    assert StepTimer.GROUP == 16
    groups, real_stop = [], StepTimer.stop

    def logged_stop(self, first, steps):
        groups.append((first, steps))
        real_stop(self, first, steps)

    monkeypatch.setattr(StepTimer, "stop", logged_stop)
    train(Config(hidden=16, layers=1, batch_size=16, steps=54, eval_every=23, train_subset=480,
                 out=str(tmp_path), progress=False))
    assert groups == [(0, 16), (16, 7), (23, 7), (0, 16), (16, 8)]
    times = pd.read_csv(next((tmp_path / "runs").glob("*.csv")))["step_time_us"].tolist()
    bounds = [0, 16, 23, 30, 46, 54]
    assert len(times) == 54 and all(t > 0 for t in times)
    for lo, hi in zip(bounds, bounds[1:]):
        assert len(set(times[lo:hi])) == 1, (lo, hi, times[lo:hi])  # one mean per group
    assert all(times[lo] != times[hi] for lo, hi in zip(bounds, bounds[1:-1]))  # each its own


def test_nan_loss_stops_the_run_naming_the_step(tmp_path):
    # lr=1e30 (finite, so the config takes it) makes step 1's update overflow step 2's logits: its loss is NaN.
    config = Config(hidden=16, layers=1, batch_size=16, steps=5, eval_every=5, lr=1e30,
                    out=str(tmp_path), progress=False)
    with pytest.raises(Diverged, match=r"loss became nan at step 2 \(epoch 1\)"):
        train(config)
    steps = pd.read_csv(next((tmp_path / "runs").glob("*.csv")))
    assert steps["step"].tolist() == [1, 2] and pd.isna(steps["loss"][1])


def test_cli_reports_nan_and_exits_nonzero(tmp_path, capsys):
    from trainer.run import main

    code = main(["--backend", "torch", "--steps", "3", "--hidden", "16", "--lr", "1e30", "--out", str(tmp_path),
                 "--no-progress"])
    assert code == 1
    assert "at step 2" in capsys.readouterr().err


def test_preset_seed_and_explicit_flags_override_it():
    seed = from_args(["--preset", "seed"])
    assert (seed.layers, seed.batch_size, seed.lr, seed.momentum, seed.steps, seed.dtype) == (3, 32, 0.003, 0.0, 5000, "fp16")
    tweaked = from_args(["--preset", "seed", "--lr", "0.01", "--epochs", "2"])
    assert tweaked.lr == 0.01 and tweaked.steps is None and tweaked.epochs == 2 and tweaked.layers == 3
    with pytest.raises(ValueError, match="torch backend only"):
        Config(backend="triton", torch_graph=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_backend_without_gpu_says_it_needs_one(tmp_path):
    with pytest.raises(NeedsGpu, match="needs an NVIDIA GPU"):
        train(Config(backend="cuda", out=str(tmp_path), progress=False))


def _store_file(tmp_path, entries):
    store = ConfigStore(target_name("auto"))  # the trainer reads the local GPU's store (cpu without one)
    for entry in entries:
        store.put(entry)
    path = tmp_path / "best.json"
    save_store(path, store)
    return path


def test_config_table_shows_tuned_nearest_and_default(tmp_path, capsys):
    default = dict(kernels_triton.space("matmul", "fp32").default)
    tuned = {**default, "BLOCK_M": 32, "BLOCK_N": 64, "GROUP_M": 1}
    path = _store_file(tmp_path, [{"op": "matmul", "backend": "triton", "dtype": "fp32",
                                   "shape": "16x16x784:nn", "config": tuned}])
    summary = train(Config(**TINY_TRITON, tuned_configs=str(path), out=str(tmp_path)))
    table = capsys.readouterr().err
    rows = {tuple(line.split()[:3]) for line in table.splitlines()}
    assert ("matmul", "16x16x784:nn", "tuned") in rows
    # The fused step's logits GEMM has no entry: it borrows the nearest matmul config of its GEMM.
    assert ("linear_cross_entropy", "16x10x16:nn", "matmul:nearest:16x16x784:nn") in rows
    assert ("linear_sgd", "784x16x16:tn", "default") in rows
    assert "BLOCK_M=32 BLOCK_N=64 GROUP_M=1" in table
    assert summary.config_source == "mixed"
    saved = json.loads(Path(summary.csv).with_suffix(".json").read_text())
    assert "nearest:16x16x784:nn" in saved["kernel_configs"]

    train(Config(**TINY_TRITON, tuned_configs=str(path), out=str(tmp_path), fuse=False))
    rows = {tuple(line.split()[:3]) for line in capsys.readouterr().err.splitlines()}
    assert ("matmul", "16x10x16:nn", "nearest:16x16x784:nn") in rows
    assert ("matmul", "784x16x16:tn", "default") in rows
    assert ("sgd_update", "12730", "default") in rows


def test_corrupt_config_store_is_refused_unless_defaults_are_allowed(tmp_path, capsys):
    bad = _store_file(tmp_path, [{"op": "matmul", "backend": "triton", "dtype": "fp32",
                                  "shape": "16x16x784:nn", "config": {"BLOCK_M": 3}}])
    with pytest.raises(ConfigStoreRefused, match=r"(?s)best.json: entry 0.*BLOCK_M=3 is outside.*--allow-default-configs"):
        train(Config(**TINY_TRITON, tuned_configs=str(bad), out=str(tmp_path)))

    (tmp_path / "garbage.json").write_text("{not json")
    summary = train(Config(**TINY_TRITON, tuned_configs=str(tmp_path / "garbage.json"), allow_default_configs=True,
                           out=str(tmp_path)))
    assert "not valid JSON" in capsys.readouterr().err
    assert summary.config_source == "default" and summary.steps == 2


def test_another_gpus_store_is_refused_unless_defaults_are_allowed(tmp_path, monkeypatch):
    from trainer import tuned_configs

    path = _store_file(tmp_path, [])
    monkeypatch.setattr(tuned_configs, "local_gpu", lambda: ("sm_86", "a smaller GPU"))
    cfg = Config(**{**TINY_TRITON, "target": "sm_90"}, tuned_configs=str(path), out=str(tmp_path))
    with pytest.raises(ConfigStoreRefused, match=r"--target sm_90 is not this GPU \(sm_86\)"):
        tuned_configs.open_store(cfg)
    assert tuned_configs.open_store(Config(**{**TINY_TRITON, "target": "sm_90"}, tuned_configs=str(path), out=str(tmp_path),
                                     allow_default_configs=True)) == (None, "none")
