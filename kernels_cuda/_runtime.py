"""Compiling and launching the .cu kernels: NVRTC through CuPy at run time
(offline nvcc builds for resource reports are in reports.py).

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

import functools
import os
import re
import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from kernels_core import compile_only, contract, dependent_launch

from . import _dependent

HERE = os.path.dirname(os.path.abspath(__file__))
NVRTC_OPTIONS = ("-std=c++17",)
# The sources whose every kernel calls dependent_start() (ptx.cuh) first: the kernels that may run as
# programmatic dependent launches (kernels_core/dependent_launch.py); built apart, with DEPENDENT_LAUNCH.
DEPENDENT_SOURCES = frozenset({"matmul_simt.cu", "matmul_tc.cu", "matmul_wgmma.cu", "matmul_wgmma_tf32x3.cu"})


@dataclass(frozen=True)
class Variant:
    """One template instantiation of a kernel in one .cu file."""

    source: str  # file name beside this module
    kernel: str
    targs: tuple[int, ...]
    sm_suffix: str = ""  # "a": built for the arch-specific target (sm_90a: wgmma, setmaxnreg)

    @property
    def name_expr(self) -> str:
        return f"{self.kernel}<{','.join(str(int(a)) for a in self.targs)}>"


# ------------------------------------------------------------------ sources

_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)
_source_text: dict[str, str] = {}


def source(name: str) -> str:
    """The kernel file with each local #include (dtypes.cuh, ...) pasted in its place, and in
    the pasted headers theirs: each header once, where it is first included (a later #include
    of it is dropped, as its include guard would make it empty).

    NVRTC gets one self-contained text (CuPy's disk cache hashes the source
    it is given, so an included file that changed would not be noticed)."""
    text = _source_text.get(name)
    if text is None:
        text = _pasted(name, set())
        _source_text[name] = text
    return text


def _pasted(name: str, seen: set[str]) -> str:
    seen.add(name)
    with open(os.path.join(HERE, name)) as f:
        return _INCLUDE.sub(lambda m: "" if m.group(1) in seen else _pasted(m.group(1), seen), f.read())


def _codes(header: str, prefix: str) -> dict[str, int]:
    """{"fp32": 0, ...} for prefix "DT": the codes `header` defines as `#define DT_FP32 0`, ..."""
    with open(os.path.join(HERE, header)) as f:
        return {m.group(1).lower(): int(m.group(2))
                for m in re.finditer(rf"^#define {prefix}_(\w+) (\d+)$", f.read(), re.MULTILINE)}


DT_CODE = _codes("dtypes.cuh", "DT")  # the first template argument of every kernel
EPI_CODE = _codes("fused.cuh", "EPI")  # {"plain": 0, "relu_grad": 1, "xent": 2, "sgd": 3}: the matmul kernels' epilogues


# ------------------------------------------------------------------ configs

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


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """Multiprocessors of the GPU: the grid of a persistent kernel."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_blocks(index: int, tiles: int, smem: int) -> int:
    """Blocks of a persistent kernel that walks `tiles` output tiles: as many as the SMs' shared
    memory holds at once, `smem` bytes a block (an upper bound on the blocks resident: registers
    may allow fewer, and the rest then simply start later), and no more than there are tiles."""
    return min(tiles, sm_count(index) * max(1, device_props(index)[1] // smem))


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


def function(variant: Variant, device: int, smem: int, dependent: int = 0):
    """The loaded kernel of `variant` on `device`, built for a dependent launch's mode `dependent`
    (kernels_core.dependent_launch.MODES' codes; 0: an ordinary launch)."""
    key = (variant.source, variant.name_expr, device, dependent)
    fn = _functions.get(key)
    if fn is None:
        cp = cupy()
        options = NVRTC_OPTIONS
        if variant.sm_suffix:
            options += (f"-arch=sm_{device_props(device)[0]}{variant.sm_suffix}",)
        if dependent:
            options += (f"-DDEPENDENT_LAUNCH={dependent}",)
        with cp.cuda.Device(device):
            module = cp.RawModule(code=source(variant.source), options=options,
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
    contract.check_grid(for_[0], tuple(grid))
    _, smem_limit = device_props(device)
    if smem > smem_limit:
        raise ValueError(f"config: needs {smem} bytes of shared memory per block, the GPU allows {smem_limit}")
    dependent = dependent_launch.code() if variant.source in DEPENDENT_SOURCES else 0
    fn = function(variant, device, smem, dependent)
    _variant_of[for_] = variant
    if compile_only.active():
        return
    cp = cupy()
    with cp.cuda.Device(device):
        if dependent:
            _dependent.launch(fn, tuple(grid), tuple(block), tuple(args), smem,
                              torch.cuda.current_stream(device).cuda_stream)
        else:
            with _stream(device):
                fn(tuple(grid), tuple(block), tuple(args), shared_mem=smem)


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(t.data_ptr() if t is not None else 0)


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def by_value(address: int):
    """A struct argument (a TMA tensor map) copied into the launch from host memory at `address`:
    CuPy hands the pointer to cuLaunchKernel's kernelParams, which copy the parameter's size; a
    dependent launch reads the address back (`address`), as CuPy keeps its own out of reach."""
    return _by_value_type()(address)


@functools.lru_cache(maxsize=None)
def _by_value_type():
    class ByValue(cupy().cuda.function.CPointer):
        def __init__(self, address: int):
            super().__init__(address)
            self.address = address
    return ByValue


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
