"""Programmatic dependent launches (kernels_core/dependent_launch.py), both twins.

A dependent launch lets a kernel start before the one ahead of it on the stream has finished, so
its correctness rests on one rule: each kernel that takes part waits (griddepcontrol.wait) before
its first access to global memory. On the CPU: the rule in the compiled code of each twin and each
mode (PTX for sm_90: the wait in the entry block, ahead of any global load, store, atomic or TMA
copy; the early mode's signal right after it, the exit mode's nowhere; no such instruction at all
in a build that does not take part), in the CUDA sources (every kernel of a taking-part source
starts with the wait), the launch paths (only kernels that wait are launched dependent, with their
mode; the driver call's arguments), the driver structs against cuda.h, and the trainer's refusals.
On a GPU: training runs in either mode give the same bits as one without.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kernels_cuda as kc
from kernels_core.dependent_launch import MODES, dependent_launch
from kernels_cuda import _dependent
from kernels_cuda import _runtime as rt
from kernels_cuda import reports
from tests.fake_cuda import fake_runtime

ROOT = str(Path(__file__).resolve().parents[1])
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

# A global-memory access in PTX: loads, stores, atomics, reductions, prefetches, cp.async and the
# TMA's bulk copies (whose state space names `global` after `shared::cluster`).
_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red|prefetch|cp\.async)(?:\.[\w:]+)*\.global\b",
                     re.MULTILINE)
_BRANCH = re.compile(r"^\s*(?:@!?%p\d+\s+)?bra(?:\.uni)?\s", re.MULTILINE)


def _entries(ptx: str) -> dict[str, str]:
    return {body.split("(")[0]: body for body in re.split(r"\.entry ", ptx)[1:]}


def _waits_first(body: str, mode: int) -> str | None:
    """Why an entry's body breaks the rule of `mode` (MODES' code), or None: the wait in the entry
    block (before any branch) and before any global access; in the early mode the signal right
    after it (still in the entry block), in the exit mode no signal."""
    wait, signal = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
    if wait < 0 or (mode == 1 and signal < wait) or (mode == 2 and signal >= 0):
        return f"wait at {wait}, signal at {signal}"
    last = max(wait, signal)
    for what, pattern in (("access", _ACCESS), ("branch", _BRANCH)):
        m = pattern.search(body)
        if m is not None and m.start() < last:
            return f"a global {what} before the wait or the signal: {m.group(0).strip()}"
    return None


# ----------------------------------------------------------------------------- CUDA twin, offline


def _first(op: str, dtype: str, **want) -> dict:
    elt = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
    return next(c for c in kc.space(op, dtype).configs(elt, 90) if all(c[k] == v for k, v in want.items()))


def _cuda_variants() -> list[rt.Variant]:
    """A variant of every kernel of the taking-part sources: SIMT, mma.sync, both wgmma GEMMs and
    the TF32 split, with fused epilogues."""
    cases = [("matmul", "fp32", {}), ("matmul", "fp16", {"WGMMA": 0}), ("matmul", "fp16", {"WGMMA": 1}),
             ("matmul", "fp32", {"TF32": 3, "WGMMA": 0}), ("matmul", "fp32", {"TF32": 3, "WGMMA": 1}),
             ("linear_sgd", "fp32", {}), ("linear_cross_entropy", "fp16", {})]
    variants = [reports._report_variant(op, dtype, _first(op, dtype, **want), 90)[0] for op, dtype, want in cases]
    return variants + [rt.Variant("matmul_wgmma_tf32x3.cu", "tf32_split_kernel", (2, 1), sm_suffix="a")]


def _cuda_ptx(variants: list[rt.Variant], dependent: int) -> dict[str, str]:
    """Every entry's PTX body, built for sm_90 (sm_90a where the variant asks) as NVRTC builds a
    launch's module: DEPENDENT_LAUNCH defined as the mode's code for a dependent one."""
    by_source: dict[str, list[rt.Variant]] = {}
    for v in variants:
        by_source.setdefault(v.source, []).append(v)
    bodies = {}
    for source, vs in by_source.items():
        refs = ", ".join(f"(void*)&{v.name_expr}" for v in vs)
        unit = (f"#define DEPENDENT_LAUNCH {dependent}\n" if dependent else "") + \
            f'#include "{source}"\nvoid* const kernel_refs[] = {{{refs}}};\n'
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "unit.cu").write_text(unit)
            done = subprocess.run(["nvcc", "-std=c++17", "-ptx", f"-arch=sm_90{vs[0].sm_suffix}", f"-I{rt.HERE}",
                                   "-o", f"{tmp}/unit.ptx", f"{tmp}/unit.cu"], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            bodies.update({f"{source}:{name}": body
                           for name, body in _entries(Path(tmp, "unit.ptx").read_text()).items()})
    return bodies


@needs_nvcc
def test_cuda_kernels_wait_before_any_global_access():
    variants = _cuda_variants()
    assert {v.source for v in variants} == rt.DEPENDENT_SOURCES
    for mode in MODES.values():
        dependent = _cuda_ptx(variants, dependent=mode)
        assert len(dependent) == len({(v.source, v.name_expr) for v in variants})
        broken = {name: why for name, body in dependent.items() if (why := _waits_first(body, mode))}
        assert not broken, (mode, broken)
    plain = _cuda_ptx(variants, dependent=0)
    assert not [name for name, body in plain.items() if "griddepcontrol" in body], \
        "a launch that does not take part runs the kernel as it was"


def test_every_kernel_of_a_dependent_source_starts_with_the_wait():
    """So a kernel added to one of these files cannot be launched dependent without waiting."""
    for source in sorted(rt.DEPENDENT_SOURCES):
        text = (Path(rt.HERE) / source).read_text()
        kernels = re.findall(r"^__global__ void[^{;]*\{\n(.*)$", text, re.MULTILINE)
        assert kernels, source
        assert all(first.strip() == "dependent_start();" for first in kernels), (source, kernels)


@needs_nvcc
def test_launch_structs_match_cuda_h():
    program = """#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
           offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "layout.cpp").write_text(program)  # a host program: nvcc hands it to the host compiler
        built = subprocess.run(["nvcc", "-o", f"{tmp}/layout", f"{tmp}/layout.cpp"], capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-2000:]
        theirs = [int(x) for x in subprocess.run([f"{tmp}/layout"], capture_output=True, text=True,
                                                 check=True).stdout.split()]
    A, C = _dependent.LaunchAttribute, _dependent.LaunchConfig
    ours = [ctypes.sizeof(A), A.value.offset, ctypes.sizeof(C), C.sharedMemBytes.offset, C.hStream.offset,
            C.attrs.offset, C.numAttrs.offset, _dependent.PROGRAMMATIC_STREAM_SERIALIZATION]
    assert ours == theirs


def test_parameters_point_at_each_value():
    struct = ctypes.create_string_buffer(b"tensor map bytes", 128)
    by_value = SimpleNamespace(address=ctypes.addressof(struct))
    args = (np.uint64(0xDEADBEEF0000), np.int32(-7), np.float32(1.5), by_value, np.int64(1 << 40))
    pointers, held = _dependent.parameters(args)
    for arg, address in zip(args, pointers):
        if isinstance(arg, np.generic):
            assert ctypes.string_at(address, arg.nbytes) == arg.tobytes()
        else:
            assert address == by_value.address
    with pytest.raises(TypeError, match="kernel parameter 1"):
        _dependent.parameters((np.int32(1), 5))


@pytest.fixture
def launch_log(monkeypatch):
    """The CUDA twin's launches on a faked GPU: (kernel source, the mode built for, launched dependent)."""
    log = []

    def function(variant, device, smem, dependent=0):
        def fn(*args, **kwargs):
            log.append((variant.source, dependent, False))
        fn.built_dependent, fn.source = dependent, variant.source
        return fn

    def dependent_launch_(fn, grid, block, args, smem, stream):
        log.append((fn.source, fn.built_dependent, True))

    fake_runtime(monkeypatch, function)
    monkeypatch.setattr(rt._dependent, "launch", dependent_launch_)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: SimpleNamespace(cuda_stream=0))
    return log


def test_cuda_launches_only_its_gemms_dependent(launch_log, rng):
    a, b = torch.randn(37, 50, generator=rng), torch.randn(50, 21, generator=rng)
    with dependent_launch("early"):
        kc.matmul(a, b)
        kc.relu(a)
        with dependent_launch("exit"):
            kc.matmul(a, b)
        kc.matmul(a, b)
    kc.matmul(a, b)
    assert launch_log == [("matmul_simt.cu", 1, True), ("elementwise.cu", 0, False), ("matmul_simt.cu", 2, True),
                          ("matmul_simt.cu", 1, True), ("matmul_simt.cu", 0, False)]
    with pytest.raises(ValueError, match="'late' is not one of early, exit"):
        with dependent_launch("late"):
            pass


def test_cuda_dependent_launch_calls_the_driver_with_the_attribute(monkeypatch):
    """What cuLaunchKernelEx is handed: the RawKernel's function handle, the grid, block, shared
    memory and stream, one attribute (programmatic stream serialization, on), the parameters."""
    seen = {}

    def launch_ex(config_ptr, function, pointers, extra):
        config = config_ptr._obj
        attr = config.attrs[0]
        seen.update(function=function, extra=extra, numAttrs=config.numAttrs, attr=(attr.id, attr.value[0] & 0xFFFFFFFF),
                    dims=(config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY,
                          config.blockDimZ, config.sharedMemBytes, config.hStream),
                    first=ctypes.c_int32.from_address(pointers[0]).value)
        return 0

    monkeypatch.setattr(_dependent, "_driver", (launch_ex, None))
    fn = SimpleNamespace(kernel=SimpleNamespace(ptr=0xF00D))  # a RawKernel has no `ptr` of its own
    _dependent.launch(fn, (3, 2, 1), (128, 1, 1), (np.int32(-5), np.uint64(7)), 4096, 0xABC)
    assert seen == dict(function=0xF00D, extra=None, numAttrs=1, attr=(_dependent.PROGRAMMATIC_STREAM_SERIALIZATION, 1),
                        dims=(3, 2, 1, 128, 1, 1, 4096, 0xABC), first=-5)


# ----------------------------------------------------------------------------- Triton twin

_TRITON_SCRIPT = r"""
import dataclasses, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
import kernels_triton as kt
from kernels_triton import reports
from kernels_triton.matmul import split_ahead

bodies = {}
for op, dtype, cfg in json.load(sys.stdin):
    elt = {"fp32": 4, "fp16": 2}[dtype]
    plans = [reports._sample_plan(op, dtype, kt.space(op, dtype).resolve(cfg, elt, 90))]
    if cfg and cfg.get("SPLIT_AHEAD"):
        plans.append(split_ahead(torch.empty(4096, 4096, device="meta"), 4096, 4096, False, 3, dtype, plans[0].config)[1])
    for plan in plans:
        for pdl in (0, 1, 2):
            p = dataclasses.replace(plan, args={**plan.args, "PDL": pdl})
            compiled = triton.compile(reports._ast_source(p), target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=p.num_warps, num_stages=p.num_stages, launch_pdl=pdl > 0))
            bodies[f"{len(bodies)}-{op}-{dtype}-{plan.op}-{pdl}"] = compiled.asm["ptx"]
print(json.dumps(bodies))
"""


def test_triton_kernels_wait_before_any_global_access():
    cases = [("matmul", "fp32", None), ("matmul", "fp16", None), ("linear_sgd", "fp32", None),
             ("linear_cross_entropy", "fp16", None), ("matmul", "fp32", {"TF32": 3, "SPLIT_AHEAD": 1})]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], input=json.dumps(cases), capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    ptx = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(ptx) == 3 * (len(cases) + 1)
    broken = {name: why for name, text in ptx.items() if int(name[-1])
              for entry, body in _entries(text).items() if (why := _waits_first(body, int(name[-1])))}
    assert not broken, broken
    assert not [name for name, text in ptx.items() if name.endswith("0") and "griddepcontrol" in text]


def test_triton_launches_only_kernels_that_wait(monkeypatch, rng):
    import kernels_triton._runtime as trt

    monkeypatch.setattr(trt, "interpreting", lambda: False)
    launched = []

    class Kernel:
        def __init__(self, params):
            self.params = params

        def __getitem__(self, grid):
            def run(**kwargs):
                launched.append((self.params, kwargs.get("PDL"), kwargs.get("launch_pdl", False)))
            return run

    x = torch.zeros(4)
    waits = trt.Plan("matmul", "fp32", {}, Kernel("waits"), (1,), dict(x=x, PDL=0), num_warps=4)
    plain = trt.Plan("relu", "fp32", {}, Kernel("plain"), (1,), dict(x=x), num_warps=4)
    with dependent_launch("early"):
        trt.launch(waits)
        trt.launch(plain)
        with dependent_launch("exit"):
            trt.launch(waits)
    trt.launch(waits)
    assert launched == [("waits", 1, True), ("plain", None, False), ("waits", 2, True), ("waits", 0, False)]


# ----------------------------------------------------------------------------- the trainer


def test_trainer_refuses_pdl_where_it_cannot_run(tmp_path, monkeypatch):
    from trainer.build import NeedsGpu, pick_device
    from trainer.config import Config

    with pytest.raises(ValueError, match="--pdl applies to the cuda and triton backends only"):
        Config(backend="torch", pdl="early")
    with pytest.raises(ValueError, match="--pdl 'late' is not one of early, exit"):
        Config(backend="cuda", pdl="late")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NeedsGpu, match=r"--pdl: .*runs on a GPU \(sm_90 or newer\); the step runs on cpu"):
        pick_device(Config(backend="triton", pdl="exit", out=str(tmp_path)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(NeedsGpu, match="needs sm_90 or newer; NVIDIA A100 is sm_80"):
        pick_device(Config(backend="cuda", pdl="early", out=str(tmp_path)))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("protocol,graph", [("default", True), ("seed", True), ("default", False)])
def test_dependent_launches_train_the_same_bits(tmp_path, backend, protocol, graph):
    from trainer.config import PRESETS, Config
    from trainer.train import build

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    settings = {} if protocol == "default" else {k: v for k, v in PRESETS[protocol].items() if k != "steps"}
    runs = []
    for pdl in (None, *MODES):
        config = Config(backend=backend, tuned_configs="none", steps=25, graph=graph, pdl=pdl, progress=False,
                        out=str(tmp_path), **settings)
        built = build(config)
        built.stepper.prepare(capture=graph)
        for _ in range(config.steps):
            built.stepper()
        torch.cuda.synchronize()
        runs.append((built.stepper.losses[:config.steps].clone(), [w.clone() for pair in built.backend.weights()
                                                                    for w in pair]))
    (losses, weights), *dependent = runs
    assert torch.isfinite(losses).all() and losses.abs().sum() > 0
    for losses_pdl, weights_pdl in dependent:
        assert torch.equal(losses, losses_pdl)
        assert all(torch.equal(w, v) for w, v in zip(weights, weights_pdl))
