"""The persistent training kernel in the tuner and the store (op "persistent"): its gate against
float64 passes the kernel and fails a planted fault, a search writes its winner, the trainer's
--persistent runs the store's config, and the search flags keep it apart from the contract's ops.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autotune.workload import PERSISTENT, check_result, expected, gate_precision, make_inputs, run, timed
from kernels_core.mlp import persistent_call
from kernels_core.persistent import Layout
from kernels_triton import persistent

REPO = Path(__file__).resolve().parent.parent
NET = (16, 1, 16)  # hidden, layers, batch: 784-16-10, the smallest net the interpreter trains in seconds


def _inputs(dtype="fp32", momentum=0.9, shape=NET):
    generator = torch.Generator().manual_seed(int(os.environ.get("KERNEL_TEST_SEED", "0")))
    return make_inputs("persistent", dtype, shape, "mlp", "cpu", generator, momentum=momentum)


def _bias_left_alone(params, before, layout):
    _, b0 = layout.offsets()[0]
    params[b0:b0 + layout.hidden] = before[b0:b0 + layout.hidden]


def _second_layer_short(params, before, layout):
    w1, _ = layout.offsets()[1]
    at = slice(w1, w1 + layout.hidden * layout.classes)
    params[at] = before[at] + 0.99 * (params[at] - before[at])


class _Faulty:
    """The Triton twin's persistent module with `fault(params, before, layout)` applied after each
    launch (None: untouched), or with the segment's first loss 1% off, the position left where it
    was, or the momentum buffers left alone."""

    def __init__(self, fault=None, loss_off=False, pos_kept=False, bufs_kept=False):
        self.fault, self.loss_off, self.pos_kept, self.bufs_kept = fault, loss_off, pos_kept, bufs_kept

    def plan(self, x, y, batches, pos, params, bufs, losses, layout, **kw):
        real = persistent.plan(x, y, batches, pos, params, bufs, losses, layout, **kw)

        def launch(steps):
            before, start, bufs_before = params.clone(), pos.clone(), bufs.clone() if bufs is not None else None
            real.run(steps)
            if self.fault:
                self.fault(params, before, layout)
            if self.loss_off:
                losses[int(start) % batches.shape[0]] *= 1.01
            if self.pos_kept:
                pos.copy_(start)
            if self.bufs_kept:
                bufs.copy_(bufs_before)

        return SimpleNamespace(run=launch)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,momentum", [("fp32", 0.9), ("fp16", 0.0)])
def test_the_gate_passes_the_kernel_and_fails_each_planted_fault(dtype, momentum):
    """What a trial is judged by: the segment's losses, its move of the position, each tensor's
    update and each momentum buffer's against float64. The kernel passes in fp32 and fp16; a bias
    never updated, one layer's update 1% short, one loss 1% off, the position not moved and the
    buffers not updated each fail (the net's weights, 600 times their updates, would hide the first
    two)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's gate; the GPU's: tests/test_autotune_search.py, "
                    "test_both_twins_tune_the_persistent_kernel_on_the_gpu_per_step")
    inputs = _inputs(dtype, momentum)
    refs = expected("persistent", inputs)
    precision = gate_precision(persistent_call(*NET, dtype, momentum), None, None)
    assert len(refs) == 2 + 2 * (NET[1] + 1) * (2 if momentum else 1) and precision == dtype
    error, problem = check_result(run(_Faulty(), "persistent", inputs.clone(), None), refs, precision)
    assert problem is None, (error, problem)
    faults = [dict(fault=_bias_left_alone), dict(fault=_second_layer_short), dict(loss_off=True), dict(pos_kept=True)]
    for fault in faults + ([dict(bufs_kept=True)] if momentum else []):
        _, problem = check_result(run(_Faulty(**fault), "persistent", inputs.clone(), None), refs, precision)
        assert problem is not None, fault


def test_the_inputs_are_an_epoch_of_every_image_and_a_timed_call_is_a_segment_timed_per_step():
    inputs = _inputs()
    x, y, batches, pos, params, bufs, losses = inputs.args
    layout = inputs.kwargs["layout"]
    assert layout == Layout(*NET) and x.shape == (batches.numel(), 784) and losses.numel() == batches.shape[0]
    assert batches.flatten().sort().values.equal(torch.arange(batches.numel())) and params.numel() == layout.numel
    assert (params != 0).all() and (bufs != 0).all() and int(pos) == batches.shape[0] - 1  # the gate wraps
    assert inputs.kwargs["steps"] == 2 and inputs.kwargs["weight_decay"] == 0
    assert _inputs("fp16", 0.0).args[5] is None
    what, units = timed("persistent", inputs)
    assert units == min(PERSISTENT["segment"], batches.shape[0]) == what.kwargs["steps"] and inputs.kwargs["steps"] == 2
    assert timed("relu", inputs) == (inputs, 1)


def test_every_hidden_relu_of_the_gate_is_open_for_some_rows_and_shut_for_others_none_near_its_edge():
    """Each hidden bias sits in a gap of its unit's pre-activations over the gate's rows, so a
    kernel's rounding cannot flip a ReLU that float64 keeps (none within a thousandth of its unit's
    spread of zero; with biases drawn near zero, 1 in 1,000 of these 5,120 is), and a mask read
    from the wrong row changes the gradient (each unit open for a quarter to three quarters of the
    rows; with biases drawn 4 spreads from zero, none)."""
    inputs = _inputs(shape=(64, 3, 32))
    x, _, batches, pos, params, _, _ = inputs.args
    layout = inputs.kwargs["layout"]
    rows = batches[(torch.arange(inputs.kwargs["steps"]) + int(pos)) % batches.shape[0]].flatten()
    views, a = layout.views(params.double()), x[rows].double()
    for w, b in zip(views[0:-2:2], views[1:-2:2]):
        pre = a @ w + b
        near, open_share = pre.abs() / pre.std(0), (pre > 0).double().mean(0)
        assert (near < 1e-3).sum() == 0 and (open_share >= 0.24).all() and (open_share <= 0.76).all()
        a = torch.relu(pre)


def test_the_search_flags_leave_the_persistent_kernel_to_whoever_names_it():
    from autotune import search
    from autotune.plan import build_plan

    base = ["--target", "cpu", "--backends", "triton", "--hidden", "16", "--layers", "1", "--batch-size", "16"]
    everything = build_plan(search.parse_args(base))
    assert everything.jobs and "persistent" not in {job.call.op for job in everything.jobs}
    named = build_plan(search.parse_args(base + ["--ops", "persistent"]))
    assert [job.call for job in named.jobs] == [persistent_call(16, 1, 16, "fp32")]
    assert named.jobs[0].call.study_key == "16x1x16:mlp"
    assert persistent_call(16, 1, 16, "fp16", 0.0).study_key == "16x1x16:mlp:no-momentum"
    shapes = build_plan(search.parse_args(base[:4] + ["--ops", "persistent", "--shapes", "16x16x16"]))
    assert not shapes.jobs and any("tuned on the mnist-mlp workload's net" in s for s in shapes.skipped)
    offline = build_plan(search.parse_args(["--compile-only", "--target", "sm_90", "--ops", "persistent,matmul"]))
    assert {job.call.op for job in offline.jobs} == {"matmul"}
    assert any(s.startswith("persistent: --compile-only has no compile report") for s in offline.skipped)


@pytest.mark.slow  # the tuner in subprocesses
@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's search (the GPU's is in test_autotune_search)")
def test_a_search_writes_the_persistent_kernels_winner_and_the_trainer_runs_it(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "autotune.search", "--target", "cpu", "--backends", "triton", "--ops", "persistent",
         "--hidden", "16", "--layers", "1", "--batch-size", "16", "--trials", "2", "--workers", "1", "--out",
         str(out), "--storage", f"sqlite:///{tmp_path / 'tuning.db'}"],
        cwd=REPO, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=560)
    assert result.returncode == 0, result.stdout + result.stderr
    (entry,) = json.loads((out / "cpu" / "best.json").read_text())["entries"]
    assert (entry["op"], entry["shape"]) == ("persistent", "16x1x16:mlp") and entry["time_ms"] > 0
    _check_the_trainer_runs(out / "cpu" / "best.json", entry["config"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a store of the cpu target, which a GPU's run refuses")
def test_the_trainer_runs_the_stores_persistent_config(tmp_path):
    """A store entry for the run's net (written as the tuner writes one) is the config --persistent
    runs, and the run's table says so."""
    config = dict(BM=16, BN=16, BK=16, BR=32, BR0=16, BC=16, BL=16, num_warps=4, PROGRAMS=0, SPLIT_K=2)
    path = tmp_path / "best.json"
    path.write_text(json.dumps({"target": "cpu", "format": 1, "entries": [
        dict(op="persistent", backend="triton", dtype="fp32", shape="16x1x16:mlp", config=config, time_ms=0.5)]}))
    _check_the_trainer_runs(path, config)


def _check_the_trainer_runs(store: Path, config: dict):
    from trainer.config import Config
    from trainer.train import build

    built = build(Config(backend="triton", persistent="on", hidden=16, layers=1, batch_size=16,
                         tuned_configs=str(store), train_subset=512, progress=False))
    assert built.backend.plan.config == config
    assert built.configs.sources() == "tuned" and "persistent" in built.configs.table()
