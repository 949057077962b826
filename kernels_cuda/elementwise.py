"""relu, relu_backward, bias_add and sgd_update (elementwise.cu) and their
shared search space."""
from __future__ import annotations

import torch

from . import _runtime as rt
from .contract import (FLOATS, Space, bias_add_args, check_sgd_args, check_tensor, dtype_name, output_like,
                       relu_backward_args)

_DT_CODE = {"fp32": 0, "fp16": 1, "bf16": 2}
_DT_NAME = {code: name for name, code in _DT_CODE.items()}

# threads = 32 * num_warps; each thread moves ITEMS vectors of VEC elements
# (VEC is lowered by the host for misaligned pointers or, for bias_add, a
# row length it does not divide). Default VEC=4: on the H200, fp32 relu at
# 256M elements ran at 96% of copy bandwidth with VEC=4 and 77% with VEC=8
# (two 16-byte loads per vector; experiments/results/kernels_h200.csv).
SPACE = Space(
    params={"num_warps": (1, 2, 4, 8, 16), "VEC": (1, 2, 4, 8), "ITEMS": (1, 2, 4, 8)},
    default={"num_warps": 4, "VEC": 4, "ITEMS": 4},
    threads="32 * num_warps",
    smem_bytes="0",
    notes="one block covers 32 * num_warps * ITEMS * VEC elements",
)


def _variant(kernel: str, dtype: str, cfg, vec: int, *extra) -> rt.Variant:
    return rt.Variant("elementwise.cu", kernel,
                      (_DT_CODE[dtype], vec, cfg["ITEMS"], 32 * cfg["num_warps"], *extra))


def main_variant(op: str, dtype: str, cfg) -> tuple[rt.Variant, int]:
    """The variant compile reports measure for `op`."""
    kernel, extra = {
        "relu": ("relu_kernel", ()),
        "relu_backward": ("relu_backward_kernel", ()),
        "bias_add": ("bias_add_kernel", (1,)),
        "sgd_update": ("sgd_kernel", (1,)),
    }[op]
    return _variant(kernel, dtype, cfg, cfg["VEC"], *extra), 0


def _launch_flat(op: str, variant: rt.Variant, cfg, dev: int, n: int, args) -> None:
    threads = 32 * cfg["num_warps"]
    dtype, vec = _DT_NAME[variant.targs[0]], variant.targs[1]
    blocks = max(1, rt.cdiv(n // vec, threads * cfg["ITEMS"]))
    rt.launch(variant, dev, (blocks, 1, 1), (threads, 1, 1), args, for_=rt.tag(op, dtype, cfg))


def relu(x, *, out=None, config=None):
    check_tensor("x", x, dtypes=FLOATS)
    dev, cfg = rt.setup("x", x, SPACE, config)
    out = output_like(out, x)
    if x.numel() == 0:
        return out
    x = x.contiguous()
    dtype = dtype_name(x.dtype)
    vec = rt.pick_vec(cfg["VEC"], x.element_size(), (x, out))
    _launch_flat("relu", _variant("relu_kernel", dtype, cfg, vec), cfg, dev, x.numel(),
                 (rt.ptr(x), rt.ptr(out), rt.i64(x.numel())))
    return out


def relu_backward(grad, y, *, out=None, config=None):
    relu_backward_args(grad, y)
    dev, cfg = rt.setup("grad", grad, SPACE, config)
    out = output_like(out, grad)
    if grad.numel() == 0:
        return out
    grad, y = grad.contiguous(), y.contiguous()
    vec = rt.pick_vec(cfg["VEC"], grad.element_size(), (grad, y, out))
    _launch_flat("relu_backward", _variant("relu_backward_kernel", dtype_name(grad.dtype), cfg, vec), cfg, dev,
                 grad.numel(),
                 (rt.ptr(grad), rt.ptr(y), rt.ptr(out), rt.i64(grad.numel())))
    return out


def bias_add(x, bias, *, activation=None, out=None, config=None):
    bias_add_args(x, bias, activation)
    dev, cfg = rt.setup("x", x, SPACE, config)
    ncols = x.shape[1]
    out = output_like(out, x)
    if x.numel() == 0:
        return out
    x, bias = x.contiguous(), bias.contiguous()
    vec = rt.pick_vec(cfg["VEC"], x.element_size(), (x, bias, out), (ncols,))
    variant = _variant("bias_add_kernel", dtype_name(x.dtype), cfg, vec, int(activation == "relu"))
    _launch_flat("bias_add", variant, cfg, dev, x.numel(),
                 (rt.ptr(x), rt.ptr(bias), rt.ptr(out), rt.i64(x.numel()), rt.i64(ncols)))
    return out


def sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0, weight_decay=0.0, config=None):
    params, grads, bufs, lr, momentum, weight_decay = check_sgd_args(
        params, grads, momentum_bufs, lr, momentum, weight_decay)
    if not params:
        return None
    dev, cfg = rt.setup("params[0]", params[0], SPACE, config)
    for p, g, buf in zip(params, grads, bufs):
        n = p.numel()
        if n == 0:
            continue
        g = g.contiguous()
        vec = rt.pick_vec(cfg["VEC"], 4, (p,) if buf is None else (p, buf))
        vec = rt.pick_vec(vec, g.element_size(), (g,))
        variant = _variant("sgd_kernel", dtype_name(g.dtype), cfg, vec, int(bool(momentum)))
        _launch_flat("sgd_update", variant, cfg, dev, n,
                     (rt.ptr(p), rt.ptr(g), rt.ptr(buf), rt.f32(lr), rt.f32(momentum), rt.f32(weight_decay),
                      rt.i64(n)))
    return None
