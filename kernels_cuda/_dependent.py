"""Programmatic dependent launches of the CUDA twin's kernels (kernels_core/dependent_launch.py).

CuPy launches through cuLaunchKernel, which takes no launch attributes. A dependent launch is
cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION set, called here
through ctypes on the CuPy function's handle, the kernel's parameters given as CuPy gives them:
an array of pointers, each to one parameter's bytes. The structs mirror cuda.h's
(tests/test_dependent_launch.py holds their sizes and offsets to the header's).
"""
from __future__ import annotations

import ctypes

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the attribute's id, padding to 8 bytes, then a 64-byte union of values
    (this attribute's value, an int, at its start)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int64 * 8)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_driver = None


def _driver_fns():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        ex = lib.cuLaunchKernelEx
        ex.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        ex.restype = ctypes.c_int
        name = lib.cuGetErrorName
        name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        name.restype = ctypes.c_int
        _driver = ex, name
    return _driver


def parameters(args) -> tuple[ctypes.Array, list]:
    """(the pointer array, what its pointers point at, to keep alive through the launch) for
    `args` as _runtime builds them: NumPy scalars, and structs by value (`address`: host memory)."""
    held, pointers = [], (ctypes.c_void_p * len(args))()
    for i, a in enumerate(args):
        if isinstance(a, np.generic):
            value = np.array(a)
            held.append(value)
            pointers[i] = value.ctypes.data
        elif hasattr(a, "address"):
            pointers[i] = a.address
        else:
            raise TypeError(f"kernel parameter {i}: {type(a).__name__}, not a NumPy scalar or a struct by value")
    return pointers, held


def launch(fn, grid, block, args, smem: int, stream: int) -> None:
    """`fn` (a CuPy RawKernel: its `kernel.ptr` is the CUfunction) as a dependent launch on
    `stream` (a CUstream handle), on the current device."""
    ex, error_name = _driver_fns()
    pointers, held = parameters(args)  # held to the end: the driver copies the values at the launch
    attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = LaunchConfig(*grid, *block, smem, stream, ctypes.pointer(attr), 1)
    err = ex(ctypes.byref(config), fn.kernel.ptr, pointers, None)
    if err:
        name = ctypes.c_char_p()
        error_name(err, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx: {(name.value or b'error').decode()} ({err})")
