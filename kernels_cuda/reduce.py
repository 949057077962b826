"""bias_grad and softmax_cross_entropy (reduce.cu) and their search spaces."""
from __future__ import annotations

import torch

from . import _runtime as rt
from .contract import FLOATS, Space, check_tensor, dtype_name, output, softmax_cross_entropy_args

_DT_CODE = {"fp32": 0, "fp16": 1, "bf16": 2}

# A block sums 32 * VEC columns over num_warps * ITEMS rows and adds its
# column totals to the output with atomics.
BIAS_GRAD_SPACE = Space(
    params={"num_warps": (1, 2, 4, 8), "VEC": (1, 2, 4, 8), "ITEMS": (1, 2, 4, 8, 16)},
    default={"num_warps": 8, "VEC": 4, "ITEMS": 8},
    threads="32 * num_warps",
    smem_bytes="num_warps * 32 * VEC * 4",
    notes="block = 32*VEC columns x num_warps*ITEMS rows; VEC lowered to divide N and fit alignment",
)

# One block per row; VEC elements per load.
SOFTMAX_XENT_SPACE = Space(
    params={"num_warps": (1, 2, 4, 8, 16), "VEC": (1, 2, 4, 8)},
    default={"num_warps": 4, "VEC": 4},
    threads="32 * num_warps",
    smem_bytes="num_warps * 8",
    notes="one block per row; VEC lowered to divide N and fit alignment",
)


def bias_grad_variant(dtype: str, cfg, vec: int) -> rt.Variant:
    return rt.Variant("reduce.cu", "bias_grad_kernel", (_DT_CODE[dtype], vec, cfg["ITEMS"], 32 * cfg["num_warps"]))


def softmax_xent_variant(dtype: str, cfg, vec: int) -> rt.Variant:
    return rt.Variant("reduce.cu", "softmax_xent_kernel", (_DT_CODE[dtype], vec, 32 * cfg["num_warps"]))


def main_variant(op: str, dtype: str, cfg) -> tuple[rt.Variant, int]:
    if op == "bias_grad":
        return bias_grad_variant(dtype, cfg, cfg["VEC"]), 0
    return softmax_xent_variant(dtype, cfg, cfg["VEC"]), 0


def bias_grad(grad, *, out=None, config=None):
    check_tensor("grad", grad, ndim=2, dtypes=FLOATS)
    dev, cfg = rt.setup("grad", grad, BIAS_GRAD_SPACE, config)
    nrows, ncols = grad.shape
    out = output("out", out, (ncols,), torch.float32, grad.device)
    out.zero_()  # the kernel adds its column sums with atomics
    if grad.numel() == 0:
        return out
    grad = grad.contiguous()
    vec = rt.pick_vec(cfg["VEC"], grad.element_size(), (grad,), (ncols,))
    threads = 32 * cfg["num_warps"]
    grid = (rt.cdiv(nrows, cfg["num_warps"] * cfg["ITEMS"]), rt.cdiv(ncols, 32 * vec), 1)
    if grid[1] > 65535:
        raise ValueError(f"grad: {ncols} columns need {grid[1]} column blocks, more than the 65535 grid.y allows")
    dtype = dtype_name(grad.dtype)
    rt.launch(bias_grad_variant(dtype, cfg, vec), dev, grid, (threads, 1, 1),
              (rt.ptr(grad), rt.ptr(out), rt.i64(nrows), rt.i64(ncols)), for_=rt.tag("bias_grad", dtype, cfg))
    return out


def softmax_cross_entropy(logits, labels, *, out_grad=None, config=None):
    nrows, ncols = softmax_cross_entropy_args(logits, labels)
    dev, cfg = rt.setup("logits", logits, SOFTMAX_XENT_SPACE, config)
    out_grad = output("out_grad", out_grad, (nrows, ncols), logits.dtype, logits.device, contiguous=False)
    if nrows == 0:  # torch's mean over no rows
        return torch.full((), float("nan"), dtype=torch.float32, device=logits.device), out_grad
    loss = torch.zeros((), dtype=torch.float32, device=logits.device)
    logits, labels = logits.contiguous(), labels.contiguous()
    # The kernel writes rows of ncols contiguous values; a strided view gets them by one copy.
    grad = out_grad if out_grad.is_contiguous() else torch.empty_like(out_grad, memory_format=torch.contiguous_format)
    vec = rt.pick_vec(cfg["VEC"], logits.element_size(), (logits, grad), (ncols,))
    dtype = dtype_name(logits.dtype)
    rt.launch(softmax_xent_variant(dtype, cfg, vec), dev, (nrows, 1, 1),
              (32 * cfg["num_warps"], 1, 1),
              (rt.ptr(logits), rt.ptr(labels), rt.ptr(loss), rt.ptr(grad), rt.i64(ncols),
               rt.f32(1.0 / nrows)), for_=rt.tag("softmax_cross_entropy", dtype, cfg))
    if grad is not out_grad:
        out_grad.copy_(grad)
    return loss, out_grad
