"""Elementwise ops: relu, relu_backward and bias_add (+ optional ReLU).

These kernels do almost no arithmetic; their speed is the rate at which they
move bytes, so the design is the one of Triton's vector-add tutorial: each
program owns BLOCK consecutive elements of flat memory and the whole grid
streams through the tensor once. Three things keep the stream at full width:

* wide accesses -- a thread should load 16 bytes at a time. Triton proves
  this itself when the pointers are 16-byte aligned and the length is a
  multiple of 16; for ragged lengths the mask `offs < n` would break the
  proof. VEC restores it: the wrapper picks VEC so that n (and, for bias_add,
  the row length) is a multiple of VEC and every pointer is VEC-aligned, and
  the kernel tells the compiler so. A misaligned view gets VEC=1.
* enough bytes in flight -- BLOCK / (32 * num_warps) elements per thread.
* 32-bit index math unless the tensor is too large for it (INT64).

bias_add finds an element's column as `offset % ncols`; the divisor is the
same for every thread, so the compiler hoists its reciprocal and the modulo
costs a multiply-high per element.

NaN semantics follow torch: ReLU keeps NaN (`x < 0` is false for NaN),
relu_backward zeroes the gradient wherever `y <= 0` (torch's threshold_backward: a
NaN y, from relu(NaN), passes the gradient on).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_core import contract
from kernels_core.contract import cdiv
from kernels_core.space import Space

from . import _runtime as rt


@triton.jit
def flat_block(n, INT64: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """This program's offsets into a flat array of n elements, and their mask."""
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if VEC > 1:  # a hint of 1 would overwrite what the compiler already knows
        offs = tl.max_contiguous(tl.multiple_of(offs, VEC), VEC)
    # The wrapper guarantees VEC | n; rewriting n this way lets the compiler see it.
    return offs, offs < (n // VEC) * VEC


@triton.jit
def _elementwise_kernel(
    x_ptr, other_ptr, y_ptr, n, ncols,
    OP: tl.constexpr, RELU: tl.constexpr, INT64: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    offs, mask = flat_block(n, INT64, BLOCK, VEC)
    x = tl.load(x_ptr + offs, mask=mask)
    if OP == "relu_backward":
        y = tl.load(other_ptr + offs, mask=mask)
        # Compared in fp32: Triton's interpreter (3.9) mis-compares bf16 tensors;
        # on a GPU the widening is a free shift next to the memory traffic.
        out = tl.where(y.to(tl.float32) <= 0, 0.0, x)
    else:
        if OP == "bias_add":
            col = offs % ncols
            if VEC > 1:  # VEC | ncols: each VEC-run of offsets stays in one row
                col = tl.max_contiguous(tl.multiple_of(col, VEC), VEC)
            bias = tl.load(other_ptr + col, mask=mask)
            # Two 16-bit values add exactly in fp32: one rounding, as in float64.
            x = (x.to(tl.float32) + bias.to(tl.float32)).to(y_ptr.dtype.element_ty)
        out = x
        if RELU:
            out = tl.where(x.to(tl.float32) < 0, 0.0, x)  # (fp32: see above)
    tl.store(y_ptr + offs, out, mask=mask)


def _space(elt: int) -> Space:
    return Space(
        params={
            "BLOCK": (1024, 2048, 4096, 8192, 16384),
            "num_warps": (2, 4, 8, 16),
            "VEC": (1, 2, 4, 8, 16),
        },
        # 4096 elements over 8 warps: 16 per thread, four 16-byte accesses in
        # flight for fp32, enough to cover HBM latency on Hopper.
        default={"BLOCK": 4096, "num_warps": 8, "VEC": 16 // elt},
        restrictions=(
            "VEC * elt <= 16",  # wider than one 16-byte access buys nothing
            "BLOCK % (32 * num_warps * VEC) == 0",  # every thread gets whole vectors
        ),
        notes="VEC is an upper bound: the wrapper lowers it for ragged lengths and misaligned views",
    )


SPACES = {name: _space(dt.itemsize) for name, dt in contract.DTYPES.items()}


def _plan(op: str, x, other, out, *, ncols: int, relu: bool, config, vec_tensors) -> rt.Plan | None:
    dtype = contract.dtype_name(x.dtype)
    cfg = rt.resolve(SPACES[dtype], config, x.element_size(), x.device)
    n = x.numel()
    if n == 0:
        return None
    vec = rt.vector_width(cfg["VEC"], ncols if op == "bias_add" else n, *vec_tensors)
    grid = (cdiv(n, cfg["BLOCK"]),)
    args = dict(
        x_ptr=x, other_ptr=other, y_ptr=out, n=n, ncols=ncols,
        OP=op, RELU=relu, INT64=n + cfg["BLOCK"] > 2**31 - 1,
        BLOCK=cfg["BLOCK"], VEC=vec,
    )
    return rt.Plan(op, dtype, cfg, _elementwise_kernel, grid, args, cfg["num_warps"])


def plan_relu(x, *, out=None, config=None):
    contract.check_tensor("x", x, dtypes=contract.FLOATS)
    rt.check_device("x", x)
    out = contract.output_like(out, x)
    x = rt.flat_input(x)
    return out, _plan("relu", x, x, out, ncols=1, relu=True, config=config, vec_tensors=(x, out))


def plan_relu_backward(grad, y, *, out=None, config=None):
    contract.relu_backward_args(grad, y)
    rt.check_device("grad", grad)
    out = contract.output_like(out, grad)
    grad, y = rt.flat_input(grad), rt.flat_input(y)
    return out, _plan("relu_backward", grad, y, out, ncols=1, relu=False, config=config,
                      vec_tensors=(grad, y, out))


def plan_bias_add(x, bias, *, activation=None, out=None, config=None):
    contract.bias_add_args(x, bias, activation)
    rt.check_device("x", x)
    out = contract.output_like(out, x)
    x, bias = rt.flat_input(x), rt.flat_input(bias)
    return out, _plan("bias_add", x, bias, out, ncols=x.shape[1], relu=activation == "relu", config=config,
                      vec_tensors=(x, bias, out))


def _run(planned):
    out, p = planned
    if p is not None:
        rt.launch(p)
    return out


def relu(x, *, out=None, config=None):
    return _run(plan_relu(x, out=out, config=config))


def relu_backward(grad, y, *, out=None, config=None):
    return _run(plan_relu_backward(grad, y, out=out, config=config))


def bias_add(x, bias, *, activation=None, out=None, config=None):
    return _run(plan_bias_add(x, bias, activation=activation, out=out, config=config))
