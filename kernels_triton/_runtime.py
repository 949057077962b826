"""What every wrapper of the package shares: device checks, config resolution,
the alignment rule for vector hints, and the launch record.

A wrapper's job is small but strict. It checks its arguments (naming the one
that is wrong), resolves the config against the op's search space, allocates
its outputs, and launches; it never waits on the GPU, so whole training steps
can be captured in a CUDA graph. Each wrapper builds a *plan* -- the kernel, its
grid, its arguments by name, and the launch options -- so that the same code
path serves a real launch and an offline compile (`compile_report`).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kernels_core import compile_only, contract, dependent_launch
from kernels_core.space import Space


def interpreting() -> bool:
    """True when Triton runs kernels in its NumPy interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _smem_limit(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    # The opt-in limit is what a kernel may ask for; older torch lacks the field.
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def check_device(name: str, t: torch.Tensor) -> None:
    """Compiled kernels read CUDA memory; the interpreter reads host memory.
    Shape-only "meta" tensors pass: `compile_report` plans with them."""
    if not interpreting() and t.device.type not in ("cuda", "meta"):
        raise ValueError(f"{name}: on {t.device}; Triton kernels need CUDA tensors "
                         "(or TRITON_INTERPRET=1 for CPU tensors)")


def resolve(space: Space, config, elt: int, device: torch.device) -> dict[str, int]:
    """The config to launch: default filled in, checked against the space and this GPU."""
    arch = contract.device_arch(device)
    cfg = space.resolve(config, elt, arch)
    if device.type == "cuda":
        need = space.cost(cfg, elt, arch)["smem_bytes"]
        limit = _smem_limit(_index(device))
        if need > limit:
            raise ValueError(f"config: needs {need} bytes of shared memory per block, "
                             f"this GPU allows {limit} (config={cfg})")
    return cfg


def flat_input(t: torch.Tensor) -> torch.Tensor:
    """Elementwise kernels walk flat memory. The rule for views: a contiguous
    view (any storage offset) is read in place; a non-contiguous one is copied
    once, because a strided gather would cost more than the copy saves."""
    return t if t.is_contiguous() else t.contiguous()


def vector_width(vec: int, n: int, *tensors: torch.Tensor) -> int:
    """The largest power of two <= `vec` that divides `n` and every tensor's
    element offset from a 16-byte boundary.

    The kernels promise the compiler that offsets and the length come in runs
    of VEC elements; this keeps that promise true for ragged lengths and for
    views that start mid-allocation (storage offset 1 gives VEC=1).
    """
    while vec > 1:
        ok = n % vec == 0 and all(t.data_ptr() % (vec * t.element_size()) == 0 for t in tensors)
        if ok:
            return vec
        vec //= 2
    return 1


@dataclass
class Plan:
    """One launch, described as data: `args` holds every kernel parameter by
    name (constexprs included) in the kernel's order; `before`, launches it needs
    done first (matmul's split pass)."""

    op: str
    dtype: str
    config: dict[str, int]
    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int
    num_stages: int = 1
    before: tuple["Plan", ...] = ()


# The CompiledKernel of the latest launch of each (op, dtype, config): what
# `resource_report` reads. A dict store per launch is the only bookkeeping.
LAUNCHED: dict[tuple, Any] = {}


def config_key(op: str, dtype: str, config: Mapping[str, int]) -> tuple:
    return (op, dtype, tuple(sorted(config.items())))


def launch(plan: Plan) -> None:
    for first in plan.before:
        launch(first)
    contract.check_grid(plan.op, plan.grid)
    device = next(v.device for v in plan.args.values() if isinstance(v, torch.Tensor))
    if compile_only.active() and interpreting():
        return  # the interpreter compiles nothing
    args, options = plan.args, dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
    pdl = dependent_launch.code()
    if pdl and "PDL" in args:  # a kernel that waits first (matmul.py's _dependent_start)
        args, options = {**args, "PDL": pdl}, {**options, "launch_pdl": True}
    # Triton launches on the current device; tensors on another GPU need it switched.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if compile_only.active():  # the same specialization as a launch, so the launch finds it cached
            compiled = plan.kernel.warmup(grid=plan.grid, **args, **options)
        else:
            compiled = plan.kernel[plan.grid](**args, **options)
    if compiled is not None:  # the interpreter returns nothing
        LAUNCHED[config_key(plan.op, plan.dtype, plan.config)] = compiled

