"""bias_grad (reduction.cu): column sums of a gradient, and its search space."""
from __future__ import annotations

import torch

from kernels_core.contract import FLOATS, cdiv, check_tensor, dtype_name, output
from kernels_core.space import Space

from . import _runtime as rt

# A block sums 32 * VEC columns over num_warps * ITEMS rows and adds its
# column totals to the output with atomics.
SPACE = Space(
    params={"num_warps": (1, 2, 4, 8), "VEC": (1, 2, 4, 8), "ITEMS": (1, 2, 4, 8, 16)},
    default={"num_warps": 8, "VEC": 4, "ITEMS": 8},
    threads="32 * num_warps",
    smem_bytes="num_warps * 32 * VEC * 4",
    notes="block = 32*VEC columns x num_warps*ITEMS rows; VEC lowered to divide N and fit alignment",
)


def bias_grad_variant(dtype: str, cfg, vec: int) -> rt.Variant:
    return rt.Variant("reduction.cu", "bias_grad_kernel", (rt.DT_CODE[dtype], vec, cfg["ITEMS"], 32 * cfg["num_warps"]))


def report_variant(op: str, dtype: str, cfg, arch: int) -> tuple[rt.Variant, int]:
    return bias_grad_variant(dtype, cfg, cfg["VEC"]), 0


def bias_grad(grad, *, out=None, config=None):
    check_tensor("grad", grad, ndim=2, dtypes=FLOATS)
    dev, cfg = rt.setup("grad", grad, SPACE, config)
    nrows, ncols = grad.shape
    out = output("out", out, (ncols,), torch.float32, grad.device)
    out.zero_()  # the kernel adds its column sums with atomics
    if grad.numel() == 0:
        return out
    grad = grad.contiguous()
    vec = rt.pick_vec(cfg["VEC"], grad.element_size(), (grad,), (ncols,))
    threads = 32 * cfg["num_warps"]
    grid = (cdiv(nrows, cfg["num_warps"] * cfg["ITEMS"]), cdiv(ncols, 32 * vec), 1)
    dtype = dtype_name(grad.dtype)
    rt.launch(bias_grad_variant(dtype, cfg, vec), dev, grid, (threads, 1, 1),
              (rt.ptr(grad), rt.ptr(out), rt.i64(nrows), rt.i64(ncols)), for_=rt.tag("bias_grad", dtype, cfg))
    return out
