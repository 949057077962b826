"""The config stores shipped with the package, and which store a run uses.

Order: the user's <out>/<target>/best.json, else the store shipped for their GPU, else one shipped
for another GPU of the same target (with a warning), else default configs. The trainer says which
in one line and in its summary; the tuner takes the chosen store's configs as the incumbents its
winners must beat.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernels_triton
from kernels_core import store as store_module
from kernels_core.store import SHIPPED, StoreError, choose_store, load_store, store_path, tuned_on
from trainer import tuned_configs
from trainer.config import Config

FASTEST = {"BLOCK_M": 32, "BLOCK_N": 64, "SPLIT": 1}  # tests/fake_backend.py's fastest matmul


def _write(path: Path, target: str, device: str, entries=None) -> Path:
    entries = entries if entries is not None else [
        {"op": "matmul", "backend": "triton", "dtype": "fp32", "shape": "64x64x64:nn",
         "config": kernels_triton.space("matmul", "fp32").default_for(90), "provenance": {"device": device}}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"target": target, "format": 1, "entries": entries}))
    return path


@pytest.fixture
def shipped(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(store_module, "SHIPPED", folder)
    return folder


def test_every_shipped_store_loads_as_a_users_would_and_names_one_gpu():
    paths = sorted(SHIPPED.glob("*.json"))
    assert paths, "no store ships with the package"
    for path in paths:
        data = json.loads(path.read_text())
        store = load_store(path, data["target"])  # every entry checked against today's spaces and limits
        devices = {e.get("provenance", {}).get("device") for e in data["entries"]}
        assert len(devices) == 1 and tuned_on(data) in devices and None not in devices, (path, devices)
        assert len(store.entries) == len(data["entries"]) > 0


def test_the_users_store_comes_first_then_the_one_shipped_for_the_gpu(tmp_path, shipped):
    h200 = _write(shipped / "h200.json", "sm_90", "NVIDIA H200")
    _write(shipped / "a100.json", "sm_80", "NVIDIA A100")
    choice = choose_store(tmp_path / "out", "sm_90", "NVIDIA H200")
    assert (choice.path, choice.kind, choice.warning) == (h200, "shipped", False)
    assert "shipped for NVIDIA H200" in choice.note and "\n" not in choice.note
    own = _write(store_path(tmp_path / "out", "sm_90"), "sm_90", "NVIDIA H200")
    choice = choose_store(tmp_path / "out", "sm_90", "NVIDIA H200")
    assert (choice.path, choice.kind) == (own, "yours")


def test_a_store_shipped_for_another_gpu_of_the_target_is_used_with_a_warning(tmp_path, shipped):
    h200 = _write(shipped / "h200.json", "sm_90", "NVIDIA H200")
    choice = choose_store(tmp_path / "out", "sm_90", "NVIDIA H100 80GB HBM3")
    assert (choice.path, choice.kind, choice.warning) == (h200, "shipped", True)
    assert choice.note.startswith("warning: no store is shipped for NVIDIA H100 80GB HBM3")
    assert "tuned on NVIDIA H200" in choice.note and "\n" not in choice.note


@pytest.mark.parametrize("target, device", [("sm_80", "NVIDIA A100"), ("sm_90", None), ("cpu", None)])
def test_no_store_of_the_target_means_default_configs(tmp_path, shipped, target, device):
    _write(shipped / "h200.json", "sm_90", "NVIDIA H200")
    choice = choose_store(tmp_path / "out", target, device)
    assert (choice.path, choice.kind, choice.warning) == (None, "none", False)
    assert choice.note.startswith("configs: defaults")


def test_an_unreadable_shipped_store_is_named(tmp_path, shipped):
    (shipped / "h200.json").write_text("{not json")
    with pytest.raises(StoreError, match="h200.json: the shipped store cannot be read"):
        choose_store(tmp_path / "out", "sm_90", "NVIDIA H200")


def test_the_trainer_uses_the_shipped_store_of_its_gpu_and_says_so(tmp_path, shipped, monkeypatch, capsys):
    h200 = _write(shipped / "h200.json", "sm_90", "NVIDIA H200")
    monkeypatch.setattr(tuned_configs, "local_gpu", lambda: ("sm_90", "NVIDIA H200"))
    config = Config(backend="triton", out=str(tmp_path / "out"))
    store, origin = tuned_configs.open_store(config)
    assert origin == f"shipped: {h200}" and store.lookup("matmul", "triton", "fp32", "64x64x64:nn")[1] == "tuned"
    assert capsys.readouterr().err.strip().splitlines() == [f"configs: {h200}, shipped for NVIDIA H200 (no "
                                                            f"{tmp_path / 'out' / 'sm_90' / 'best.json'}: "
                                                            "python -m autotune.search writes it)"]
    monkeypatch.setattr(tuned_configs, "local_gpu", lambda: ("sm_90", "NVIDIA H100 PCIe"))
    assert tuned_configs.open_store(config)[1] == f"shipped: {h200}"
    assert capsys.readouterr().err.startswith("warning: no store is shipped for NVIDIA H100 PCIe")
    assert tuned_configs.open_store(Config(backend="triton", out=str(tmp_path / "out"), tuned_configs="none")) \
        == (None, "none")


def test_the_tuner_keeps_a_shipped_incumbent_it_does_not_beat_and_writes_it(tmp_path, shipped, monkeypatch):
    """A first tuning run on a GPU the lab tuned: each study's winner must beat the shipped config,
    timed in the same run; where it does not, the shipped entry goes into best.json, so the new
    store, which replaces the shipped one whole, is never slower than it."""
    from autotune import search, tuning

    monkeypatch.setenv("AUTOTUNE_BACKENDS", "fake=tests.fake_backend")
    monkeypatch.setattr(tuning, "local_gpu", lambda: ("cpu", "FakeGPU"))
    shapes = ("16x16x16:nn", "32x32x16:nn")
    _write(shipped / "fake.json", "cpu", "FakeGPU", [
        {"op": "matmul", "backend": "fake", "dtype": "fp32", "shape": s, "config": dict(FASTEST),
         "provenance": {"device": "FakeGPU"}} for s in shapes])
    out = tmp_path / "out"
    assert search.main(["--out", str(out), "--storage", f"sqlite:///{tmp_path / 'tuning.db'}", "--target", "cpu",
                        "--backends", "fake", "--ops", "matmul", "--dtypes", "fp32", "--shapes", ",".join(shapes),
                        "--sampler", "random", "--seed", "1", "--trials", "2", "--workers", "1"]) == 0
    entries = json.loads(store_path(out, "cpu").read_text())["entries"]
    assert sorted(e["shape"] for e in entries) == sorted(shapes)
    assert all(e["config"] == FASTEST for e in entries)  # two random draws beat the best config nowhere
