"""linear_cross_entropy and linear_sgd: a training step's small kernels folded into a GEMM's
epilogue, on the matmul kernels (matmul_simt.cu for exact fp32, matmul_tc.cu for fp16/bf16 and
fp32 in TF32; the
epilogues are fused.cuh's "fused paths"), with matmul's search spaces: linear_sgd's without
split-K (its epilogue updates the weights in place, which one block per tile must do alone).
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from kernels_core import contract
from kernels_core.contract import (check_block_holds_row, dtype_name, label_flag, linear_cross_entropy_args,
                                   linear_sgd_args, output)
from kernels_core.space import Space
from kernels_core.workspace import splitk_workspace

from . import _runtime as rt
from . import matmul as mm

def _mma_only(dtype: str, **fixed) -> dict:
    """matmul's tunables of `dtype` with `fixed` values, and the mma.sync kernel alone: the fused
    epilogues live in matmul_simt.cu and matmul_tc.cu, not in matmul_wgmma.cu."""
    params = {**mm.space_for(dtype).params, **fixed}
    if "WGMMA" in params:
        params["WGMMA"] = (0,)
    return params


# linear_sgd's epilogue holds more per thread than a store (w and its buffer, fused.cuh), and 3xTF32
# holds each fragment's big and small parts beside the 128 fp32 accumulators of a 64 x 64 warp tile:
# ptxas (sm_90) spilled 64-184 bytes in 8 of linear_sgd's 10 such tiles, none in matmul's or
# linear_cross_entropy's (experiments/results/cpu/ptxas_tf32_warp64x64.log).
_SGD_RULES = {"fp32": ("TF32 != 3 or BLOCK_M * BLOCK_N <= 2048 * num_warps  # 3xTF32: warp tiles of at most "
                       "64 x 32 outputs under the SGD epilogue",)}


_SPACES = {
    "linear_cross_entropy": {
        dtype: replace(mm.space_for(dtype), params=_mma_only(dtype),
                       notes=mm.space_for(dtype).notes.partition("; on sm_90")[0] + "; softmax cross-entropy in "
                       "the epilogue of the last slice, one tile per row: a call refuses BLOCK_N < N")
        for dtype in contract.DTYPES},
    "linear_sgd": {
        dtype: replace(mm.space_for(dtype), params=_mma_only(dtype, SPLIT_K=(1,)),
                       restrictions=mm.space_for(dtype).restrictions + _SGD_RULES.get(dtype, ()),
                       notes=re.split("[;:]", mm.space_for(dtype).notes)[0] + "; SGD step in the epilogue, no split-K")
        for dtype in contract.DTYPES},
}


def space_for(op: str, dtype: str) -> Space:
    return _SPACES[op][dtype]


def report_variant(op: str, dtype: str, cfg, arch: int) -> tuple[rt.Variant, int]:
    """What compile reports measure: the trainer's layouts (x and w or dy row-major, x read as
    x^T by linear_sgd), 16-byte loads, linear_cross_entropy with a bias, no gathered rows."""
    vec = mm.VEC_BYTES // contract.DTYPES[dtype].itemsize
    a_kc, has_bias, epi = (True, True, "xent") if op == "linear_cross_entropy" else (False, False, "sgd")
    if mm.on_simt(dtype, cfg):
        variant = mm.simt_variant(cfg, a_kc, False, vec, vec, has_bias, False, False, epi)
    else:
        variant = mm.tc_variant(cfg, dtype, arch, a_kc, False, vec, vec, has_bias, False, False, False, epi)
    return variant, mm.launch_cost(dtype, cfg, arch)[1]


def _setup(op: str, x: torch.Tensor, config) -> tuple[str, int, int, dict]:
    """(dtype, device index, arch, resolved config) of a call on x's GPU."""
    rt.check_cuda("x", x)
    dtype = dtype_name(x.dtype)
    dev = x.device.index
    arch, _ = rt.device_props(dev)
    mm.check_arch(dtype, arch, "x")
    return dtype, dev, arch, space_for(op, dtype).resolve(config, x.element_size(), arch)


def linear_cross_entropy(x, w, labels, *, bias=None, label_rows=None, out_grad=None, config=None):
    """(loss, dlogits) of softmax_cross_entropy(matmul(x, w, bias=bias), labels[label_rows]) in one
    launch (kernels_core/contract.py). The tile's epilogue stores the logits to dlogits, then each
    row's thread turns its row into the gradient in place (fused.cuh: xent_tile).

    Scratch memory: one kernels_core.workspace.splitk_workspace call (the layout both twins use),
    so calls on one device must be ordered, as split-K matmuls' are:
        partials: [tiles x slices fp32 BLOCK_M x BLOCK_N partial tiles, when the call splits K]
                  [row_tiles fp32 loss slots, one per row tile]
        counters: [tiles split-K arrival counters][one arrival counter of the loss]
    (tiles == row_tiles: a tile holds whole rows.) Every counter is zero between calls."""
    M, N, K = linear_cross_entropy_args(x, w, labels, bias, label_rows)
    dtype, dev, arch, cfg = _setup("linear_cross_entropy", x, config)
    check_block_holds_row(cfg, N)
    out_grad = output("out_grad", out_grad, (M, N), x.dtype, x.device, contiguous=False)
    if M == 0:  # torch's mean over no rows
        return torch.full((), float("nan"), dtype=torch.float32, device=x.device), out_grad
    ops = mm.operands(x, w, False, False)
    grid = mm.split(cfg, M, N, K)
    kernel = mm.variant(dtype, arch, grid.cfg, ops, has_bias=bias is not None, epi="xent")
    partial_elems = grid.partial_elems()
    partials, counters = splitk_workspace(x.device, partial_elems + grid.tiles, grid.tiles + 1,
                                          what="linear_cross_entropy")
    splits = grid.slices > 1  # SPLIT_K == 1 compiles no access to the partials and tile counters
    loss = torch.empty((), dtype=torch.float32, device=x.device)  # the last row tile writes it
    # The kernel writes rows of N contiguous values; a strided view gets them by one copy.
    grad = out_grad if out_grad.is_contiguous() else torch.empty((M, N), dtype=x.dtype, device=x.device)
    threads, smem = mm.launch_cost(dtype, cfg, arch)
    rt.launch(kernel, dev, (grid.tiles, grid.slices, 1), (threads, 1, 1),
              mm.kernel_args(ops, bias=None if bias is None else bias.contiguous(), C=grad, M=M, N=N, K=K,
                             partials=partials if splits else None, counters=counters if splits else None,
                             k_slice=grid.k_slice, labels=labels.contiguous(),
                             label_rows=label_rows,
                             n_labels=labels.shape[0], loss=loss, flag=label_flag(x.device, "linear_cross_entropy"),
                             loss_slots=partials[partial_elems:], loss_counter=counters[grid.tiles:]),
              smem, for_=rt.tag("linear_cross_entropy", dtype, cfg))
    if grad is not out_grad:
        out_grad.copy_(grad)
    return loss, out_grad


def linear_sgd(x, dy, w, bias, w_buf, b_buf, *, lr, momentum=0.0, weight_decay=0.0, x_rows=None, w_low=None,
               b_low=None, config=None):
    """One linear layer's SGD step in one launch (kernels_core/contract.py): the "tn" GEMM
    gw = x[x_rows]^T @ dy (M = K_in, N = N_out, K = the batch), whose epilogue applies
    sgd_update's rule to w where gw's tile lies; the blocks of tile row 0 also sum dy's columns
    and update the bias (fused.cuh: sgd_step, BiasGrad). An empty batch still launches: gw = 0,
    and weight decay and momentum still apply."""
    B, K_in, N_out, lr, momentum, weight_decay = linear_sgd_args(
        x, dy, w, bias, w_buf, b_buf, lr, momentum, weight_decay, x_rows, w_low, b_low)
    dtype, dev, arch, cfg = _setup("linear_sgd", x, config)
    if N_out == 0:
        return None
    ops = mm.operands(x, dy, True, False, x_rows)
    grid = mm.split(cfg, max(K_in, 1), N_out, B)  # K_in = 0: one tile row, for the bias
    kernel = mm.variant(dtype, arch, grid.cfg, ops, epi="sgd")
    threads, smem = mm.launch_cost(dtype, cfg, arch)
    # The buffers go only with momentum (the kernel branches on them), as sgd_update's MOMENTUM flag.
    rt.launch(kernel, dev, (grid.tiles, 1, 1), (threads, 1, 1),
              mm.kernel_args(ops, M=K_in, N=N_out, K=B, w=w, w_buf=w_buf if momentum else None, w_low=w_low,
                             b=bias, b_buf=b_buf if momentum else None, b_low=b_low, lr=lr, momentum=momentum,
                             weight_decay=weight_decay),
              smem, for_=rt.tag("linear_sgd", dtype, cfg))
    return None
