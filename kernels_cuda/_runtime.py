"""Compiling and launching the .cu kernels: NVRTC through CuPy at run time,
nvcc offline for resource reports.

A kernel variant is a template instantiation, written as a name expression
such as ``relu_kernel<1,8,4,256>``; every template argument comes from a
config that its Space has already checked, or from the call's layout.
CuPy is imported on the first launch only, so the package imports (and the
tuner reads its spaces) on a machine without CuPy or a GPU.

Launch path, after the first call of a variant on a device: one dict lookup
for the function, one for the stream, one cuLaunchKernel on torch's current
stream. No compile, no allocation, no synchronization, so whole training
steps can be captured in CUDA graphs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_INCLUDE = '#include "common.cuh"'
NVRTC_OPTIONS = ("-std=c++17",)


@dataclass(frozen=True)
class Variant:
    """One template instantiation of a kernel in one .cu file."""

    source: str  # file name beside this module
    kernel: str
    targs: tuple[int, ...]

    @property
    def name_expr(self) -> str:
        return f"{self.kernel}<{','.join(str(int(a)) for a in self.targs)}>"


# ------------------------------------------------------------------ sources

_source_text: dict[str, str] = {}


def source(name: str) -> str:
    """The kernel file with common.cuh pasted in place of its #include.

    NVRTC gets one self-contained text (CuPy's disk cache hashes the source
    it is given, so an included file that changed would not be noticed)."""
    text = _source_text.get(name)
    if text is None:
        with open(os.path.join(HERE, name)) as f:
            body = f.read()
        with open(os.path.join(HERE, "common.cuh")) as f:
            common = f.read()
        text = body.replace(_INCLUDE, common, 1)
        _source_text[name] = text
    return text


# ------------------------------------------------------------------ configs

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ devices

_cupy = None


def cupy():
    global _cupy
    if _cupy is None:
        try:
            import cupy as cp
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError("kernels_cuda needs CuPy (cupy-cuda13x) to launch kernels") from e
        _cupy = cp
    return _cupy


_props: dict[int, tuple[int, int]] = {}


def device_props(index: int) -> tuple[int, int]:
    """(arch as 90 for sm_90, opt-in shared memory per block in bytes)."""
    p = _props.get(index)
    if p is None:
        props = torch.cuda.get_device_properties(index)
        p = (props.major * 10 + props.minor, int(props.shared_memory_per_block_optin))
        _props[index] = p
    return p


def check_cuda(name: str, t: torch.Tensor) -> None:
    if not t.is_cuda:
        raise ValueError(f"{name}: the CUDA backend needs a CUDA tensor, got one on {t.device}")


def setup(name: str, t: torch.Tensor, space, config) -> tuple[int, dict[str, int]]:
    """(device index, resolved config) for a launch on the GPU that holds `t`."""
    check_cuda(name, t)
    dev = t.device.index
    arch, _ = device_props(dev)
    return dev, space.resolve(config, t.element_size(), arch)


def alignment(t: torch.Tensor) -> int:
    """Largest power of two (up to 16) dividing the tensor's data address."""
    p = t.data_ptr()
    a = 16
    while a > 1 and p % a:
        a //= 2
    return a


def pick_vec(vec: int, elt: int, tensors=(), multiples=()) -> int:
    """Widest width <= vec (elements) whose min(width * elt, 16)-byte
    accesses are aligned on every tensor, and which divides every integer
    in `multiples` (leading dimensions, row lengths)."""
    while vec > 1:
        need = min(vec * elt, 16)
        if all(alignment(t) % need == 0 for t in tensors) and all(m % vec == 0 for m in multiples):
            break
        vec //= 2
    return vec


# ------------------------------------------------------------------ compile cache + launch

_functions: dict[tuple[str, str, int], object] = {}
_smem_allowed: dict[tuple[str, str, int], int] = {}  # dynamic smem each function was opened up to
_streams: dict[tuple[int, int], object] = {}
_launched: dict[tuple[str, str], tuple[int, object]] = {}


def function(variant: Variant, device: int, smem: int):
    key = (variant.source, variant.name_expr, device)
    fn = _functions.get(key)
    if fn is None:
        cp = cupy()
        with cp.cuda.Device(device):
            module = cp.RawModule(code=source(variant.source), options=NVRTC_OPTIONS,
                                  name_expressions=[variant.name_expr])
            fn = module.get_function(variant.name_expr)
        _functions[key] = fn
        _smem_allowed[key] = 48 * 1024
        _launched[(variant.source, variant.name_expr)] = (smem, fn)
    # Remembered here rather than read back: reading the attribute is a driver call per launch.
    if smem > _smem_allowed[key]:
        with cupy().cuda.Device(device):
            fn.max_dynamic_shared_size_bytes = smem
        _smem_allowed[key] = smem
    return fn


def _stream(device: int):
    handle = torch.cuda.current_stream(device).cuda_stream
    s = _streams.get((device, handle))
    if s is None:
        with warnings.catch_warnings():  # deprecated in CuPy 14, still the plain way to wrap a handle
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cupy().cuda.ExternalStream(handle, device)
        _streams[(device, handle)] = s
    return s


_variant_of: dict[tuple, Variant] = {}  # (op, dtype, config) -> the variant its last call launched


def tag(op: str, dtype: str, cfg: Mapping[str, int]) -> tuple:
    """Names what a launch ran for, so resource_report finds the variant a config really used."""
    return op, dtype, tuple(sorted(cfg.items()))


def launch(variant: Variant, device: int, grid, block, args, smem: int = 0, *, for_: tuple) -> None:
    _, smem_limit = device_props(device)
    if smem > smem_limit:
        raise ValueError(f"config: needs {smem} bytes of shared memory per block, the GPU allows {smem_limit}")
    fn = function(variant, device, smem)
    _variant_of[for_] = variant
    cp = cupy()
    with cp.cuda.Device(device), _stream(device):
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=smem)


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(t.data_ptr() if t is not None else 0)


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def resource_report(for_: tuple) -> dict | None:
    """Registers, shared memory and spills of the variant last launched `for_` (see tag)."""
    variant = _variant_of.get(for_)
    hit = variant and _launched.get((variant.source, variant.name_expr))
    if hit is None:
        return None
    smem, fn = hit
    return {
        "registers": int(fn.num_regs),
        "smem_bytes": int(fn.shared_size_bytes) + smem,
        "spill_bytes": int(fn.local_size_bytes),
        "compile_s": 0.0,
    }


# ------------------------------------------------------------------ offline nvcc reports

def nvcc_path() -> str | None:
    return shutil.which("nvcc")


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_DEMANGLED = re.compile(r"(\w+)<([^>]*)>")


def _demangle(names: list[str]) -> list[str]:
    """Mangled kernel names -> name expressions like kernel<1,2,3>."""
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        raise RuntimeError("compile_reports needs cu++filt or c++filt to read ptxas output")
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    exprs = []
    for line in out.splitlines():
        m = _DEMANGLED.search(line)
        exprs.append(f"{m.group(1)}<{m.group(2).replace(' ', '')}>" if m else line)
    return exprs


def compile_variants(variants: list[Variant], dynamic_smem: list[int], arch: int) -> list[dict]:
    """Compiles many variants in one nvcc call (one translation unit per
    source file) and returns, per variant, the ptxas resource numbers."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH: offline compile reports need the CUDA toolkit")
    by_source: dict[str, list[int]] = {}
    for i, v in enumerate(variants):
        by_source.setdefault(v.source, []).append(i)
    results: list[dict | None] = [None] * len(variants)
    for src, idx in by_source.items():
        unique = list(dict.fromkeys(variants[i].name_expr for i in idx))
        refs = ",\n    ".join(f"(void*)&{e}" for e in unique)
        tu = f'#include "{src}"\n\n// Taking the addresses instantiates the kernels.\nvoid* const kernel_refs[] = {{\n    {refs}\n}};\n'
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "variants.cu")
            with open(path, "w") as f:
                f.write(tu)
            t0 = time.perf_counter()
            proc = subprocess.run(
                [nvcc, "-std=c++17", "-cubin", f"-arch=sm_{arch}", "--resource-usage", f"-I{HERE}",
                 "-o", os.path.join(tmp, "variants.cubin"), path],
                capture_output=True, text=True)
            seconds = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {src} on sm_{arch}:\n{log[-4000:]}")
        parsed = _parse_ptxas(log)
        per = seconds / len(unique)
        for i in idx:
            info = parsed.get(variants[i].name_expr)
            if info is None:
                raise RuntimeError(f"no ptxas report for {variants[i].name_expr} on sm_{arch}:\n{log[-4000:]}")
            results[i] = {
                "registers": info["registers"],
                "smem_bytes": info["static_smem"] + dynamic_smem[i],
                "spill_bytes": info["spill_bytes"],
                "compile_s": per,
            }
    return results  # type: ignore[return-value]


def _parse_ptxas(log: str) -> dict[str, dict]:
    blocks: list[tuple[str, list[str]]] = []
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            blocks.append((m.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
    names = _demangle([b[0] for b in blocks]) if blocks else []
    out = {}
    for expr, (_, lines) in zip(names, blocks):
        text = "\n".join(lines)
        spill = _PTXAS_SPILL.search(text)
        used = _PTXAS_USED.search(text)
        smem = _PTXAS_SMEM.search(text)
        out[expr] = {
            "registers": int(used.group(1)) if used else 0,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else 0,
            "static_smem": int(smem.group(1)) if smem else 0,
        }
    return out
