"""relu, relu_backward and bias_add (elementwise.cu) and their shared search
space, which sgd_update (optim.py) shares too: the same flat work split."""
from __future__ import annotations

from kernels_core.contract import FLOATS, bias_add_args, cdiv, check_tensor, dtype_name, output_like, relu_backward_args
from kernels_core.space import Space

from . import _runtime as rt

_DT_NAME = {code: name for name, code in rt.DT_CODE.items()}

# threads = 32 * num_warps; each thread moves ITEMS vectors of VEC elements
# (VEC is lowered by the host for misaligned pointers or, for bias_add, a
# row length it does not divide). Default VEC=4: on the H200, fp32 relu at
# 256M elements ran at 96% of copy bandwidth with VEC=4 and 77% with VEC=8
# (two 16-byte loads per vector; experiments/results/h200/kernels.csv).
SPACE = Space(
    params={"num_warps": (1, 2, 4, 8, 16), "VEC": (1, 2, 4, 8), "ITEMS": (1, 2, 4, 8)},
    default={"num_warps": 4, "VEC": 4, "ITEMS": 4},
    threads="32 * num_warps",
    smem_bytes="0",
    notes="one block covers 32 * num_warps * ITEMS * VEC elements",
)


def flat_variant(source: str, kernel: str, dtype: str, cfg, vec: int, *extra) -> rt.Variant:
    """A kernel of the flat work split (flat.cuh): <dtype, VEC, ITEMS, THREADS, extra...>."""
    return rt.Variant(source, kernel, (rt.DT_CODE[dtype], vec, cfg["ITEMS"], 32 * cfg["num_warps"], *extra))


def _variant(kernel: str, dtype: str, cfg, vec: int, *extra) -> rt.Variant:
    return flat_variant("elementwise.cu", kernel, dtype, cfg, vec, *extra)


def report_variant(op: str, dtype: str, cfg, arch: int) -> tuple[rt.Variant, int]:
    """The variant compile reports measure for `op`, and its dynamic shared memory."""
    kernel, extra = {"relu": ("relu_kernel", ()), "relu_backward": ("relu_backward_kernel", ()),
                     "bias_add": ("bias_add_kernel", (1,))}[op]
    return _variant(kernel, dtype, cfg, cfg["VEC"], *extra), 0


def launch_flat(op: str, variant: rt.Variant, cfg, dev: int, n: int, args) -> None:
    threads = 32 * cfg["num_warps"]
    dtype, vec = _DT_NAME[variant.targs[0]], variant.targs[1]
    blocks = max(1, cdiv(n // vec, threads * cfg["ITEMS"]))
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
    launch_flat("relu", _variant("relu_kernel", dtype, cfg, vec), cfg, dev, x.numel(),
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
    launch_flat("relu_backward", _variant("relu_backward_kernel", dtype_name(grad.dtype), cfg, vec), cfg, dev,
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
    launch_flat("bias_add", variant, cfg, dev, x.numel(),
                 (rt.ptr(x), rt.ptr(bias), rt.ptr(out), rt.i64(x.numel()), rt.i64(ncols)))
    return out
