"""sgd_update: torch.optim.SGD's step (dampening 0, no Nesterov), in place.

    d = g + weight_decay * p
    buf = momentum * buf + d;  d = buf      (only when momentum != 0)
    p = p - lr * d

The update is elementwise and memory-bound, so it uses the layout of the
elementwise kernels (BLOCK consecutive elements per program, VEC-wide
accesses when the lengths and pointers allow). One launch per tensor: the
networks here have a handful of parameter tensors, and a multi-tensor launch
would need a pointer table, i.e. an allocation and a host-to-device copy.
The rule itself is `sgd_rule`, which linear_sgd's epilogue (fused.py) runs on
gradients that never left registers: one rule, one order of operations.

Weight decay and momentum are compile-time switches rather than zeros, so that
weight_decay = 0 does what torch does (skip the term: 0 * inf would be NaN)
and the no-momentum kernel never touches a buffer. lr, momentum and
weight_decay are runtime fp32 scalars, so a schedule that changes lr does not
recompile (a captured CUDA graph still bakes in the values it was captured with).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_core import contract
from kernels_core.contract import cdiv
from kernels_core.space import Space

from . import _runtime as rt
from .elementwise import flat_block


@triton.jit
def sgd_rule(g, p_ptrs, buf_ptrs, low_ptrs, mask, lr, momentum, weight_decay,
             HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, LOW: tl.constexpr):
    """The rule on a block of fp32 params from their fp32 gradient `g`; LOW also stores the new
    params rounded to `low_ptrs`' dtype. The one definition: linear_sgd's epilogue runs it too."""
    p, buf = sgd_load(p_ptrs, buf_ptrs, mask, HAS_MOMENTUM)
    sgd_apply(g, p, buf, p_ptrs, buf_ptrs, low_ptrs, mask, lr, momentum, weight_decay, HAS_MOMENTUM,
              HAS_WEIGHT_DECAY, LOW)


@triton.jit
def sgd_load(p_ptrs, buf_ptrs, mask, HAS_MOMENTUM: tl.constexpr):
    """What the rule reads, the params and (HAS_MOMENTUM) their momentum buffers: apart from
    sgd_apply, so that a caller can send for them before it has the gradient."""
    p = tl.load(p_ptrs, mask=mask)
    buf = p
    if HAS_MOMENTUM:
        buf = tl.load(buf_ptrs, mask=mask)
    return p, buf


@triton.jit
def sgd_apply(g, p, buf, p_ptrs, buf_ptrs, low_ptrs, mask, lr, momentum, weight_decay,
              HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, LOW: tl.constexpr):
    """The rule on params p and buffers buf as sgd_load read them; stores the new values."""
    d = g
    if HAS_WEIGHT_DECAY:
        d += weight_decay * p
    if HAS_MOMENTUM:
        d += momentum * buf
        tl.store(buf_ptrs, d, mask=mask)
    p = p - lr * d
    tl.store(p_ptrs, p, mask=mask)
    if LOW:
        tl.store(low_ptrs, p.to(low_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _sgd_kernel(
    p_ptr, g_ptr, buf_ptr, n, lr, momentum, weight_decay,
    HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, INT64: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    offs, mask = flat_block(n, INT64, BLOCK, VEC)
    sgd_rule(tl.load(g_ptr + offs, mask=mask).to(tl.float32), p_ptr + offs, buf_ptr + offs, p_ptr + offs, mask,
             lr, momentum, weight_decay, HAS_MOMENTUM, HAS_WEIGHT_DECAY, False)


SPACES = {
    name: Space(
        params={"BLOCK": (1024, 2048, 4096, 8192), "num_warps": (2, 4, 8, 16), "VEC": (1, 2, 4)},
        default={"BLOCK": 2048, "num_warps": 4, "VEC": 4},
        restrictions=("BLOCK % (32 * num_warps * VEC) == 0",),
        notes="dtype names the grads' dtype; params and buffers are fp32, so VEC <= 4",
    )
    for name in contract.DTYPES
}


def plan_sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0, weight_decay=0.0, config=None):
    params, grads, bufs, lr, momentum, weight_decay = contract.check_sgd_args(
        params, grads, momentum_bufs, lr, momentum, weight_decay)
    if params:
        rt.check_device("params[0]", params[0])
    plans = []
    for p, g, buf in zip(params, grads, bufs):
        device = p.device
        g = rt.flat_input(g)
        dtype = contract.dtype_name(g.dtype)
        cfg = rt.resolve(SPACES[dtype], config, g.element_size(), device)
        n = p.numel()
        if n == 0:
            continue
        vec = rt.vector_width(cfg["VEC"], n, p, g, *([buf] if buf is not None else []))
        args = dict(
            p_ptr=p, g_ptr=g, buf_ptr=buf if buf is not None else p, n=n,
            lr=lr, momentum=momentum, weight_decay=weight_decay,
            HAS_MOMENTUM=bool(momentum), HAS_WEIGHT_DECAY=bool(weight_decay),
            INT64=n + cfg["BLOCK"] > 2**31 - 1, BLOCK=cfg["BLOCK"], VEC=vec,
        )
        plans.append(rt.Plan("sgd_update", dtype, cfg, _sgd_kernel, (cdiv(n, cfg["BLOCK"]),), args,
                             cfg["num_warps"]))
    return plans


def sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0, weight_decay=0.0, config=None):
    # Every tensor is checked before the first one is touched: no half-applied step.
    for p in plan_sgd_update(params, grads, momentum_bufs, lr=lr, momentum=momentum,
                             weight_decay=weight_decay, config=config):
        rt.launch(p)
