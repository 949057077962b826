"""Targets, workload shapes and the config store, in process (no subprocesses)."""
from __future__ import annotations

import json

import pytest
import torch

from autotune import targets, workload
from kernels_core import backends
from autotune.store import ConfigStore, StoreError, load_store, save_store
from kernels_core.space import Space
from tests import fake_backend

SM75, SM90 = targets.TARGETS["sm_75"], targets.TARGETS["sm_90"]


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
    assert workload.shape_key((128, 1024, 784), "nn") == "128x1024x784:nn"
    assert workload.shape_key((128, 1024)) == "128x1024"
    assert workload.parse_shapes("4096x4096x4096, 128x1024x784:tn,128x10,99") == [
        ((4096, 4096, 4096), "nn"), ((128, 1024, 784), "tn"), ((128, 10), ""), ((99,), "")]
    for bad in ("4096xx4", "128x10:tn", "1x2x3:qq", "0x4", ""):
        with pytest.raises(ValueError, match="--shapes"):
            workload.parse_shapes(bad)


def test_mnist_mlp_calls():
    calls = workload.mnist_mlp_calls(hidden=256, layers=2, batch=64, dtype="fp16")
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
    assert len(calls) == len(got) == 8 + 5  # duplicates removed
    assert len(workload.mnist_mlp_calls(256, 1, 64, "fp16")) == 2 + 2 + 1 + 5


@pytest.mark.parametrize("op,shape,layout", [
    ("matmul", (8, 12, 16), "tn"), ("relu_backward", (4, 8), ""), ("softmax_cross_entropy", (6, 10), ""),
    ("sgd_update", (50,), ""), ("bias_add", (4, 8), "")])
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


@pytest.mark.parametrize("data,match", [
    ("{not json", "not valid JSON"),
    ({"target": "sm_80", "entries": []}, "written for target 'sm_80'"),
    ({"target": "sm_90", "entries": [], "extra": 1}, "unknown top-level key"),
    ({"target": "sm_90", "entries": [entry(colour="red")]}, r"entry 0 \(relu:fake:fp16:64x64\): unknown key"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 128, "MODE": 0, "X": 1})]}, "unknown tunable"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 128.0, "MODE": 0})]}, "BLOCK=128.0 is not an integer"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 128, "MODE": True})]}, "MODE=True is not an integer"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 100, "MODE": 0})]}, "outside the space"),
    ({"target": "sm_90", "entries": [entry(config={"BLOCK": 128})]}, "missing tunable MODE"),
    ({"target": "sm_90", "entries": [dict(entry(), dtype="fp32", config={"BLOCK": 256, "MODE": 0})]},
     "restriction `BLOCK \\* elt <= 512` fails"),
    ({"target": "sm_90", "entries": [dict(entry(), op="conv")]}, "unknown op 'conv'"),
    ({"target": "sm_90", "entries": [dict(entry(), backend="nope")]}, "unknown backend 'nope'"),
    ({"target": "sm_90", "entries": [dict(entry(), dtype="fp8")]}, "unknown dtype"),
    ({"target": "sm_90", "entries": [entry(shape="64x64x64:nn")]}, "2 dimension"),
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


def test_a_kill_at_any_write_leaves_a_trial_that_is_redone_or_kept(tmp_path):
    """The windows a SIGKILL can hit in one trial's writes, replayed on a real storage."""
    import optuna
    from optuna.trial import TrialState

    from autotune import studies

    study = optuna.create_study(storage=studies.open_storage(f"sqlite:///{tmp_path / 't.db'}"))
    dead = f"{studies.HOST}:999999999"  # no such pid
    unclaimed = study.ask()  # killed right after ask
    half = study.ask()  # killed after the row, before the status
    for key, value in (("owner", dead), ("config", {"B": 1}), ("row", {"time_ms": 1.0})):
        half.set_user_attr(key, value)
    measured = study.ask()  # killed after the status, before the state
    for key, value in (("owner", dead), ("config", {"B": 2}), ("row", {"time_ms": 2.5}), ("status", "ok")):
        measured.set_user_attr(key, value)

    frozen = {t.number: t for t in study.get_trials()}
    assert not studies.counts_toward_budget(frozen[unclaimed.number])  # measures nothing, costs nothing
    assert studies.reap_stale(study) == 2
    after = {t.number: t for t in study.get_trials()}
    assert after[unclaimed.number].state == TrialState.RUNNING  # young: could be a live process claiming it
    assert after[half.number].state == TrialState.FAIL and not studies.counts_toward_budget(after[half.number])
    assert after[measured.number].state == TrialState.COMPLETE and after[measured.number].value == 2.5


def _runner(tmp_path, budget):
    import optuna

    from autotune import studies

    storage = studies.open_storage(f"sqlite:///{tmp_path / 't.db'}")
    study = optuna.create_study(storage=storage)
    runner = studies.StudyRunner(study, view=studies.SpaceView(None, {"B": [1, 2, 9]}, None, 3), budget=budget,
                                 check=lambda c: None, make_row=None)
    runner._suggest = lambda trial: {"B": 1}
    return storage, study, runner


def test_trials_left_by_dead_processes_never_stall_the_survivors(tmp_path, monkeypatch):
    """One trial with no config (its process killed right after `ask`) and one of another host
    whose heartbeat went stale after its outcome was written hold the last budget slots: the
    survivor waits, reaps them, keeps the written outcome and goes on."""
    from optuna.trial import TrialState

    from autotune import studies

    monkeypatch.setattr(studies, "ORPHAN_S", 0.5)
    monkeypatch.setattr(studies, "CLAIM_WAIT_S", 0.2)
    storage, study, runner = _runner(tmp_path, budget=2)
    configless, elsewhere = study.ask(), study.ask()
    for key, value in (("owner", "another-host:1"), ("config", {"B": 9}), ("row", {"time_ms": 3.0}),
                       ("status", "ok")):
        elsewhere.set_user_attr(key, value)
    monkeypatch.setattr(storage, "_get_stale_trial_ids", lambda study_id: [elsewhere._trial_id])
    candidate = runner.next_candidate()
    assert candidate is not None and candidate.config == {"B": 1} and candidate.twin is None
    after = {t.number: t for t in study.get_trials()}
    assert after[elsewhere.number].state == TrialState.COMPLETE and after[elsewhere.number].value == 3.0
    assert studies._orphaned(study, after[configless.number])  # passed over, and failed by the next reap
    studies.reap_stale(study)
    assert study.get_trials()[configless.number].state == TrialState.FAIL


def test_a_twin_whose_process_dies_is_measured_here(tmp_path):
    import subprocess
    import threading

    from optuna.trial import TrialState

    from autotune import studies

    _, study, runner = _runner(tmp_path, budget=3)
    other = subprocess.Popen(["sleep", "60"])  # the twin's process, alive when the candidate is placed
    twin = study.ask()
    for key, value in (("owner", f"{studies.HOST}:{other.pid}"), ("config", {"B": 1})):
        twin.set_user_attr(key, value)
    candidate = runner.next_candidate()
    assert candidate.twin == twin._trial_id
    other.kill()
    other.wait()
    assert not runner.reuse_twin(candidate, threading.Event())  # no result coming: measure it here
    assert study.get_trials()[twin.number].state == TrialState.FAIL


def test_trial_numbers_decide_who_takes_the_last_slot_and_who_measures(tmp_path):
    """Trials of two processes claimed at once: the lower number runs; a later claim of a
    config copies the earlier live or finished trial of it instead of measuring it again."""
    import optuna

    from autotune import studies

    study = optuna.create_study(storage=studies.open_storage(f"sqlite:///{tmp_path / 't.db'}"))

    def claimed(b):
        trial = study.ask()
        trial.set_user_attr("config", {"B": b})
        return trial

    first = claimed(1)
    for key, value in (("row", {"time_ms": 1.0}), ("status", "ok")):
        first.set_user_attr(key, value)
    study.tell(first, 1.0)
    mine, theirs, same = claimed(2), claimed(3), claimed(2)
    runner = studies.StudyRunner(study, view=None, budget=3, check=lambda c: None, make_row=None)
    assert runner._place(mine, {"B": 2}) == ("measure", None)
    assert runner._place(theirs, {"B": 3}) == ("measure", None)
    verdict, twin = runner._place(same, {"B": 2})
    assert verdict == "full"  # budget 3: the first, mine and theirs
    runner.budget = 4
    verdict, twin = runner._place(same, {"B": 2})
    assert verdict == "twin" and twin.number == mine.number
    verdict, done = runner._place(same, {"B": 1})
    assert verdict == "reuse" and done.number == first.number
    study.tell(mine, state=optuna.trial.TrialState.FAIL)  # mine died without an outcome
    runner.budget = 3
    assert runner._place(same, {"B": 2}) == ("measure", None)


def test_a_config_picked_late_by_an_earlier_trial_is_copied_not_measured_twice(tmp_path, monkeypatch):
    """An earlier trial whose sampler outlasted CLAIM_WAIT_S picks the config a later one is
    already measuring: it waits for that one instead of measuring it again."""
    from autotune import studies

    monkeypatch.setattr(studies, "CLAIM_WAIT_S", 0.1)
    _, study, runner = _runner(tmp_path, budget=3)
    slow, fast = study.ask(), study.ask()
    fast.set_user_attr("config", {"B": 2})
    assert runner._place(fast, {"B": 2}) == ("measure", None)  # after waiting 0.1 s for `slow`
    slow.set_user_attr("config", {"B": 2})
    verdict, twin = runner._place(slow, {"B": 2})
    assert verdict == "twin" and twin.number == fast.number


def test_grid_points_of_failed_trials_are_visited_again(tmp_path):
    import optuna

    from autotune import studies

    sampler = studies.make_sampler("grid", 0, {"B": [1, 2, 3]})
    study = optuna.create_study(storage=studies.open_storage(f"sqlite:///{tmp_path / 't.db'}"), sampler=sampler)
    seen = []
    for _ in range(4):
        trial = study.ask()
        seen.append(trial.suggest_categorical("B", [1, 2, 3]))
        # the first trial is dropped (no outcome), the others are told
        study.tell(trial, state=optuna.trial.TrialState.FAIL) if len(seen) == 1 else study.tell(trial, 1.0)
    assert sorted(seen[1:]) == [1, 2, 3] and seen[0] in seen[1:]
