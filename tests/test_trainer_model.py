"""The MLP written over the ops interface, checked with a pure-torch ops shim.

The shim gives the contract's semantics (kernels_core.reference.native) with
no kernels, so these tests isolate the model's wiring: same losses as the
torch backend, exactly the tuner's mnist-mlp calls, configs passed per call,
fp32 master weights in fp16, and warm-up steps that leave no trace.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kernels_core.store import ConfigStore
from kernels_core.mlp import mlp_calls
from kernels_core.shapes import shape_key
from kernels_core.contract import DTYPES, OPS, matmul_args
from kernels_core.reference import native
from trainer.config import Config
from trainer.tuned_configs import CallConfigs, as_fused
from trainer.data import DEFAULT_DIR, DeviceBatches, load_mnist
from trainer.model import OpsMLP
from trainer.stepper import Stepper
from trainer.torch_backend import TorchBackend, initial_mlp

CPU = torch.device("cpu")


def _without_kernel_args(fn):
    @functools.wraps(fn)
    def op(*args, config=None, out=None, **kwargs):
        return fn(*args, **kwargs)
    return op


SHIM = SimpleNamespace(**{name: _without_kernel_args(getattr(native, name)) for name in OPS})


class Spy:
    """Forwards to an ops module, recording (op, shape key, config) from the arguments themselves."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, op):
        def call(*args, config=None, **kwargs):
            if op == "matmul":
                ta, tb = kwargs.get("trans_a", False), kwargs.get("trans_b", False)
                key = shape_key(matmul_args(args[0], args[1], None, None, ta, tb, "fp32", kwargs.get("a_rows")),
                                ("t" if ta else "n") + ("t" if tb else "n"))
            elif op == "linear_cross_entropy":
                key = shape_key(matmul_args(args[0], args[1], None, None, False, False, "fp32"), "nn")
            elif op == "linear_sgd":  # the weight gradient x^T dy: (K_in, N_out, batch)
                key = shape_key((args[0].shape[1], args[1].shape[1], args[1].shape[0]), "tn")
            elif op == "sgd_update":
                key = shape_key((sum(p.numel() for p in args[0]),))
            else:
                key = shape_key(tuple(args[0].shape))
            self.calls.append((op, key, config))
            return getattr(self.ops, op)(*args, config=config, **kwargs)
        return call


@functools.lru_cache(maxsize=None)
def _data(dtype=torch.float32):
    return load_mnist(DEFAULT_DIR, CPU, dtype)


def _ops_mlp(config, ops=SHIM, store=None):
    import kernels_triton

    elt = torch.tensor([], dtype=DTYPES[config.dtype]).element_size()
    configs = CallConfigs(store, "triton", config.dtype, valid_for=lambda op, key, cfg: as_fused(
        op, key, cfg, kernels_triton.space(op, config.dtype), elt, 90))
    return OpsMLP(ops, initial_mlp(config.hidden, config.layers, config.seed), config, CPU, configs)


def _losses(backend, config, steps, prepare=True):
    data = _data(torch.float32 if config.dtype == "fp32" else torch.float16)
    batches = DeviceBatches(data.train_x, data.train_y, config.batch_size, config.seed)
    stepper = Stepper(backend, batches, torch.zeros(batches.steps_per_epoch))
    if prepare:
        stepper.prepare(capture=False)
    batches.new_epoch()
    for _ in range(steps):
        stepper()
    return stepper.losses[:steps].clone()


def test_initial_weights_are_shared_transposed():
    config = Config(hidden=16, layers=2, seed=3)
    torch_mlp, ops_mlp = TorchBackend(config, CPU), _ops_mlp(config)
    for (w, b), (w_t, b_t) in zip(ops_mlp.weights(), torch_mlp.weights()):
        assert w.is_contiguous() and torch.equal(w, w_t) and torch.equal(b, b_t)
    other = _ops_mlp(Config(hidden=16, layers=2, seed=4))
    assert not torch.equal(other.weights()[0][0], ops_mlp.weights()[0][0])


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.0), (0.0, 1e-3)])
def test_ops_model_matches_torch_backend_losses(momentum, weight_decay, fuse):
    config = Config(hidden=32, layers=2, batch_size=16, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    expected = _losses(TorchBackend(config, CPU), config, 100)
    got = _losses(_ops_mlp(replace(config, backend="triton", fuse=fuse)), config, 100)
    assert expected[-10:].mean() < 0.6 * expected[:10].mean()  # it trained, so the comparison means something
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)


@pytest.mark.parametrize("fuse", [True, False])
def test_warm_up_leaves_no_trace(fuse):
    config = Config(backend="triton", hidden=32, layers=1, batch_size=16, lr=0.05, fuse=fuse)
    with_warmup = _losses(_ops_mlp(config), config, 5, prepare=True)
    without = _losses(_ops_mlp(config), config, 5, prepare=False)
    assert torch.equal(with_warmup, without)
    torch_warm = _losses(TorchBackend(config, CPU), config, 5, prepare=True)
    torch_cold = _losses(TorchBackend(config, CPU), config, 5, prepare=False)
    assert torch.equal(torch_warm, torch_cold)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("layers", [1, 3])
def test_step_makes_exactly_the_tuned_calls_with_the_stores_configs(dtype, layers, fuse):
    hidden, batch = 24, 8
    config = Config(backend="triton", hidden=hidden, layers=layers, batch_size=batch, dtype=dtype, fuse=fuse)
    # An in-memory store with one tuned shape: its config must reach that call, and
    # the nearest-shape rule must hand it to the other "nn" matmuls.
    store = ConfigStore("cpu")
    tuned = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SPLIT_K": 1,
             **({"TF32": 3, "SPLIT_AHEAD": 0} if dtype == "fp32" else {})}  # a whole config: fp32's own tunables too
    store.put({"op": "matmul", "backend": "triton", "dtype": dtype, "shape": f"{batch}x{hidden}x784:nn",
               "config": tuned})
    spy = Spy(SHIM)
    model = _ops_mlp(config, ops=spy, store=store)
    data = _data()
    x = data.train_x[:3 * batch].to(torch.float16 if dtype == "fp16" else torch.float32)
    model.step(x, data.train_y[:3 * batch], torch.arange(batch, 3 * batch, 2))

    made = {(op, key) for op, key, _ in spy.calls}
    workload = {(c.op, c.key) for c in mlp_calls(hidden, layers, batch, dtype, fused=fuse)}
    assert made == workload
    assert len(spy.calls) == (3 * (layers + 1) - 1 if fuse else len(spy.calls))  # the fused step's kernels
    for op, key, cfg in spy.calls:
        if op == "linear_cross_entropy":  # no entry of its own: the matmul config of its GEMM, here nearest
            assert cfg == tuned, (op, key)
        elif op != "linear_sgd":  # no "tn" matmul in the store to borrow from: the default
            assert cfg == store.lookup(op, "triton", dtype, key)[0], (op, key)
        else:
            assert cfg is None
    assert ("matmul", f"{batch}x{hidden}x784:nn", tuned) in spy.calls
    table = model.configs.table()
    nearest = f"{'matmul:' if fuse else ''}nearest:{batch}x{hidden}x784:nn"
    assert "tuned" in table and nearest in table and "default" in table


def test_fp16_keeps_fp32_master_weights_and_tracks_torch_autocast():
    config = Config(hidden=32, layers=2, batch_size=16, lr=0.05, dtype="fp16")
    model = _ops_mlp(config)
    got = _losses(model, config, 15)
    assert all(p.dtype == torch.float32 for p in model.params + model.bufs)
    assert all(p.dtype == torch.float16 for p in model.low)
    expected = _losses(TorchBackend(config, CPU), config, 15)
    # The same fp16 roundings in another order (autocast vs explicit copies): the
    # trajectories drift apart chaotically, as fp16 and fp32 runs do, so only
    # the first steps are compared (about 2e-4 apart by step 15).
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=0)


def test_a_call_the_mlps_call_list_lacks_stops_the_step():
    """The model chooses each call's config from kernels_core.mlp.mlp_calls before its first step;
    a step that made another call would run a kernel the tuner never tuned, so it stops instead."""
    config = Config(backend="triton", hidden=24, layers=2, batch_size=8)
    model = _ops_mlp(config)
    listed = {(c.op, c.key) for c in mlp_calls(24, 2, 8, "fp32", fused=True)}
    assert set(model.configs.chosen) == listed  # chosen up front, each once
    with pytest.raises(RuntimeError, match="matmul on 8x24x25:nn, which kernels_core.mlp.mlp_calls does not list"):
        model._config("matmul", "8x24x25:nn")


def test_a_store_config_below_the_dtypes_precision_is_said_once_when_it_runs(tmp_path, capsys):
    """A store tuned with --lower-precision may hold plain TF32 configs (TF32=1): the trainer runs
    them as the store says, and says so once per call, naming the precision."""
    from kernels_core.store import save_store
    from trainer.build import make_backend

    key = "8x24x784:nn"
    store = ConfigStore("cpu")
    tf32 = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SPLIT_K": 1,
            "TF32": 1, "SPLIT_AHEAD": 0}
    store.put({"op": "matmul", "backend": "triton", "dtype": "fp32", "shape": key, "config": tf32})
    save_store(tmp_path / "store.json", store)
    config = Config(backend="triton", hidden=24, batch_size=8, target="cpu", tuned_configs=str(tmp_path / "store.json"))
    _, configs = make_backend(config, CPU)  # the model looks up every call of its step
    assert configs.get("matmul", key) == tf32
    warnings = [line for line in capsys.readouterr().err.splitlines() if "computes in tf32, below fp32" in line]
    assert f"warning: matmul {key} runs a config of the store that computes in tf32, below fp32: " \
        "BLOCK_K=32 BLOCK_M=32 BLOCK_N=64 GROUP_M=1 SPLIT_AHEAD=0 SPLIT_K=1 TF32=1 num_stages=3 num_warps=4" in warnings
    # The nearest-shape rule and the fused ops' borrowing hand it to other calls: each said once.
    assert len(warnings) == len(set(warnings)) > 1
