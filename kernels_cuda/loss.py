"""softmax_cross_entropy (loss.cu): mean loss and dlogits in one kernel, and its search space."""
from __future__ import annotations

import torch

from kernels_core.contract import dtype_name, label_flag, output, softmax_cross_entropy_args
from kernels_core.space import Space

from . import _runtime as rt

# One block per row; VEC elements per load.
SPACE = Space(
    params={"num_warps": (1, 2, 4, 8, 16), "VEC": (1, 2, 4, 8)},
    default={"num_warps": 4, "VEC": 4},
    threads="32 * num_warps",
    smem_bytes="num_warps * 8",
    notes="one block per row; VEC lowered to divide N and fit alignment",
)


def softmax_xent_variant(dtype: str, cfg, vec: int) -> rt.Variant:
    return rt.Variant("loss.cu", "softmax_xent_kernel", (rt.DT_CODE[dtype], vec, 32 * cfg["num_warps"]))


def report_variant(op: str, dtype: str, cfg, arch: int) -> tuple[rt.Variant, int]:
    return softmax_xent_variant(dtype, cfg, cfg["VEC"]), 0


def softmax_cross_entropy(logits, labels, *, out_grad=None, config=None):
    nrows, ncols = softmax_cross_entropy_args(logits, labels)
    dev, cfg = rt.setup("logits", logits, SPACE, config)
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
              (rt.ptr(logits), rt.ptr(labels), rt.ptr(loss), rt.ptr(grad), rt.ptr(label_flag(logits.device)),
               rt.i64(ncols), rt.f32(1.0 / nrows)), for_=rt.tag("softmax_cross_entropy", dtype, cfg))
    if grad is not out_grad:
        out_grad.copy_(grad)
    return loss, out_grad
