"""Tensor maps for the tensor memory accelerator (the wgmma kernels read their operands with it).

A tensor map tells the TMA unit where a 2-D tensor lives and which box to copy per request. The
driver builds it (cuTensorMapEncodeTiled, called here through ctypes: CuPy does not wrap it) into
an opaque 128-byte struct the kernel takes by value. The kernel reads every operand as rows of a
contiguous dimension, so a map is (cols, rows, row stride, box); what the TMA cannot read (a
start address not 16-byte aligned, a row stride not a multiple of 16 bytes) is found here, before
any launch, so the caller can refuse the config with a reason.

Maps are cached by their arguments: building one is a driver call of a few microseconds, and a
training step reads the same weights and activations every time.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

# Bytes along the contiguous dimension per box row: one 128-byte row, the span of the 128-byte
# swizzle the kernels' wgmma descriptors name; 64 elements of a 16-bit type.
BOX_BYTES = 128
BOX_COLS = BOX_BYTES // 2
_ALIGN = 16  # bytes: the TMA's rule for start addresses and row strides
_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B
# CU_TENSOR_MAP_DATA_TYPE_UINT16 / _UINT32 by element size: the copy moves bits, so fp16 and bf16
# alike, and fp32 holding TF32 numbers.
_BITS_OF_SIZE = {2: 1, 4: 2}
_L2_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_MAP_BYTES, _MAP_ALIGN = 128, 64  # sizeof / alignof(CUtensorMap)
_CACHE_LIMIT = 4096


class Map2D(NamedTuple):
    """A row-major matrix of `rows` x `cols` elements of `elt_bytes` (2 or 4) bytes, `ld` elements
    between rows, read in boxes of BOX_BYTES x box_rows."""
    ptr: int
    rows: int
    cols: int
    ld: int
    box_rows: int
    elt_bytes: int = 2

    def readable(self) -> bool:
        """Whether the TMA can read it: an aligned start, and a row stride of whole 16-byte
        units (of one row any stride does: the map is given a valid one)."""
        return self.ptr % _ALIGN == 0 and (self.rows == 1 or (self.elt_bytes * self.ld) % _ALIGN == 0)

    def row_stride_bytes(self) -> int:
        if self.rows > 1:
            return self.elt_bytes * self.ld
        return -(-self.elt_bytes * self.cols // _ALIGN) * _ALIGN


_driver = None
_maps: dict[Map2D, tuple[ctypes.Array, int]] = {}


def _encode_fn():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _driver = fn
    return _driver


def tensor_map(m: Map2D) -> int:
    """Host address of the encoded map (kept alive by the cache), to pass by value to a kernel."""
    hit = _maps.get(m)
    if hit is not None:
        return hit[1]
    if not m.readable():
        raise ValueError(f"the TMA cannot read {m}: start or row stride not a multiple of {_ALIGN} bytes")
    buf = ctypes.create_string_buffer(_MAP_BYTES + _MAP_ALIGN)
    addr = -(-ctypes.addressof(buf) // _MAP_ALIGN) * _MAP_ALIGN
    dims = (ctypes.c_uint64 * 2)(m.cols, m.rows)
    strides = (ctypes.c_uint64 * 1)(m.row_stride_bytes())
    box = (ctypes.c_uint32 * 2)(BOX_BYTES // m.elt_bytes, m.box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    err = _encode_fn()(addr, _BITS_OF_SIZE[m.elt_bytes], 2, m.ptr, dims, strides, box, unit, 0, _SWIZZLE_128B, _L2_256B, 0)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} for {m}")
    if len(_maps) >= _CACHE_LIMIT:  # stale maps of freed tensors: start over rather than track them
        _maps.clear()
    _maps[m] = (buf, addr)
    return addr
