"""Targets, workload shapes, the config store and the studies' bookkeeping, in process
(no subprocesses; the studies on SQLite and on a local PostgreSQL server, tests/postgres.py)."""
from __future__ import annotations

import json
import math
import subprocess
import threading
import time
import types

import optuna
import pytest
import torch
from optuna.trial import TrialState

from autotune import studies, workload
from autotune.samplers import SpaceView, config_key, make_sampler
from autotune.storage import HOST, OWNER, counts_toward_budget, measured_elsewhere, open_storage, reap_dead
from kernels_core import mlp, shapes, targets
from kernels_core import backends
from kernels_core.store import ConfigStore, StoreError, load_store, save_store
from kernels_core.space import Space
from tests import fake_backend

SM75, SM90 = targets.TARGETS["sm_75"], targets.TARGETS["sm_90"]
# Expected: the runner uses Optuna's heartbeat (experimental) with ask/tell, not `optimize`.
pytestmark = [pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
              pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")]


def fake_space(backend, op, dtype):
    assert backend == "fake"
    return fake_backend.space(op, dtype)


@pytest.fixture(autouse=True)
def fake_registered(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")


# -- targets -------------------------------------------------------------------------

def test_target_facts():
    assert SM90.arch == 90 and SM90.name == "sm_90"
    assert SM75.smem_per_block_optin == 64 * 1024 and SM90.smem_per_block_optin == 227 * 1024
    assert targets.TARGETS["sm_86"].smem_per_block_optin == targets.TARGETS["sm_89"].smem_per_block_optin == 99 * 1024
    assert all(t.max_threads_per_block == 1024 for t in targets.TARGETS.values())
    assert SM90.peak("tflops", "bf16") == 750.0 and SM90.peak("gbps", "fp16") == 4245.0
    assert targets.TARGETS["sm_80"].peak("tflops", "fp16") is None


def test_target_violation_prunes_smem_threads_and_dtype():
    space = Space(params={"T": (256, 2048), "S": (1, 100)}, default={"T": 256, "S": 1},
                  threads="T", smem_bytes="S * 1024")
    assert SM90.target_violation(space, {"T": 256, "S": 1}, 2) is None
    assert "threads per block" in SM90.target_violation(space, {"T": 2048, "S": 1}, 2)
    assert "shared memory" in SM75.target_violation(space, {"T": 256, "S": 100}, 2)
    assert SM90.target_violation(space, {"T": 256, "S": 100}, 2) is None
    assert "outside the space" in SM90.target_violation(space, {"T": 3, "S": 1}, 2)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_which_gpus_an_op_runs_on_is_the_spaces_to_say(backend):
    """bf16 tensor-core matmul needs sm_80: the twins' spaces say so, and a target finds no config."""
    module = backends.load(backend)
    assert "arch >= 80" in SM75.space_problem(module.space("matmul", "bf16"), 2)
    assert targets.TARGETS["sm_80"].space_problem(module.space("matmul", "bf16"), 2) is None
    assert SM75.space_problem(module.space("matmul", "fp16"), 2) is None
    assert SM75.space_problem(module.space("relu", "bf16"), 2) is None


def test_timing_a_target_without_a_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(targets.TargetError, match="--compile-only"):
        targets.resolve_target("auto", compile_only=False)
    with pytest.raises(targets.TargetError, match="no CUDA GPU"):
        targets.resolve_target("sm_90", compile_only=False)
    assert targets.resolve_target("sm_75", compile_only=True) is SM75


# -- workload ------------------------------------------------------------------------

def test_shape_keys_and_parsing():
    assert shapes.shape_key((128, 1024, 784), "nn") == "128x1024x784:nn"
    assert shapes.shape_key((128, 1024)) == "128x1024"
    assert shapes.parse_shapes("4096x4096x4096, 128x1024x784:tn,128x10,99") == [
        ((4096, 4096, 4096), "nn"), ((128, 1024, 784), "tn"), ((128, 10), ""), ((99,), "")]
    for bad in ("4096xx4", "128x10:tn", "1x2x3:qq", "0x4", "", f"{2**31}x4", f"{2**64}"):
        with pytest.raises(ValueError, match="--shapes"):
            shapes.parse_shapes(bad)
    assert shapes.parse_shapes(f"{2**31 - 1}x1") == [((2**31 - 1, 1), "")]


@pytest.mark.parametrize("item, layout, rank", [("4x4x4:qq", "qq", 3), ("7x3x5:NT", "NT", 3), ("9x2x1:n", "n", 3),
                                               ("128x10:tn", "tn", 2), ("99:nn", "nn", 1), ("6x8:zz", "zz", 2)])
def test_a_bad_layout_is_named_with_what_is_allowed(item, layout, rank):
    with pytest.raises(ValueError) as info:
        shapes.parse_shapes(f"16x16x16,{item}")
    message = str(info.value)
    assert f"layout {layout!r} in {item!r}" in message and "\n" not in message
    if rank == 3:  # a matmul shape: its layout is not one of the four
        assert "is not one of nn, tn, nt, tt" in message and "only matmul" not in message
    else:
        assert "only matmul shapes (MxNxK) take a layout" in message


def test_mlp_calls():
    calls = mlp.mlp_calls(hidden=256, layers=2, batch=64, dtype="fp16")
    got = {(c.op, c.key): c for c in calls}
    assert got[("matmul", "64x256x784:nn")].bias and got[("matmul", "64x256x784:nn")].activation == "relu"
    assert got[("matmul", "64x256x256:nn")].activation == "relu"
    assert got[("matmul", "64x10x256:nn")].activation is None and got[("matmul", "64x10x256:nn")].bias
    for key in ("784x256x64:tn", "256x256x64:tn", "256x10x64:tn", "64x256x10:nt", "64x256x256:nt"):
        assert ("matmul", key) in got and not got[("matmul", key)].bias
    assert ("matmul", "64x784x256:nt") not in got  # the input layer needs no dX
    assert {("relu_backward", "64x256"), ("bias_grad", "64x256"), ("bias_grad", "64x10"),
            ("softmax_cross_entropy", "64x10")} <= set(got)
    params = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert ("sgd_update", str(params)) in got
    # Both steps' calls: the fused one adds its logits GEMM with the loss and one SGD GEMM per layer.
    assert {("linear_cross_entropy", "64x10x256:nn"), ("linear_sgd", "784x256x64:tn"),
            ("linear_sgd", "256x256x64:tn"), ("linear_sgd", "256x10x64:tn")} <= set(got)
    assert len(calls) == len(got) == 8 + 5 + 4  # duplicates removed
    # The fused step's variants of a GEMM stand for it (they are the stricter calls): the batch
    # gathered in the first layer's A loads, dX masked by the ReLU below.
    assert {key: c.fused_arg for (op, key), c in got.items() if c.fused_arg} == {
        "64x256x784:nn": "a_rows", "64x256x10:nt": "relu_grad_of", "64x256x256:nt": "relu_grad_of"}
    assert len(mlp.mlp_calls(256, 1, 64, "fp16")) == 2 + 2 + 1 + 5 + 3


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_mlp_calls_of_each_step(layers):
    fused = mlp.mlp_calls(hidden=96, layers=layers, batch=32, dtype="fp32", fused=True)
    unfused = mlp.mlp_calls(hidden=96, layers=layers, batch=32, dtype="fp32", fused=False)
    assert {c.op for c in fused} == {"matmul", "linear_cross_entropy", "linear_sgd"}
    assert not {"linear_cross_entropy", "linear_sgd"} & {c.op for c in unfused}
    # The fused step: every layer's forward and SGD GEMM, dX of all but the input layer; one call per
    # distinct shape, so the hidden layers' repeats collapse.
    assert len(fused) == (2 if layers == 1 else 3) + (2 if layers == 1 else 3) + (1 if layers == 1 else 2)
    both = mlp.mlp_calls(hidden=96, layers=layers, batch=32, dtype="fp32")
    assert {(c.op, c.key) for c in both} == {(c.op, c.key) for c in fused + unfused}


@pytest.mark.parametrize("op,shape,layout", [
    ("matmul", (8, 12, 16), "tn"), ("relu_backward", (4, 8), ""), ("softmax_cross_entropy", (6, 10), ""),
    ("sgd_update", (50,), ""), ("bias_add", (4, 8), ""), ("linear_cross_entropy", (6, 10, 12), "nn"),
    ("linear_sgd", (9, 5, 7), "tn")])
def test_inputs_are_fresh_random_and_the_reference_checks_them(op, shape, layout):
    gen = torch.Generator().manual_seed(1)
    inputs = workload.make_inputs(op, "fp32", shape, layout, "cpu", gen, bias=True, activation="relu")
    tensors = [t for a in inputs.args for t in (a if isinstance(a, list) else [a])]
    assert all(t.abs().sum() > 0 for t in tensors)
    if op == "matmul":
        assert inputs.args[0].shape == (16, 8) and inputs.kwargs["trans_a"] and not inputs.kwargs["trans_b"]
    if op == "softmax_cross_entropy":
        assert inputs.args[1].dtype == torch.int64 and inputs.args[1].max() < 10
    from kernels_core.reference import native
    outputs = workload.run(getattr(native, op), op, inputs.clone(), None)
    error, problem = workload.check_result(outputs, workload.expected(op, inputs))
    assert error < 1e-5 and problem is None
    outputs[0].view(-1)[-1] += 0.1 * outputs[0].abs().max()  # one element off by a tenth
    assert workload.check_result(outputs, workload.expected(op, inputs))[1] is not None
    outputs[0].view(-1)[0] = float("nan")
    assert workload.check_result(outputs, workload.expected(op, inputs)) == (float("inf"), "output 0: NaN or Inf")


@pytest.mark.parametrize("fused_arg", ["a_rows", "relu_grad_of"])
def test_inputs_of_the_fused_steps_matmuls_are_checked_with_their_argument(rng, fused_arg):
    m, n, k = (int(v) for v in torch.randint(3, 40, (3,), generator=rng))
    inputs = workload.make_inputs("matmul", "fp32", (m, n, k), "nn" if fused_arg == "a_rows" else "nt", "cpu", rng,
                                  fused_arg=fused_arg)
    from kernels_core.reference import native
    (out,) = workload.run(native.matmul, "matmul", inputs.clone(), None)
    assert out.shape == (m, n) and workload.check_result([out], workload.expected("matmul", inputs))[1] is None
    if fused_arg == "a_rows":
        assert inputs.args[0].shape == (3 * m, k) and inputs.kwargs["a_rows"].shape == (m,)
    else:
        assert (out == 0).any() and (out != 0).any()  # masked where the layer below's output is <= 0
    # The reference honours the argument: the plain product fails the check.
    plain = native.matmul(inputs.args[0], inputs.args[1], trans_b=fused_arg == "relu_grad_of")
    if fused_arg == "a_rows":
        plain = plain[:m]
    assert workload.check_result([plain], workload.expected("matmul", inputs))[1] is not None


@pytest.mark.parametrize("op", ["sgd_update", "linear_sgd"])
def test_sgd_calls_without_momentum_keep_no_buffers_and_are_checked(rng, op):
    """The seed protocol's SGD (momentum 0) has no buffers: none is made, the outputs are the
    params alone, and an update that applied a momentum buffer anyway fails the check."""
    k, n, b = (int(v) for v in torch.randint(2, 40, (3,), generator=rng))
    shape = (k * n,) if op == "sgd_update" else (k, n, b)
    from kernels_core.reference import native
    inputs = workload.make_inputs(op, "fp32", shape, "tn" if op == "linear_sgd" else "", "cpu", rng, momentum=0.0)
    bufs = [inputs.args[2]] if op == "sgd_update" else list(inputs.args[4:6])
    assert inputs.kwargs["momentum"] == 0 and all(buf is None for buf in bufs)
    outputs = workload.run(getattr(native, op), op, inputs.clone(), None)
    assert len(outputs) == (1 if op == "sgd_update" else 2)
    assert workload.check_result(outputs, workload.expected(op, inputs))[1] is None
    with_bufs = workload.make_inputs(op, "fp32", shape, "tn" if op == "linear_sgd" else "", "cpu", rng)
    assert with_bufs.kwargs["momentum"] == workload.SGD_HYPER["momentum"]
    assert len(workload.run(getattr(native, op), op, with_bufs.clone(), None)) == 2 * len(outputs)
    # The step with momentum, bufs random: not the plain step the reference wants.
    momentum = inputs.clone()
    args = list(momentum.args)
    if op == "sgd_update":
        args[2] = [torch.randn(k * n, generator=rng)]
    else:
        args[4:6] = [torch.randn(k, n, generator=rng), torch.randn(n, generator=rng)]
    native_call = getattr(native, op)
    native_call(*args, **dict(momentum.kwargs, momentum=0.9))
    moved = list(args[0]) if op == "sgd_update" else list(args[2:4])
    assert workload.check_result(moved, workload.expected(op, inputs))[1] is not None


def test_the_momentum_reaches_the_sgd_calls_and_names_their_studies():
    plain = mlp.mlp_calls(hidden=96, layers=2, batch=32, dtype="fp16")
    seed = mlp.mlp_calls(hidden=96, layers=2, batch=32, dtype="fp16", momentum=0.0)
    assert [(c.op, c.key) for c in plain] == [(c.op, c.key) for c in seed]  # the store's keys
    for c, z in zip(plain, seed):
        assert c.study_key == c.key and c.momentum == workload.SGD_HYPER["momentum"]
        if z.op in mlp.SGD_OPS:
            assert z.momentum == 0 and z.study_key == z.key + ":no-momentum"
        else:  # the GEMMs move the same bytes either way: one study for both protocols
            assert z.study_key == z.key
    shaped = workload.calls_for_shapes(["sgd_update", "matmul"], "fp32", [((1000,), ""), ((8, 8, 8), "nn")], 0.0)
    assert [c.study_key for c in shaped] == ["1000:no-momentum", "8x8x8:nn"]


@pytest.mark.parametrize("op,shape,layout", [("sgd_update", [37], ""), ("linear_sgd", [5, 3, 4], "tn")])
def test_the_worker_builds_an_sgd_calls_inputs_at_the_requests_momentum(op, shape, layout):
    """The momentum travels in the worker's request, through call_inputs: at 0 the prepared call
    has no buffers, and the check passes on the params alone."""
    from autotune.worker import Runner

    runner = Runner()
    for momentum in (0.0, 0.9):
        req = {"backend": "torch", "op": op, "dtype": "fp32", "shape": shape, "layout": layout,
               "momentum": momentum, "seed": 1, "device": "cpu"}
        assert runner.prepare(req)["ok"]
        args = runner.prepared[3].args
        bufs = [args[2]] if op == "sgd_update" else list(args[4:6])
        assert all((buf is None) == (momentum == 0) for buf in bufs)
        assert runner.measure({"reps": 3, "max_seconds": 0.01})["ok"]


def test_the_gate_catches_one_wrong_tile_of_a_big_bf16_matmul():
    gen = torch.Generator().manual_seed(2)
    inputs = workload.make_inputs("matmul", "bf16", (2048, 2048, 64), "nn", "cpu", gen)
    from kernels_core.reference import native
    (out,) = workload.run(getattr(native, "matmul"), "matmul", inputs.clone(), None)
    refs = workload.expected("matmul", inputs)
    assert workload.check_result([out], refs)[1] is None
    out[-32:, -32:] = 0  # a tile the kernel never wrote: the norm-wise error alone lets it pass
    error, problem = workload.check_result([out], refs)
    assert error < workload.TOLERANCE["bf16"] and "worst element" in problem


def test_flops_and_bytes():
    assert workload.flops_bytes("matmul", (2, 3, 4), "fp16") == (48.0, 2.0 * (8 + 12 + 6))
    flops, nbytes = workload.flops_bytes("relu", (10, 10), "fp32")
    assert flops is None and nbytes == 800
    assert workload.throughput("matmul", (1000, 1000, 1000), "fp16", 1.0) == pytest.approx(2.0)
    # SGD's fp32 state: the weight, and with momentum its buffer, each read and written.
    assert workload.flops_bytes("sgd_update", (100,), "fp16") == (None, 100 * (16 + 2))
    assert workload.flops_bytes("sgd_update", (100,), "fp16", momentum=0.0) == (None, 100 * (8 + 2))
    flops, nbytes = workload.flops_bytes("linear_sgd", (6, 5, 4), "fp16", momentum=0.0)
    assert flops == 2.0 * 6 * 5 * 4 and nbytes == 2 * 4 * (6 + 5) + 8 * (6 * 5 + 5)


# -- config store --------------------------------------------------------------------

def entry(shape="64x64", config=None, **extra):
    return {"op": "relu", "backend": "fake", "dtype": "fp16", "shape": shape,
            "config": config or {"BLOCK": 128, "MODE": 0}, "time_ms": 0.01, **extra}


def write(path, data):
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_store_roundtrip_and_lookup(tmp_path):
    store = ConfigStore("sm_90")
    store.put(entry("64x64", {"BLOCK": 64, "MODE": 0}))
    store.put(entry("4096x4096", {"BLOCK": 256, "MODE": 0}))
    mm = {"op": "matmul", "backend": "fake", "dtype": "fp16", "shape": "128x1024x784:nn",
          "config": {"BLOCK_M": 32, "BLOCK_N": 64, "SPLIT": 1}}
    store.put(mm)
    path = tmp_path / "best.json"
    save_store(path, store)
    loaded = load_store(path, "sm_90", space_of=fake_space)
    assert loaded.lookup("relu", "fake", "fp16", "64x64") == ({"BLOCK": 64, "MODE": 0}, "tuned")
    assert loaded.lookup("relu", "fake", "fp16", "3000x5000") == ({"BLOCK": 256, "MODE": 0}, "nearest:4096x4096")
    assert loaded.lookup("relu", "fake", "fp16", "100x50") == ({"BLOCK": 64, "MODE": 0}, "nearest:64x64")
    assert loaded.lookup("matmul", "fake", "fp16", "128x1024x1024:nn")[1] == "nearest:128x1024x784:nn"
    assert loaded.lookup("matmul", "fake", "fp16", "128x1024x1024:tn") == (None, "default")
    assert loaded.lookup("relu", "fake", "fp32", "64x64") == (None, "default")
    merged = loaded.merge(ConfigStore("sm_90", {("relu", "fake", "fp16", "64x64"): entry(config={"BLOCK": 128, "MODE": 0})}))
    assert merged.lookup("relu", "fake", "fp16", "64x64")[0] == {"BLOCK": 128, "MODE": 0}
    assert load_store(path, "sm_90").lookup("relu", "fake", "fp16", "64x64")[1] == "tuned"  # registry resolves fake


def test_an_entry_from_before_a_tunable_existed_loads_with_its_default(tmp_path):
    """A config written before its space gained a tunable ran what the tunable's default runs."""
    path = write(tmp_path / "best.json", {"target": "sm_90", "entries": [entry(config={"BLOCK": 128})]})
    store = load_store(path, "sm_90", space_of=fake_space)
    assert store.lookup("relu", "fake", "fp16", "64x64")[0] == {"BLOCK": 128, "MODE": 0}
    path = write(tmp_path / "best.json", {"target": "sm_90", "entries": [entry(config={"BLOCK": 100})]})
    with pytest.raises(StoreError, match="outside the space"):  # what it has is still checked
        load_store(path, "sm_90", space_of=fake_space)


@pytest.mark.parametrize("data,match", [
    ("{not json", "not valid JSON"),
    ({"target": "sm_80", "entries": []}, "written for target 'sm_80'"),
    ({"target": "sm_90", "entries": [], "extra": 1}, "unknown top-level key"),
    ({"target": "sm_90", "entries": [entry(colour="red")]}, r"entry 0 \(relu:fake:fp16:64x64\): unknown key"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 128, "MODE": 0, "X": 1})]}, "unknown tunable"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 128.0, "MODE": 0})]}, "BLOCK=128.0 is not an integer"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 128, "MODE": True})]}, "MODE=True is not an integer"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 100, "MODE": 0})]}, "outside the space"),
    ({"target": "sm_90", "entries": [dict(entry(), dtype="fp32", config={"BLOCK": 256, "MODE": 0})]},
     "restriction `BLOCK \\* elt <= 512` fails"),
    ({"target": "sm_90", "entries": [dict(entry(), op="conv")]}, "unknown op 'conv'"),
    ({"target": "sm_90", "entries": [dict(entry(), backend="nope")]}, "unknown backend 'nope'"),
    ({"target": "sm_90", "entries": [dict(entry(), dtype="fp8")]}, "unknown dtype"),
    ({"target": "sm_90", "entries": [entry(shape="64x64x64:nn")]}, "2 dimension"),
    ({"target": "sm_90", "entries": [dict(entry(), op="linear_sgd", shape="64x64x64:nn")]},
     "linear_sgd's shapes have layout 'tn'"),
    ({"target": "sm_90", "entries": [dict(entry(), op="linear_cross_entropy", shape="64x10x64")]},
     "shapes have layout 'nn'"),
    ({"target": "sm_90", "entries": [entry(), entry()]}, "second entry"),
    ({"target": "sm_90", "entries": [entry(time_ms="fast")]}, "time_ms='fast' is not a float"),
])
def test_store_refuses_bad_files(tmp_path, data, match):
    path = write(tmp_path / "best.json", data)
    with pytest.raises(StoreError, match=match) as info:
        load_store(path, "sm_90", space_of=fake_space)
    assert str(path) in str(info.value)


def test_store_refuses_a_config_the_target_cannot_run(tmp_path):
    mm = {"op": "matmul", "backend": "fake", "dtype": "bf16", "shape": "8x8x8:nn",
          "config": {"BLOCK_M": 32, "BLOCK_N": 64, "SPLIT": 1}}
    path = write(tmp_path / "best.json", {"target": "sm_75", "entries": [mm]})
    with pytest.raises(StoreError, match="arch >= 80"):
        load_store(path, "sm_75", space_of=fake_space)


# -- studies: the budget, repeats and dead processes, on a real storage ---------------

def _view(values: dict, check=lambda c: None, enumerate_valid: bool = True) -> SpaceView:
    import itertools
    combos = [dict(zip(values, c)) for c in itertools.product(*values.values())]
    valid = [c for c in combos if check(c) is None] if enumerate_valid else None
    return SpaceView(None, values, valid, len(combos))


def _runner(study, budget, values, check=lambda c: None, **kw) -> studies.StudyRunner:
    return studies.StudyRunner(study, _view(values, check), budget, check,
                               make_row=lambda config, result, number: {**config, **result, "trial": number}, **kw)


def _run(runner, timeout_s: float = 60) -> list[dict]:
    """Measure every candidate the runner hands out (a made-up time per config) until it stops;
    a runner still busy after `timeout_s` fails the test rather than hanging it."""
    stop, measured = threading.Event(), []

    def loop():
        while (candidate := runner.next_candidate(stop)) is not None:
            measured.append(candidate.config)
            runner.complete(candidate, {"status": "ok", "time_ms": 1.0 + sum(candidate.config.values())})
        measured.append("done")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(timeout_s)
    stop.set()
    assert measured[-1:] == ["done"], f"the runner was still busy after {timeout_s} s"
    return measured[:-1]


def _claim(study, config, owner=OWNER, **attrs):
    """A trial as another process leaves it after writing its owner and its config."""
    trial = study.ask()
    for key, value in {"owner": owner, "config": config, **attrs}.items():
        trial.set_user_attr(key, value)
    return trial


def _measured(study, config, time_ms=1.0):
    trial = _claim(study, config)
    for key, value in (("row", {"time_ms": time_ms, **config}), ("status", "ok")):
        trial.set_user_attr(key, value)
    study.tell(trial, time_ms)
    return trial


def _place(runner, trial, config, within_s: float = 20):
    """runner._place, failing the test instead of hanging it when the claim never decides."""
    verdict = []
    thread = threading.Thread(target=lambda: verdict.append(runner._place(trial, config)), daemon=True)
    thread.start()
    thread.join(within_s)
    assert verdict, f"the claim of {config} did not decide within {within_s} s"
    return verdict[0]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel hands it out again)


def test_a_kill_at_any_write_leaves_a_trial_that_is_redone(storage_url):
    """The windows a SIGKILL can hit in one trial's writes, replayed on a real storage: every
    trial left behind is failed and its config measured again, or (killed before its owner was
    written) left RUNNING without a claim, where it holds no budget."""
    study = optuna.create_study(storage=open_storage(storage_url))
    dead = f"{HOST}:{_dead_pid()}"
    unowned = study.ask()
    claimed = _claim(study, {"B": 2}, owner=dead, measuring=True)  # killed while measuring
    written = _claim(study, {"B": 9}, owner=dead, measuring=True)  # killed between its outcome and its state
    for key, value in (("row", {"time_ms": 2.5}), ("status", "ok")):
        written.set_user_attr(key, value)
    reap_dead(study)
    state = {t.number: t.state for t in study.get_trials()}
    assert state == {unowned.number: TrialState.RUNNING, claimed.number: TrialState.FAIL,
                     written.number: TrialState.FAIL}
    runner = _runner(study, budget=3, values={"B": [1, 2, 9]})
    runner.study.sampler = optuna.samplers.RandomSampler(seed=0)
    assert sorted(c["B"] for c in _run(runner)) == [1, 2, 9]
    assert sum(counts_toward_budget(t) for t in study.get_trials()) == 3


def test_trials_left_by_dead_processes_never_stall_the_survivors(storage_url):
    """The last budget slots are claimed by a trial of another host whose heartbeat stopped
    and by one of a dead process on this host; a trial without a claim sits beside them.
    The survivor waits, Optuna's heartbeat reaper and the pid check free the slots, and it
    measures the budget."""
    storage = optuna.storages.RDBStorage(storage_url, heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=1))
    elsewhere = _claim(study, {"B": 9}, owner="another-host:1", measuring=True)
    storage.record_heartbeat(storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(study.study_name), elsewhere.number))  # its last beat
    here = _claim(study, {"B": 2}, owner=f"{HOST}:{_dead_pid()}", measuring=True)
    configless = study.ask()
    runner = _runner(study, budget=2, values={"B": [1, 2, 9]})
    start = time.monotonic()
    measured = _run(runner, timeout_s=60)
    assert len(measured) == 2 and time.monotonic() - start > 1  # it waited for the grace period
    state = {t.number: t.state for t in study.get_trials()}
    assert state[elsewhere.number] == state[here.number] == TrialState.FAIL
    assert state[configless.number] == TrialState.RUNNING
    assert sum(counts_toward_budget(t) for t in study.get_trials()) == 2


def test_claims_ahead_take_the_last_slots_and_their_configs(storage_url):
    """Claims of processes deciding one after another: a config measured is reused, one
    claimed ahead is not measured again, and the claims ahead fill the budget."""
    study = optuna.create_study(storage=open_storage(storage_url))
    runner = _runner(study, budget=3, values={"B": [1, 2, 3, 4]})
    first = _measured(study, {"B": 1})
    mine = _claim(study, {"B": 2})
    assert _place(runner, mine, {"B": 2}) == ("measure", None)
    theirs = _claim(study, {"B": 3})
    assert _place(runner, theirs, {"B": 3}) == ("measure", None)  # 1 measured + 1 ahead < 3
    same = _claim(study, {"B": 2})
    assert _place(runner, same, {"B": 2}) == ("in flight", None)
    study.tell(same, state=TrialState.FAIL)  # as the runner drops it
    last = _claim(study, {"B": 4})
    assert _place(runner, last, {"B": 4}) == ("full", None)  # 1 measured + 2 ahead: the budget
    verdict, (source, trial) = _place(runner, last, {"B": 1})
    assert verdict == "reuse" and source == trial.number == first.number
    study.tell(mine, state=TrialState.FAIL)  # mine died without an outcome
    study.tell(last, state=TrialState.FAIL)
    again = _claim(study, {"B": 2})
    assert _place(runner, again, {"B": 2}) == ("measure", None)


def test_an_earlier_claim_waits_for_a_later_one_to_decide(storage_url):
    """Two claims made before either decides: the earlier waits for the later, which counts
    it and finds the budget full; only then does the earlier take the slot."""
    study = optuna.create_study(storage=open_storage(storage_url))
    runner = _runner(study, budget=1, values={"B": [1, 2]})
    early, late = _claim(study, {"B": 1}), _claim(study, {"B": 2})
    verdicts = []
    waiting = threading.Thread(target=lambda: verdicts.append(runner._place(early, {"B": 1})), daemon=True)
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive() and not verdicts
    assert _place(runner, late, {"B": 2}) == ("full", None)
    study.tell(late, state=TrialState.FAIL)
    waiting.join(10)
    assert verdicts == [("measure", None)]


def test_a_config_claimed_late_by_an_earlier_trial_is_not_measured_twice(storage_url):
    """An earlier trial whose sampler was slow claims the config a later one already measures:
    it leaves it to that one, and the later trial's slot counts against its budget."""
    study = optuna.create_study(storage=open_storage(storage_url))
    runner = _runner(study, budget=2, values={"B": [1, 2]})
    slow = study.ask()
    slow.set_user_attr("owner", OWNER)
    fast = _claim(study, {"B": 2})
    assert _place(runner, fast, {"B": 2}) == ("measure", None)
    slow.set_user_attr("config", {"B": 2})
    assert _place(runner, slow, {"B": 2}) == ("in flight", None)
    runner.budget = 1
    slow.set_user_attr("config", {"B": 1})
    assert _place(runner, slow, {"B": 1}) == ("full", None)


def test_a_resumed_search_spends_no_budget_on_configs_already_measured(storage_url):
    """A search of 5, resumed with a budget of 12 by a new process whose random sampler (same
    seed) proposes the same configs again: those are told their results at no cost, and the
    study ends with 12 distinct configs measured."""
    storage = open_storage(storage_url)
    values = {"A": list(range(6)), "B": list(range(6))}
    before = set()
    for budget in (5, 12):
        study = optuna.create_study(study_name="s", storage=storage, load_if_exists=True,
                                    sampler=make_sampler("random", 7, values))
        runner = _runner(study, budget, values)
        measured = [config_key(c) for c in _run(runner)]
        assert not set(measured) & before and len(set(measured)) == len(measured)
        before |= set(measured)
    assert len(before) == 12 and runner.reused >= 5  # the resumed sampler replayed the first five
    trials = study.get_trials()
    assert sum(counts_toward_budget(t) for t in trials) == 12
    assert all(not counts_toward_budget(t) for t in trials if "reused_from" in t.user_attrs)


def test_a_study_whose_valid_configs_are_all_measured_ends_early_and_says_so():
    check = lambda c: "B=4 breaks a rule" if c["B"] == 4 else None
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    runner = _runner(study, 10, {"B": [1, 2, 3, 4]}, check)
    assert sorted(c["B"] for c in _run(runner)) == [1, 2, 3]
    assert runner.ended == "all 3 valid configs measured" and runner.left() == 0
    counts = studies.outcome_counts(study)
    assert counts["ok"] == 3 and counts["invalid"] == runner.invalid


def test_a_sampler_that_only_repeats_itself_is_asked_a_bounded_number_of_times():
    """A space too large to enumerate, whose sampler proposes nothing but a measured config:
    the study ends after max(50, 2 x budget) repeats in a row, measuring nothing, and says why."""
    study = optuna.create_study()
    _measured(study, {"B": 1})
    runner = studies.StudyRunner(study, _view({"B": [1]}, enumerate_valid=False), 30, lambda c: None,
                                 make_row=lambda config, result, number: {})
    assert _run(runner) == [] and runner.reused == 60
    assert runner.ended == "the sampler proposed 60 invalid or measured configs in a row"


def test_a_sparse_space_gets_ten_suggestions_per_valid_share_in_a_row():
    """3 valid configs among 20 x 20 combinations: a sampler drawing each tunable on its own hits one
    in 133 suggestions, so the study waits through 1334 invalid ones in a row (a chance of e^-10 to
    give up on a space that has some left), not max(50, 2 x budget); the random sampler then
    finds all three."""
    values = {"A": list(range(20)), "B": list(range(20))}
    check = lambda c: None if c["A"] == c["B"] < 3 else "off the diagonal"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5))
    runner = _runner(study, 3, values, check)
    assert runner.patience == 1334
    assert sorted(c["A"] for c in _run(runner)) == [0, 1, 2] and not runner.ended.startswith("the sampler")
    dense = _runner(optuna.create_study(), 30, {"B": [1, 2]})
    assert dense.patience == 60


def test_the_grid_sampler_walks_an_enumerated_spaces_valid_configs_only():
    """3 valid configs among 400 points: the grid holds the 3, not the product (which a union of
    kernels makes large: the CUDA fp32 space's is 1,512,000 points), so nothing is pruned."""
    values = {"A": list(range(20)), "B": list(range(20))}
    check = lambda c: None if c["A"] == c["B"] < 3 else "off the diagonal"
    view = _view(values, check)
    study = optuna.create_study(sampler=make_sampler("grid", 1, values, valid=view.valid))
    runner = _runner(study, 3, values, check)
    assert sorted(c["A"] for c in _run(runner)) == [0, 1, 2] and runner.invalid == 0


def test_configs_measured_under_another_prefix_are_reused(storage_url):
    """A config measured by a study of the same target/op/backend/dtype/shape under another
    prefix is told its result at no cost, never measured again."""
    storage = open_storage(storage_url)
    key = "cpu:matmul:fake:fp32:16x16x16:nn"
    old = optuna.create_study(study_name="old-" + key, storage=storage)
    first = _measured(old, {"B": 1}, time_ms=0.5)
    first_row = old.trials[first.number].user_attrs["row"]
    _measured(optuna.create_study(study_name="cpu:matmul:fake:fp32:116x16x16:nn", storage=storage), {"B": 2})
    known = measured_elsewhere(storage, "new-" + key, key)
    source = f"old-{key}#{first.number}"
    assert list(known) == [config_key({"B": 1})] and known[config_key({"B": 1})][0] == source
    assert _runner(optuna.create_study(study_name="new-" + key, storage=storage), 5, {"B": [1, 2]},
                   known=known).left() == 1
    # Too large to enumerate, and a sampler that only proposes B=1: nothing is measured. (The
    # new study in memory: 50 copies are 400 writes.)
    study = optuna.create_study()
    runner = studies.StudyRunner(study, _view({"B": [1]}, enumerate_valid=False), 1, lambda c: None,
                                 make_row=lambda config, result, number: {}, known=known)
    assert _run(runner) == [] and runner.reused == 50
    copies = study.get_trials()
    assert all(t.value == 0.5 and t.user_attrs["reused_from"] == source for t in copies) and len(copies) == 50
    # A copy carries its source's row as it was written, so best.json names where it was measured.
    assert all(t.user_attrs["row"] == first_row for t in copies)


def test_tpe_valid_measures_only_valid_new_configs_and_chooses_through_tpe(storage_url, monkeypatch, rng):
    """tpe-valid puts no invalid config and no repeat in the storage: nothing pruned, nothing
    copied, every valid config measured once before the study ends; after its uniform start the
    choice goes through TPE's acquisition (the private method it overrides: if a release of
    Optuna renames it, this fails)."""
    values = {"A": [1, 2, 3, 4, 5, 6], "B": [1, 2, 4, 8, 16], "C": [0, 1, 2]}
    check = lambda c: "A * B > 24" if c["A"] * c["B"] > 24 else None
    scored = []
    acquisition = optuna.samplers.TPESampler._compute_acquisition_func
    monkeypatch.setattr(optuna.samplers.TPESampler, "_compute_acquisition_func",
                        lambda self, *args: scored.append(1) or acquisition(self, *args))
    view = _view(values, check)
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    sampler = make_sampler("tpe-valid", seed, values, valid=view.valid)
    study = optuna.create_study(storage=open_storage(storage_url), sampler=sampler)
    runner = _runner(study, len(view.valid) + 5, values, check, ordinal=True)
    measured = _run(runner)
    assert sorted(map(config_key, measured)) == sorted(map(config_key, view.valid))
    assert runner.invalid == runner.reused == 0 and len(study.trials) == len(view.valid) == 66
    assert runner.ended == "all 66 valid configs measured" and scored


def test_tpe_valid_tries_a_rare_kernel_family_first_and_leaves_common_ones_to_chance(tmp_path, rng):
    """Family K = 1 holds 1 valid config of 73 (a wgmma kernel beside two others of 36 each): with the
    space's families the study's first draw is that config; drawn by the configs' numbers alone it is
    among the first three of few of 20 seeds. Families of a fair share are not forced: without K = 1
    the draws are those without the rule, bit for bit."""
    values = {"K": [0, 1, 2], "A": [1, 2, 3, 4, 5, 6], "B": [1, 2, 4, 8, 16, 32]}
    check = lambda c: None if c["K"] != 1 or (c["A"], c["B"]) == (3, 8) else "K = 1 takes one tile"  # noqa: E731
    view = _view(values, check)
    storage = open_storage(f"sqlite:///{tmp_path / 't.db'}")

    def first(families, seed, n=3, space=values, valid=view.valid):
        sampler = make_sampler("tpe-valid", seed, space, valid=valid, families=families)
        study = optuna.create_study(storage=storage, sampler=sampler)  # a new study each time
        runner = _runner(study, n, space, check, ordinal=True)
        return [c for c in _run(runner) if c != "done"]

    seeds = [int(s) for s in torch.randint(0, 2**31, (20,), generator=rng)]
    assert all(first(("K",), seed)[0] == {"K": 1, "A": 3, "B": 8} for seed in seeds[:5])
    assert sum(any(c["K"] == 1 for c in first((), seed)) for seed in seeds) <= 6  # about 4% a seed
    common = {"K": [0, 2], "A": values["A"], "B": values["B"]}
    common_valid = [c for c in view.valid if c["K"] != 1]
    assert first(("K",), seeds[0], 12, common, common_valid) == first((), seeds[0], 12, common, common_valid)


def test_asks_made_at_once_draw_a_rare_family_once(tmp_path, rng):
    """Compile processes ask a study at once, each before the others' configs are in the storage: the
    rare family's draw falls to the study's first trial alone, not to every ask that finds no trial of
    it (on a GPU the first four trials of a 4096^3 fp32 study were all wgmma configs)."""
    values = {"K": [0, 1, 2], "A": [1, 2, 3, 4, 5, 6], "B": [1, 2, 4, 8, 16, 32]}
    check = lambda c: None if c["K"] != 1 or (c["A"], c["B"]) == (3, 8) else "K = 1 takes one tile"  # noqa: E731
    view = _view(values, check)
    storage = open_storage(f"sqlite:///{tmp_path / 't.db'}")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    sampler = make_sampler("tpe-valid", seed, values, valid=view.valid, families=("K",))
    # Each uniform draw takes the first of what it may draw from: a config of K = 0 unless the family is forced.
    sampler._pick = types.SimpleNamespace(choice=lambda seq: list(seq)[0])
    study = optuna.create_study(storage=storage, sampler=sampler)
    trials = [storage.get_trial(storage.create_new_trial(study._study_id)) for _ in range(4)]  # none has params yet
    drawn = [sampler.sample_relative(study, t, sampler.infer_relative_search_space(study, t)) for t in trials]
    assert [d["K#index"] for d in drawn] == [values["K"].index(1), 0, 0, 0]


def test_families_are_tunables_of_their_space():
    import kernels_cuda as kc
    import kernels_triton as kt

    with pytest.raises(ValueError, match=r"families \['WGMMA'\] must be tunables of the space \['A'\]"):
        Space(params={"A": (1, 2)}, default={"A": 1}, families=("WGMMA",))
    assert kc.space("matmul", "fp32").families == ("TF32", "WGMMA")
    assert kt.space("matmul", "fp32").families == ("TF32", "SPLIT_AHEAD") and not kt.space("matmul", "fp16").families
    assert kc.space("linear_sgd", "fp32").families == ("TF32", "WGMMA")  # WGMMA pinned to 0 there: one value


def test_tpe_valid_reads_the_study_once_an_ask_with_tpe(storage_url):
    """tpe-valid's look at the configs taken and TPE's look at the history are one read of the study's
    trials (Optuna's per-ask cache, a private method: if a release renames it, this fails): every read
    costs the search process a storage round trip, under the lock every ask and tell takes. The
    StudyRunner reads the trials twice more an ask (before it, and for the claim), Optuna's ask once
    (enqueued trials), and TPE's constant liar once, after its start."""
    values = {"A": [1, 2, 3, 4, 5, 6], "B": [1, 2, 4, 8, 16], "C": [0, 1, 2]}
    view = _view(values)
    sampler = make_sampler("tpe-valid", 7, values, parallel=True, valid=view.valid)
    study = optuna.create_study(storage=open_storage(storage_url), sampler=sampler)
    runner = _runner(study, 30, values, ordinal=True)
    storage = study._storage  # Optuna's cache in front of the database: what the study reads through
    reads, read = [0], storage.get_all_trials

    def counted(*args, **kwargs):
        reads[0] += 1
        return read(*args, **kwargs)

    storage.get_all_trials = counted
    for n in range(30):
        before = reads[0]
        candidate = runner.poll()
        runner.complete(candidate, {"status": "ok", "time_ms": 1.0 + n % 7})
        # 3 around the ask, 1 for tpe-valid and TPE's start, and TPE's constant liar once it models
        assert reads[0] - before == (4 if n < sampler._n_startup_trials else 5), n


def test_grid_points_of_failed_trials_are_visited_again(tmp_path):
    """A dropped trial measured nothing: the grid proposes its point next, then every other once."""
    sampler = make_sampler("grid", 0, {"B": [1, 2, 3, 4, 5]})
    study = optuna.create_study(storage=open_storage(f"sqlite:///{tmp_path / 't.db'}"), sampler=sampler)
    seen = []
    for _ in range(6):
        trial = study.ask()
        seen.append(trial.suggest_categorical("B", [1, 2, 3, 4, 5]))
        # the first trial is dropped (no outcome), the others are told
        study.tell(trial, state=TrialState.FAIL) if len(seen) == 1 else study.tell(trial, 1.0)
    assert seen[1] == seen[0] and sorted(seen[1:]) == [1, 2, 3, 4, 5]


def _bare_search():
    """A Search with the pipeline's bookkeeping alone: no pools, no storage, no studies."""
    from autotune import tuning

    search = tuning.Search.__new__(tuning.Search)
    search.stop, search.cond, search.queue, search.ahead = threading.Event(), threading.Condition(), [], 4
    search.retired = {}
    return search


def test_a_study_finishes_when_the_last_thread_asking_its_sampler_leaves():
    """Two compile threads ask one study for configs. One hears that its configs ran out while the
    other still waits for an answer, which then is WAIT (another process held the last slot of the
    budget): the study must finish as that second thread leaves, or nothing would ever finish it."""
    from autotune import tuning

    search = _bare_search()
    written = []
    search._write_best = written.append
    inside, release = threading.Event(), threading.Event()

    class Runner:
        def poll(self):
            if threading.current_thread().name == "first":
                inside.set()
                release.wait(10)
                return studies.WAIT
            inside.wait(10)
            return None

    lane = tuning.Lane(0, None, "study", None, Runner(), {}, left=1, start_measured=0, tried=[], spec=None,
                       activated=True, baselines_stored=True)
    search.lanes = [lane]
    first = threading.Thread(target=search._next_work, args=(None, True), name="first")
    first.start()
    assert search._next_work(None, True) is None  # the configs ran out
    assert lane.asks_over and not written  # but the first thread is still asking
    release.set()
    first.join(10)
    assert not first.is_alive() and written == [lane] and lane.finished


def test_a_study_whose_configs_left_are_all_in_flight_is_asked_again_only_once_one_can_be_handed_out():
    """Asked while every config it has left is in flight in this run, a study answers WAIT after a
    read of its trials and a search for dead processes: near each study's end that was one wasted
    ask per outcome told, under the lock the GPU's baselines wait for. An outcome that counts leaves
    it unasked while the configs in flight still cover what is left; one that does not (`invalid`, or
    failed meanwhile by another process), a config given back, or the last one ending opens it again.
    A WAIT that other processes' claims cause is looked at again on the clock."""
    from autotune import tuning

    search = _bare_search()
    search._write_best = lambda lane: None
    lane = tuning.Lane(0, None, "study", None, None, {}, left=6, start_measured=0, tried=[], spec=None, activated=True,
                       baselines_stored=True, in_flight=4, counted=1, saturated_until=math.inf)
    search._release(lane, counted=True)  # 3 in flight, 4 left
    assert (lane.in_flight, lane.counted, lane.saturated_until) == (3, 2, 0.0)
    lane.in_flight, lane.saturated_until = 4, math.inf  # 4 in flight, 4 left
    search._release(lane, counted=True)
    assert (lane.in_flight, lane.counted, lane.saturated_until) == (3, 3, math.inf)
    search._release(lane, counted=False)  # invalid, or a config given back: a slot is free
    assert (lane.in_flight, lane.counted, lane.saturated_until) == (2, 3, 0.0)
    lane.in_flight, lane.saturated_until = 3, math.inf
    search._release(lane, counted=True)
    search._release(lane, counted=True)
    assert (lane.in_flight, lane.saturated_until) == (1, math.inf)
    search._release(lane, counted=True)  # nothing in flight: asked again, to hear the budget is spent
    assert (lane.in_flight, lane.counted, lane.saturated_until) == (0, 6, 0.0)

    class Waiting:  # a study whose slots other processes' claims fill
        def poll(self):
            return studies.WAIT

    for in_flight, left, forever in ((2, 2, True), (1, 3, False), (0, 3, False)):
        lane = tuning.Lane(0, None, "study", None, Waiting(), {}, left=left, start_measured=0, tried=[], spec=None,
                           activated=True, baselines_stored=True, in_flight=in_flight)
        search.lanes = [lane]
        assert search._next_work(None, False) == ("wait",)
        assert (lane.saturated_until == math.inf) == forever and lane.saturated_until > 0


def test_an_outcome_counts_toward_the_budget_only_when_measured_and_told(storage_url, capsys):
    """What the pipeline's release reads: `complete` says whether the outcome counts toward the
    study's budget. Not an `invalid` config (a backend's own refusal, found by its compile), nor an
    outcome whose trial another process failed meanwhile, taking its process for dead."""
    values = {"A": [1, 2, 3, 4], "B": [1, 2]}
    study = optuna.create_study(storage=open_storage(storage_url), sampler=make_sampler("random", 3, values))
    runner = _runner(study, 8, values)
    first, second, third = (runner.poll() for _ in range(3))
    assert runner.complete(first, {"status": "ok", "time_ms": 1.0}) is True
    assert runner.complete(second, {"status": "invalid", "error": "config: BLOCK_N below N"}) is False
    study.tell(third.trial.number, state=TrialState.FAIL)  # reaped by another process
    assert runner.complete(third, {"status": "ok", "time_ms": 1.0}) is False
    assert "ended elsewhere" in capsys.readouterr().err
    assert runner.measured() == 1


def test_a_study_with_its_share_of_configs_in_flight_lets_the_compile_processes_ask_the_next():
    """Each ask reads back every trial of its study still running, so the pipeline keeps at most
    IN_FLIGHT_PER_STUDY configs of a study in flight (counting the asks under way) and asks the next
    study instead; the first is asked again once one of its configs is told."""
    from autotune import tuning

    search = _bare_search()
    search._write_best = lambda lane: None
    cap = tuning.IN_FLIGHT_PER_STUDY
    first, second = (tuning.Lane(order, None, f"study {order}", None, None, {}, left=50, start_measured=0, tried=[],
                                 spec=None, activated=True, baselines_stored=True) for order in (0, 1))
    search.lanes = [first, second]
    first.in_flight, first.polling = cap - 1, 1
    assert search._pick() == ("poll", second)
    first.polling = 0
    assert search._pick() == ("poll", first) and first.polling == 1
    first.polling, first.in_flight = 0, cap
    second.polling = 0
    assert search._pick() == ("poll", second)
    second.polling = 0
    search._release(first, counted=True)
    assert search._pick() == ("poll", first)


def test_pools_tell_every_worker_to_exit_before_waiting_for_any():
    """Each worker takes a second or so to release its CUDA context: ended one after another, a
    search's fifteen took seconds after its last trial."""
    from types import SimpleNamespace

    from autotune.evaluate import close_pools

    events = []

    class Worker:
        def __init__(self, name):
            self.name = name

        def ask_to_exit(self):
            events.append(("ask", self.name))

        def close(self):
            events.append(("wait", self.name))

    pools = [SimpleNamespace(workers=[(Worker(f"{p}{i}"), None) for i in range(n)]) for p, n in (("t", 1), ("c", 3))]
    close_pools(*pools)
    kinds = [kind for kind, _ in events]
    assert kinds == ["ask"] * 4 + ["wait"] * 4 and {n for _, n in events} == {"t0", "c0", "c1", "c2"}


def test_a_worker_started_ahead_answers_its_first_request_and_exits_when_asked(tmp_path):
    from autotune.worker_pool import WorkerProcess, worker_env

    worker = WorkerProcess("early", worker_env(None, interpret=True), tmp_path / "early.log")
    worker.start()  # returns at once; the process imports torch meanwhile
    proc = worker.proc
    answer = worker.request({"cmd": "measure"}, timeout=120)  # the ready line is awaited first
    assert answer == {"ok": False, "status": "launch_error", "error": "measure without a prepared call"}
    worker.ask_to_exit()
    worker.ask_to_exit()  # a second ask is a no-op, not an error
    worker.close()
    assert proc.returncode == 0 and worker.proc is None  # it exited on its own, not killed


def test_a_worker_started_ahead_and_never_used_is_ended_without_waiting_for_its_imports(tmp_path):
    """A search with nothing left to do still starts its workers ahead; closing one that never
    became ready kills it rather than waiting for torch's import to finish first."""
    import signal

    from autotune.worker_pool import WorkerProcess, worker_env

    worker = WorkerProcess("unused", worker_env(None, interpret=True), tmp_path / "unused.log")
    worker.start()
    proc = worker.proc
    worker.close()
    assert proc.returncode == -signal.SIGKILL and worker.proc is None


def _ask_here(spec: dict, seed: int, row: dict, recorder: str) -> dict:
    """autotune.asking.ask, in the process of a pool that runs it, with that process's pid."""
    import os

    from autotune import asking

    return {**asking.ask(spec, seed, row, recorder), "pid": os.getpid()}


class _AskingPool:
    """Compile processes as the search's pipeline sees them, each a spawned process that asks."""

    def __init__(self, processes):
        self.processes, self.pids, self.asks = processes, set(), 0

    def __len__(self) -> int:
        return len(self.processes)

    def ask(self, index, spec, seed, row, recorder) -> dict:
        self.asks += 1
        answer = self.processes[index].submit(_ask_here, spec, seed, row, recorder).result()
        self.pids.add(answer.pop("pid"))
        return answer

    def restarts(self, index) -> int:
        return 0


def test_compile_processes_ask_for_the_configs_and_the_search_takes_each_trial_over(storage_url, monkeypatch):
    """The pipeline's asks are made in the compile processes (autotune.asking), each process with its
    own sampler, through the shared storage: two processes asking at once, with configs in flight,
    hand out each config once and exactly the budget (then WAIT, then None); the invalid
    suggestions' rows reach this process's CSV, one per invalid trial of the storage, whose trials
    are this process's to record; each config's trial becomes this process's (its owner and
    heartbeat), so a compile process restarted later does not take the configs it handed out down
    with it. A compile process that hangs or dies while asking is counted against it and, set
    aside, asked no more; a trial reaped before it is taken over goes back to the sampler."""
    import multiprocessing
    from collections import Counter
    from concurrent.futures import ProcessPoolExecutor
    from types import SimpleNamespace

    from autotune import asking, tuning
    from autotune.errors import SearchError
    from autotune.storage import Heartbeat

    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")  # the ask processes inherit it
    storage = open_storage(storage_url)
    name = "cpu:matmul:fake:fp32:8x8x8"
    spec = asking.StudySpec(storage_url, name, name, "cpu", "fake", "matmul", "fp32", lower_precision=False,
                            sampler="random", budget=20, ordinal=False, parallel=True)
    space = backends.load("fake").space("matmul", "fp32")  # 26 valid configs among 32
    view, sampler, check = asking.runner_parts(spec, targets.TARGETS["cpu"], space, 0)
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler)
    runner = studies.StudyRunner(study, view, spec.budget, check,
                                 make_row=lambda config, result, number: {**config, **result, "trial": number})
    search = _bare_search()  # and what its asking uses
    search.lock, search.heartbeat = threading.Lock(), Heartbeat(storage)
    search.args = SimpleNamespace(seed=0, max_failures_in_a_row=2)
    search.failures_in_a_row, search.pool = Counter(), [None]
    search.make_row = lambda job, name, baselines, config, result, number: {"study": name, **result}
    rows = []
    search.record = rows.append
    lane = tuning.Lane(0, None, name, study, runner, {}, left=spec.budget, start_measured=0, tried=[], spec=spec,
                       activated=True, baselines_stored=True)
    search.lanes = [lane]
    handed_out, told = [], []

    def tell(candidate):
        assert runner.complete(candidate, {"status": "ok", "time_ms": 1.0 + len(told)})
        told.append(candidate)

    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(1, mp_context=spawn) as first, ProcessPoolExecutor(1, mp_context=spawn) as second:
            search.compilers = pool = _AskingPool((first, second))

            def compile_thread(index):  # four configs each, at once, none told
                for _ in range(4):
                    handed_out.append(search._ask(index, lane))

            threads = [threading.Thread(target=compile_thread, args=(i,)) for i in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert len(pool.pids) == 2 and all(isinstance(c, studies.Candidate) for c in handed_out)
            while (candidate := search._ask(len(handed_out) % 2, lane)) is not studies.WAIT:
                assert isinstance(candidate, studies.Candidate)
                handed_out.append(candidate)
                tell(handed_out[len(told)])  # 8 in flight until the budget is handed out
            assert len(handed_out) == 20 and len(told) == 12
            for candidate in handed_out:
                number = candidate.trial.number
                trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
                assert storage.get_trial(trial_id).user_attrs["owner"] == OWNER
                assert search.heartbeat.ids.get((name, number)) in (None, trial_id)  # None: told already
                if candidate not in told:
                    tell(candidate)
            assert search._ask(0, lane) is None
    finally:
        search.heartbeat.stop()
    assert len({config_key(c.config) for c in handed_out}) == 20 and runner.measured() == 20
    invalid = [t for t in study.get_trials() if t.user_attrs.get("status") == "invalid"]
    assert sorted(row["trial"] for row in rows) == [t.number for t in invalid] and runner.invalid == len(invalid)
    assert all(t.user_attrs["owner"] == OWNER for t in invalid)
    assert all(row["status"] == "invalid" and row["study"] == name and "BLOCK_M" in row for row in rows)

    # A trial its compile process's death had failed before this process took it over.
    lost = study.ask()
    study.tell(lost, state=TrialState.FAIL)
    search.compilers = SimpleNamespace(restarts=lambda index: 0, ask=lambda *a: {
        "asked": "trial", "number": lost.number, "trial_id": lost._trial_id, "config": {"BLOCK_M": 16},
        "rows": [], "invalid": 0, "reused": 0})
    assert search._ask(0, lane) is studies.WAIT
    # An ask that the storage or a changed space fails: the search stops, with the compile process's line.
    search.compilers = SimpleNamespace(restarts=lambda index: 0,
                                       ask=lambda *a: {"ok": False, "status": "ask_error", "error": "study x: gone"})
    with pytest.raises(SearchError, match="study x: gone"):
        search._ask(0, lane)

    # A compile process started again after a hang asks with a sampler of another seed: with its
    # predecessor's it would propose its predecessor's configs again.
    seeds = []
    for restarted in (0, 1):
        search.compilers = SimpleNamespace(restarts=lambda index: restarted, ask=lambda index, spec, seed, *rest: (
            seeds.append(seed), {"asked": "wait", "rows": [], "invalid": 0, "reused": 0})[1])
        assert search._ask(0, lane) is studies.WAIT
    assert seeds[0] != seeds[1]

    # A compile process that hangs or dies while asking: counted against it, and once set aside
    # (--max-failures-in-a-row 2 here) it is asked no more.
    class Hanging(_AskingPool):
        def ask(self, *args):
            self.asks += 1
            return {"ok": False, "status": "timeout", "error": "no answer within 600 s"}

    search.compilers = hanging = Hanging((None, None))
    lane.asks_over, lane.saturated_until = False, 0.0
    assert search._next_work(1, False) == ("wait",) and search.failures_in_a_row[("compile", 1)] == 1
    lane.saturated_until = 0.0
    assert search._next_work(1, False) is None and ("compile", 1) in search.retired
    assert search._next_work(1, False) is None and hanging.asks == 2


def test_a_storage_failure_while_a_compile_process_asks_is_one_line(monkeypatch):
    """As the search process says it (autotune.search): the storage and what failed, without the
    SQL, its parameters (a whole row's JSON) or SQLAlchemy's link."""
    import sqlalchemy.exc

    from autotune import asking, worker

    def locked(*args):
        raise sqlalchemy.exc.OperationalError("UPDATE trial_user_attributes SET value_json=?", ('{"row": 1}',),
                                              Exception("database is locked"))

    monkeypatch.setattr(asking, "ask", locked)
    answer = worker.Runner().ask({"spec": {"storage": "sqlite:///tuning.db"}, "sampler_seed": 0, "row": {},
                                  "recorder": OWNER})
    assert answer == {"ok": False, "status": "ask_error",
                      "error": "--storage sqlite:///tuning.db: (builtins.Exception) database is locked"}


def test_a_compile_process_keeps_one_connection_to_a_database_server(postgres_server, monkeypatch):
    """PostgreSQL serves 100 connections at once by default, and a host's search has a compile
    process a core: each keeps one open, its heartbeat's thread and its asks taking turns."""
    import psycopg
    from sqlalchemy.engine import make_url

    from autotune import asking

    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")
    url = postgres_server.new_database()
    name = "cpu:matmul:fake:fp32:8x8x8"
    search_storage = open_storage(url)
    optuna.create_study(study_name=name, storage=search_storage)
    search_storage.engine.dispose()  # the search's own pool, closed: what is left open is the asker's
    spec = asking.StudySpec(url, name, name, "cpu", "fake", "matmul", "fp32", lower_precision=False,
                            sampler="random", budget=20, ordinal=False, parallel=True)
    asker = asking.Asker()
    try:
        answers = [asker.ask(spec, 1, {"study": name}, OWNER)["asked"] for _ in range(10)]
        assert answers.count("trial") == 10
        with psycopg.connect(host=postgres_server.folder, user="postgres", dbname="postgres", autocommit=True) as c:
            open_now = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                                 (make_url(url).database,)).fetchone()[0]
        assert open_now == 1
    finally:
        asker.heartbeat.stop()
