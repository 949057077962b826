"""softmax_cross_entropy: mean loss and dlogits in one kernel, one row per program.

For a row z with label y, loss = logsumexp(z) - z[y] and
dlogits = (softmax(z) - onehot(y)) / M. The program makes two sweeps over its
row in BLOCK_N-wide chunks:

1. an online logsumexp (as in Flash Attention): keep the running max m and
   the sum s of exp(z - m), rescaling s whenever a chunk raises m. Nothing is
   ever exponentiated above 0, so logits of 1e4 stay finite;
2. dlogits = (exp(z - lse) - onehot) / M, written in the logits' dtype.

The second sweep re-reads the row, which the first one has just pulled into
cache, so a row costs one trip to DRAM each way. All arithmetic is fp32.

The mean loss needs every row: each program adds row_loss / M into a zeroed
0-dim output with an atomic, so no second kernel and no host sync is needed
(the order of the adds, and so the last bits, may vary). A label outside
[0, C) is not checked on the host (that would sync): its row's loss is NaN,
its gradient the plain softmax / M, and the program writes the label to the
contract's label flag, which `check_labels` reads at the caller's next sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_core import contract
from kernels_core.space import Space

from . import _runtime as rt


@triton.jit
def _softmax_ce_kernel(
    z_ptr, labels_ptr, grad_ptr, loss_ptr, flag_ptr,
    C, stride_zm, stride_zc, stride_gm, stride_gc, stride_label, inv_m,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_zm
    g_row = grad_ptr + row * stride_gm
    label = tl.load(labels_ptr + row * stride_label)
    cols = tl.arange(0, BLOCK_N)

    z = tl.load(z_row + cols * stride_zc, mask=cols < C, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    # A row of -inf so far would give exp(-inf - -inf) = NaN; shift by 0 instead.
    shift = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(z - shift), axis=0)
    for c0 in range(BLOCK_N, C, BLOCK_N):
        z = tl.load(z_row + (c0 + cols) * stride_zc, mask=c0 + cols < C, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        new_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(shift - new_shift) + tl.sum(tl.exp(z - new_shift), axis=0)
        m = m_new
        shift = new_shift
    lse = shift + tl.log(s)

    in_range = (label >= 0) & (label < C)
    target = tl.load(z_row + label * stride_zc, mask=in_range, other=float("nan")).to(tl.float32)
    tl.atomic_add(loss_ptr, (lse - target) * inv_m)
    out_of_range = (label < 0) | (label >= C)
    tl.store(flag_ptr, 1, mask=out_of_range)
    tl.store(flag_ptr + 1, label, mask=out_of_range)
    tl.store(flag_ptr + 2, C, mask=out_of_range)

    for c0 in range(0, C, BLOCK_N):
        c = c0 + cols
        z = tl.load(z_row + c * stride_zc, mask=c < C, other=0.0).to(tl.float32)
        g = (tl.exp(z - lse) - tl.where(c == label, 1.0, 0.0)) * inv_m
        tl.store(g_row + c * stride_gc, g.to(grad_ptr.dtype.element_ty), mask=c < C)


SPACES = {
    name: Space(
        params={"BLOCK_N": (256, 512, 1024, 2048, 4096, 8192), "num_warps": (1, 2, 4, 8, 16)},
        default={"BLOCK_N": 1024, "num_warps": 4},
        restrictions=("BLOCK_N >= 32 * num_warps",),
        notes="BLOCK_N caps the chunk: rows with C < BLOCK_N use the next power of two >= C",
    )
    for name in contract.DTYPES
}


def plan_softmax_cross_entropy(logits, labels, *, out_grad=None, config=None):
    M, C = contract.softmax_cross_entropy_args(logits, labels)
    rt.check_device("logits", logits)
    out_grad = contract.output("out_grad", out_grad, (M, C), logits.dtype, logits.device, contiguous=False)
    dtype = contract.dtype_name(logits.dtype)
    cfg = rt.resolve(SPACES[dtype], config, logits.element_size(), logits.device)
    if M == 0:  # the mean of no rows, as torch defines it
        return torch.full((), float("nan"), dtype=torch.float32, device=logits.device), out_grad, None
    loss = torch.zeros((), dtype=torch.float32, device=logits.device)
    args = dict(
        z_ptr=logits, labels_ptr=labels, grad_ptr=out_grad, loss_ptr=loss,
        flag_ptr=contract.label_flag(logits.device),
        C=C, stride_zm=logits.stride(0), stride_zc=logits.stride(1),
        stride_gm=out_grad.stride(0), stride_gc=out_grad.stride(1), stride_label=labels.stride(0),
        inv_m=1.0 / M,
        BLOCK_N=min(cfg["BLOCK_N"], max(16, triton.next_power_of_2(C))),
    )
    return loss, out_grad, rt.Plan("softmax_cross_entropy", dtype, cfg, _softmax_ce_kernel, (M,), args,
                                   cfg["num_warps"])


def softmax_cross_entropy(logits, labels, *, out_grad=None, config=None):
    loss, grad, p = plan_softmax_cross_entropy(logits, labels, out_grad=out_grad, config=config)
    if p is not None:
        rt.launch(p)
    return loss, grad
