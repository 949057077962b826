"""A test-only backend with the twins' interface, whose configs misbehave on purpose.

Select it with AUTOTUNE_BACKENDS=fake=tests.fake_backend and --backends fake.
relu's tunable MODE picks the outcome: 0 ok, 1 compile error, 2 wrong result,
3 hang, 4 process crash (FAKE_RELU_DEFAULT_MS slows its default config). matmul is correct for every config and is fastest
at BLOCK_M=32, BLOCK_N=64, SPLIT=1 (FAKE_BEST=M,N,SPLIT moves it), so a search has something to find. FAKE_COMPILE_S
makes each config's first call slow, like a real compile (FAKE_CACHE_DIR keeps it compiled across
processes, like the twins' disk caches); inside kernels_core.compile_only a call compiles and runs nothing; FAKE_LOST_GPU=1 makes
every call kill its process, as every launch does on a GPU that fell off the bus. FAKE_TF32=1 gives matmul the twins'
fp32 TF32 tunable: 1 (lower precision, "tf32") is 3e-3 off, beyond the fp32 tolerance and within tf32's, and 2 ms a
call faster than the other values; 3 (emulated) is FAKE_TF32X3_REL (default 0) off the default config's result,
relative.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from kernels_core import compile_only, reference
from kernels_core.contract import OPS
from kernels_core.space import Space

_SPACES = {
    "relu": Space(params={"BLOCK": (64, 128, 256), "MODE": (0, 1, 2, 3, 4)},
                  default={"BLOCK": 64, "MODE": 0}, restrictions=("BLOCK * elt <= 512",),
                  threads="BLOCK", smem_bytes="0"),
    "matmul": Space(params={"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (16, 32, 64, 128), "SPLIT": (1, 2)},
                    default={"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT": 1},
                    restrictions=("BLOCK_M * BLOCK_N <= 4096",), threads="BLOCK_M * 4",
                    smem_bytes="(BLOCK_M + BLOCK_N) * 32 * elt"),
}
# As in the twins, bf16 tensor-core matmul starts at sm_80.
_BF16_MATMUL = replace(_SPACES["matmul"], restrictions=_SPACES["matmul"].restrictions + ("arch >= 80  # bf16 tensor cores start at sm_80",))
_OTHER = Space(params={"BLOCK": (128, 256)}, default={"BLOCK": 128})
_TF32_MATMUL = replace(_SPACES["matmul"], params={**_SPACES["matmul"].params, "TF32": (0, 3, 1)},
                       default={**_SPACES["matmul"].default, "TF32": 0},
                       lower_precision={"TF32": {1: "tf32"}}, emulated={"TF32": (3,)})
_compiled: set = set()


class FakeCompileError(RuntimeError):
    pass


def space(op: str, dtype: str) -> Space:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if op == "matmul" and dtype == "bf16":
        return _BF16_MATMUL
    if op == "matmul" and os.environ.get("FAKE_TF32"):
        return _TF32_MATMUL
    return _SPACES.get(op, _OTHER)


def _resolve(op, config, dtype_bytes=4):
    if os.environ.get("FAKE_LOST_GPU"):
        os._exit(9)
    return space(op, "fp32").resolve(config, dtype_bytes)


def _compile(op, config) -> None:
    """A config's first call sleeps FAKE_COMPILE_S; with FAKE_CACHE_DIR, only its first in any
    process, as the twins' kernels are compiled once into their libraries' disk caches."""
    key = (op, tuple(sorted(config.items())))
    cache = os.environ.get("FAKE_CACHE_DIR")
    marker = Path(cache) / "-".join([op, *(f"{k}{v}" for k, v in key[1])]) if cache else None
    if key not in _compiled and not (marker and marker.exists()):
        time.sleep(float(os.environ.get("FAKE_COMPILE_S", "0")))
        if marker:  # who compiled it: the tuner's compile pool, or a call that ran
            marker.write_text("compile_only" if compile_only.active() else "call")
    _compiled.add(key)


def relu(x, *, out=None, config=None):
    cfg = _resolve("relu", config, x.element_size())
    mode = cfg["MODE"]
    if mode == 1:
        raise FakeCompileError(f"ptxas: too many resources requested (BLOCK={cfg['BLOCK']})")
    _compile("relu", cfg)
    if compile_only.active():
        return None
    if mode == 3:
        time.sleep(3600)
    if mode == 4:
        os._exit(9)
    if cfg["BLOCK"] == 64:  # the default: FAKE_RELU_DEFAULT_MS makes it the slowest config that runs
        time.sleep(float(os.environ.get("FAKE_RELU_DEFAULT_MS", "0")) / 1e3)
    y = x.clone() if mode == 2 else torch.relu(x)
    if out is not None:
        out.copy_(y)
        return out
    return y


def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
           accumulate="fp32", a_rows=None, relu_grad_of=None):
    cfg = _resolve("matmul", config, a.element_size())
    _compile("matmul", cfg)
    if compile_only.active():
        return None
    # A config-dependent cost, so the search has a best config to find: the best sleeps not at all,
    # every other config 2 ms or more a call, far above the scheduling noise of a loaded 2-core CI
    # machine (a 0.1 ms step once let a 0.2 ms config beat the 0.1 ms best in a median of five).
    m, n, split = (int(v) for v in os.environ.get("FAKE_BEST", "32,64,1").split(","))
    time.sleep(2e-3 * (abs(cfg["BLOCK_M"] - m) / 16 + abs(cfg["BLOCK_N"] - n) / 16 + abs(cfg["SPLIT"] - split)
                       + (cfg.get("TF32", 1) != 1)))
    y = reference.native.matmul(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b,
                                a_rows=a_rows, relu_grad_of=relu_grad_of)
    if cfg.get("TF32"):
        y = y * (1 + (3e-3 if cfg["TF32"] == 1 else float(os.environ.get("FAKE_TF32X3_REL", "0"))))
    return y.to(a.dtype)


def _passthrough(op):
    def fn(*args, config=None, out=None, **kwargs):
        _resolve(op, config)
        if compile_only.active():
            return None
        return getattr(reference.native, op)(*args, **kwargs)
    fn.__name__ = op
    return fn


relu_backward = _passthrough("relu_backward")
bias_add = _passthrough("bias_add")
bias_grad = _passthrough("bias_grad")
softmax_cross_entropy = _passthrough("softmax_cross_entropy")
sgd_update = _passthrough("sgd_update")


def compile_report(op, dtype, config, arch):
    if config.get("MODE") == 1:
        raise FakeCompileError(f"ptxas: too many resources requested for {config}")
    sp = space(op, dtype)
    cost = sp.cost(config, 2 if dtype != "fp32" else 4, arch)
    tile = config.get("BLOCK_M", 16) * config.get("BLOCK_N", 16)
    return {"registers": min(255, 32 + tile // 32), "smem_bytes": cost["smem_bytes"],
            "spill_bytes": 64 if tile > 2048 else 0, "compile_s": 0.001}


def compile_reports(op, dtype, configs, arch):
    return [compile_report(op, dtype, c, arch) for c in configs]


def resource_report(op, dtype, config):
    try:
        return compile_report(op, dtype, config, 90)
    except FakeCompileError:
        return None
