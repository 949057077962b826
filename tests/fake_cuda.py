"""The CUDA twin's runtime with its GPU side faked, for host-side tests on the CPU: CuPy, the
stream, the device checks and properties (an sm_90 with 227 KB of shared memory a block) are
stand-ins, and `function` (what _runtime.function would build and load) is the test's own."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from kernels_cuda import _runtime as rt


def fake_runtime(monkeypatch, function) -> None:
    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(rt, "function", function)
    monkeypatch.setattr(rt, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(rt, "_stream", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(rt, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(rt, "device_props", lambda i: (90, 232448))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
