"""relu, relu_backward, bias_add and sgd_update (elementwise.cu) and their
shared search space."""
from __future__ import annotations

import numbers

import torch

from . import _runtime as rt
from .contract import DTYPES, Space, check_activation, check_tensor, check_same_dtype, dtype_name

_DT_CODE = {"fp32": 0, "fp16": 1, "bf16": 2}
_FLOATS = tuple(DTYPES.values())

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


def _launch_flat(variant: rt.Variant, cfg, dev: int, n: int, args) -> None:
    threads = 32 * cfg["num_warps"]
    vec = variant.targs[1]
    blocks = max(1, rt.cdiv(n // vec, threads * cfg["ITEMS"]))
    rt.launch(variant, dev, (blocks, 1, 1), (threads, 1, 1), args)


def _output(name: str, out, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensor(name, out, dtypes=(like.dtype,), device=like.device)
    if tuple(out.shape) != tuple(like.shape) or not out.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of shape {tuple(like.shape)}, "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")
    return out


def _setup(name: str, x, config):
    check_tensor(name, x, dtypes=_FLOATS)
    rt.check_cuda(name, x)
    dev = x.device.index
    arch, _ = rt.device_props(dev)
    cfg = rt.resolve(SPACE, config, x.element_size(), arch)
    return dev, cfg


def relu(x, *, out=None, config=None):
    dev, cfg = _setup("x", x, config)
    out = _output("out", out, x)
    if x.numel() == 0:
        return out
    x = x.contiguous()
    dtype = dtype_name(x.dtype)
    vec = rt.pick_vec(cfg["VEC"], x.element_size(), (x, out))
    _launch_flat(_variant("relu_kernel", dtype, cfg, vec), cfg, dev, x.numel(),
                 (rt.ptr(x), rt.ptr(out), rt.i64(x.numel())))
    return out


def relu_backward(grad, y, *, out=None, config=None):
    dev, cfg = _setup("grad", grad, config)
    check_tensor("y", y, dtypes=_FLOATS, device=grad.device)
    check_same_dtype(grad=grad, y=y)
    if tuple(y.shape) != tuple(grad.shape):
        raise ValueError(f"y: shape {tuple(y.shape)} differs from grad's {tuple(grad.shape)}")
    out = _output("out", out, grad)
    if grad.numel() == 0:
        return out
    grad, y = grad.contiguous(), y.contiguous()
    vec = rt.pick_vec(cfg["VEC"], grad.element_size(), (grad, y, out))
    _launch_flat(_variant("relu_backward_kernel", dtype_name(grad.dtype), cfg, vec), cfg, dev, grad.numel(),
                 (rt.ptr(grad), rt.ptr(y), rt.ptr(out), rt.i64(grad.numel())))
    return out


def bias_add(x, bias, *, activation=None, out=None, config=None):
    check_tensor("x", x, ndim=2, dtypes=_FLOATS)
    dev, cfg = _setup("x", x, config)
    check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_activation(activation)
    ncols = x.shape[1]
    if bias.shape[0] != ncols:
        raise ValueError(f"bias: expected shape ({ncols},) for x of shape {tuple(x.shape)}, got {tuple(bias.shape)}")
    out = _output("out", out, x)
    if x.numel() == 0:
        return out
    x, bias = x.contiguous(), bias.contiguous()
    vec = rt.pick_vec(cfg["VEC"], x.element_size(), (x, bias, out), (ncols,))
    variant = _variant("bias_add_kernel", dtype_name(x.dtype), cfg, vec, int(activation == "relu"))
    _launch_flat(variant, cfg, dev, x.numel(),
                 (rt.ptr(x), rt.ptr(bias), rt.ptr(out), rt.i64(x.numel()), rt.i64(ncols)))
    return out


def _number(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__}")
    return float(v)


def sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0, weight_decay=0.0, config=None):
    lr = _number("lr", lr)
    momentum = _number("momentum", momentum)
    weight_decay = _number("weight_decay", weight_decay)
    params, grads = list(params), list(grads)
    if len(grads) != len(params):
        raise ValueError(f"grads: {len(grads)} tensors for {len(params)} params")
    if momentum:
        momentum_bufs = None if momentum_bufs is None else list(momentum_bufs)
        if momentum_bufs is None or len(momentum_bufs) != len(params):
            raise ValueError("momentum_bufs: one float32 buffer per param is needed when momentum != 0")
    if not params:
        return None
    dev, cfg = None, None
    for i, (p, g) in enumerate(zip(params, grads)):
        check_tensor(f"params[{i}]", p, dtypes=(torch.float32,))
        rt.check_cuda(f"params[{i}]", p)
        if dev is None:
            dev = p.device.index
            arch, _ = rt.device_props(dev)
            cfg = rt.resolve(SPACE, config, 4, arch)
        check_tensor(f"params[{i}]", p, device=params[0].device)
        if not p.is_contiguous():
            raise ValueError(f"params[{i}]: must be contiguous to be updated in place")
        check_tensor(f"grads[{i}]", g, dtypes=_FLOATS, device=p.device)
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"grads[{i}]: shape {tuple(g.shape)} differs from params[{i}]'s {tuple(p.shape)}")
        if momentum:
            b = momentum_bufs[i]
            check_tensor(f"momentum_bufs[{i}]", b, dtypes=(torch.float32,), device=p.device)
            if tuple(b.shape) != tuple(p.shape) or not b.is_contiguous():
                raise ValueError(f"momentum_bufs[{i}]: expected a contiguous tensor of shape {tuple(p.shape)}")
    for i, (p, g) in enumerate(zip(params, grads)):
        n = p.numel()
        if n == 0:
            continue
        g = g.contiguous()
        buf = momentum_bufs[i] if momentum else None
        vec = rt.pick_vec(cfg["VEC"], 4, (p,) if buf is None else (p, buf))
        vec = rt.pick_vec(vec, g.element_size(), (g,))
        variant = _variant("sgd_kernel", dtype_name(g.dtype), cfg, vec, int(bool(momentum)))
        _launch_flat(variant, cfg, dev, n,
                     (rt.ptr(p), rt.ptr(g), rt.ptr(buf), rt.f32(lr), rt.f32(momentum), rt.f32(weight_decay),
                      rt.i64(n)))
    return None
