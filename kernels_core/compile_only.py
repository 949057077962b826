"""Compiling an op's kernels without running them.

The tuner compiles its candidates in a pool of processes while one process per GPU times them
(autotune.evaluate.CompilePool). A pool process calls the op, on inputs of the call's shapes,
inside `compile_only()`: each twin's launch path (kernels_cuda/_runtime.launch,
kernels_triton/_runtime.launch) then compiles and loads every kernel the call would launch, which
puts it in the kernel library's disk cache (CuPy's, Triton's), and launches none, so the GPU is
left to the measurement under way. The timing process's first call of that config finds the
binary on disk. What a wrapper does around its kernels with torch (allocating, zeroing an
output) still runs: a few small copies, against the seconds a compile takes.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


@contextlib.contextmanager
def compile_only():
    """Within it, the twins' launches compile and load their kernels and run nothing."""
    _state.on = True
    try:
        yield
    finally:
        _state.on = False


def active() -> bool:
    return getattr(_state, "on", False)
