"""bias_grad: column sums of a [M, N] gradient, in float32.

A column reduction reads rows, which are the contiguous direction, so each
program owns a BLOCK_N-wide strip of columns and a ROWS-tall slab of rows: it
walks the slab BLOCK_M rows at a time, adding whole [BLOCK_M, BLOCK_N] tiles
into a register accumulator (coalesced loads, no reduction inside the loop),
folds the tile to BLOCK_N sums once at the end, and adds them into the output
with atomics. Splitting M over ROWS-tall slabs is what fills the GPU when N is
small (N = 10 gives a single strip); the wrapper zeroes the output first,
an asynchronous memset that needs no second pass and no scratch buffer.

Precision: a slab is summed as BLOCK_M interleaved running sums of
ROWS / BLOCK_M terms each, and the output adds one slab sum per ROWS rows, so
no fp32 running sum grows long even for M = 1e6. The order of the atomic adds
varies between runs, so the last bits may too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_core import contract
from kernels_core.contract import cdiv
from kernels_core.space import Space

from . import _runtime as rt


@triton.jit
def _bias_grad_kernel(
    g_ptr, out_ptr, M, N, stride_m, stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row0 = tl.program_id(1) * ROWS
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_M):
        row = row0 + r + rows
        # Row offsets in 64 bits: M * stride_m may pass 2**31 for M ~ 1e6.
        ptrs = g_ptr + row.to(tl.int64)[:, None] * stride_m + cols[None, :] * stride_n
        tile = tl.load(ptrs, mask=(row[:, None] < M) & col_ok[None, :], other=0.0)
        acc += tile.to(tl.float32)
    tl.atomic_add(out_ptr + cols, tl.sum(acc, axis=0), mask=col_ok)


SPACES = {
    name: Space(
        params={
            "BLOCK_M": (8, 16, 32, 64, 128),
            "BLOCK_N": (16, 32, 64, 128, 256),
            "ROWS": (256, 1024, 4096, 16384),
            "num_warps": (2, 4, 8),
        },
        default={"BLOCK_M": 32, "BLOCK_N": 128, "ROWS": 1024, "num_warps": 4},
        restrictions=(
            "ROWS % BLOCK_M == 0",
            # The accumulator tile lives in registers: at most 64 fp32 per thread.
            "BLOCK_M * BLOCK_N <= 64 * 32 * num_warps",
        ),
        notes="grid = (cdiv(N, BLOCK_N), cdiv(M, ROWS)); output zeroed, then atomically accumulated",
    )
    for name in contract.DTYPES
}


def plan_bias_grad(grad, *, out=None, config=None):
    contract.check_tensor("grad", grad, ndim=2, dtypes=contract.FLOATS)
    rt.check_device("grad", grad)
    M, N = grad.shape
    out = contract.output("out", out, (N,), torch.float32, grad.device)
    dtype = contract.dtype_name(grad.dtype)
    cfg = rt.resolve(SPACES[dtype], config, grad.element_size(), grad.device)
    if N == 0:
        return out, None
    out.zero_()
    if M == 0:
        return out, None
    grid = (cdiv(N, cfg["BLOCK_N"]), cdiv(M, cfg["ROWS"]))
    args = dict(g_ptr=grad, out_ptr=out, M=M, N=N, stride_m=grad.stride(0), stride_n=grad.stride(1),
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], ROWS=cfg["ROWS"])
    return out, rt.Plan("bias_grad", dtype, cfg, _bias_grad_kernel, grid, args, cfg["num_warps"])


def bias_grad(grad, *, out=None, config=None):
    out, p = plan_bias_grad(grad, out=out, config=config)
    if p is not None:
        rt.launch(p)
    return out
