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
    launch (None: untouched), or with one loss of the segment 1% off."""

    def __init__(self, fault=None, loss_off=False):
        self.fault, self.loss_off = fault, loss_off

    def plan(self, x, y, batches, pos, params, bufs, losses, layout, **kw):
        real = persistent.plan(x, y, batches, pos, params, bufs, losses, layout, **kw)

        def launch(steps):
            before = params.clone()
            real.run(steps)
            if self.fault:
                self.fault(params, before, layout)
            if self.loss_off:
                losses[1] *= 1.01

        return SimpleNamespace(run=launch)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,momentum", [("fp32", 0.9), ("fp16", 0.0)])
def test_the_gate_passes_the_kernel_and_fails_each_planted_fault(dtype, momentum):
    """What a trial is judged by: the segment's losses and each tensor's update against float64.
    The kernel passes in fp32 and fp16; a bias never updated, one layer's update 1% short and one
    loss 1% off each fail (the net's weights, 600 times their updates, would hide the first two)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's gate; the GPU's runs in test_both_twins_tune_the_persistent_kernel_on_the_gpu")
    inputs = _inputs(dtype, momentum)
    refs = expected("persistent", inputs)
    precision = gate_precision(persistent_call(*NET, dtype, momentum), None, None)
    assert len(refs) == 1 + 2 * (NET[1] + 1) and precision == dtype
    error, problem = check_result(run(_Faulty(), "persistent", inputs.clone(), None), refs, precision)
    assert problem is None, (error, problem)
    for fault in (dict(fault=_bias_left_alone), dict(fault=_second_layer_short), dict(loss_off=True)):
        _, problem = check_result(run(_Faulty(**fault), "persistent", inputs.clone(), None), refs, precision)
        assert problem is not None, fault


def test_the_inputs_are_an_epoch_of_every_image_and_a_timed_call_is_a_segment_timed_per_step():
    inputs = _inputs()
    x, y, batches, pos, params, bufs, losses = inputs.args
    layout = inputs.kwargs["layout"]
    assert layout == Layout(*NET) and x.shape == (batches.numel(), 784) and losses.numel() == batches.shape[0]
    assert batches.flatten().sort().values.equal(torch.arange(batches.numel())) and params.numel() == layout.numel
    assert (params != 0).all() and (bufs != 0).all() and int(pos) == 0
    assert inputs.kwargs["steps"] == 5 and inputs.kwargs["weight_decay"] == 0
    assert _inputs("fp16", 0.0).kwargs["steps"] == 2 and _inputs("fp16", 0.0).args[5] is None
    what, units = timed("persistent", inputs)
    assert units == min(PERSISTENT["segment"], batches.shape[0]) == what.kwargs["steps"] and inputs.kwargs["steps"] == 5
    assert timed("relu", inputs) == (inputs, 1)


def test_no_hidden_pre_activation_of_the_gates_first_batch_is_near_zero():
    """The hidden biases sit BIAS_SPREADS of their unit's spread from zero (half each way), so a
    kernel's rounding cannot flip a ReLU that float64 keeps: of the first batch's pre-activations
    none within a thousandth of a spread from zero (with biases near zero, about 5 of these 6,144)
    and under 1% within a spread (68%), each layer with units open and units shut."""
    inputs = _inputs(shape=(64, 3, 32))
    x, _, batches, _, params, _, _ = inputs.args
    layout = inputs.kwargs["layout"]
    views, a = layout.views(params.double()), x[batches[0]].double()
    for w, b in zip(views[0:-2:2], views[1:-2:2]):
        z = a @ w
        pre = z + b
        near = pre.abs() / z.std(0)
        assert (near < 1e-3).sum() == 0 and (near < 1).float().mean() < 0.01 and 0 < (pre > 0).float().mean() < 1
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


@pytest.mark.slow  # the tuner in subprocesses
@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's search; the GPU's is in test_trainer_gpu")
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


def test_the_trainer_runs_the_stores_persistent_config(tmp_path):
    """A store entry for the run's net (written as the tuner writes one) is the config --persistent
    runs, and the run's table says so."""
    config = dict(BM=16, BN=16, BK=16, BR=32, BC=16, BL=16, num_warps=4, PROGRAMS=0, SPLIT_K=2)
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
