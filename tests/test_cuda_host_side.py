"""The CUDA twin's host side, on the CPU: the GPU side (CuPy, the driver) is faked.

resource_report must describe the kernel a config's call really launched (its layout,
epilogue and vector width), not a variant rebuilt from the config alone; and every bad
argument must be refused, by name, before anything is compiled or launched.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

import kernels_cuda as kc
from kernels_cuda import _runtime as rt
from kernels_cuda import reports


@pytest.fixture
def fake_gpu(monkeypatch):
    loaded = {}

    def function(variant, device, smem):
        def fn(*args, **kwargs):
            pass
        fn.num_regs, fn.shared_size_bytes, fn.local_size_bytes = len(loaded) + 40, 128, 0
        loaded[variant.name_expr] = fn
        rt._launched[(variant.source, variant.name_expr)] = (smem, fn)
        return fn

    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(rt, "function", function)
    monkeypatch.setattr(rt, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(rt, "_stream", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(rt, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(rt, "device_props", lambda i: (90, 232448))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rt, "_variant_of", {})
    monkeypatch.setattr(rt, "_launched", {})
    return loaded


def test_resource_report_names_the_launched_variant(fake_gpu, rng):
    a = torch.randn(70, 130, generator=rng)  # passed as a.t(): an m-contiguous 130 x 70 operand
    b = torch.randn(70, 33, generator=rng)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4,
              "num_warps": 8, "num_stages": 2, "GROUP_M": 1, "VEC": 4}
    assert kc.resource_report("matmul", "fp32", config) is None, "nothing launched yet"
    kc.matmul(a.t(), b, bias=torch.randn(33, generator=rng), activation="relu", config=config)
    (launched,) = fake_gpu
    report = kc.resource_report("matmul", "fp32", config)
    assert report["registers"] == fake_gpu[launched].num_regs
    main, _ = reports._report_variant("matmul", "fp32", config, 90)
    assert main.name_expr != launched, "the launch differs from the row-major main variant"
    assert kc.resource_report("matmul", "fp32", {**config, "GROUP_M": 8}) is None


def test_elementwise_and_reductions_are_tagged_by_op_and_dtype(fake_gpu, rng):
    x = torch.randn(7, 129, generator=rng).half()
    kc.relu(x, config={"VEC": 2})
    kc.bias_grad(x)
    assert kc.resource_report("relu", "fp16", {"VEC": 2}) is not None
    assert kc.resource_report("relu", "fp32", {"VEC": 2}) is None
    assert kc.resource_report("bias_grad", "fp16") is not None
    assert kc.resource_report("relu_backward", "fp16", {"VEC": 2}) is None


def test_cuda_twin_names_the_bad_argument(fake_gpu):
    """The argument checks run on the host, so the CPU suite covers the CUDA twin's too."""
    from tests.test_ops import misnamed_errors
    failures = misnamed_errors(kc, "cpu")
    assert not failures, "\n".join(failures)
