"""The fused training step's two ops: a GEMM whose epilogue finishes the job.

A small MLP's step ends in two chains of short kernels around its GEMMs.
The loss: logits = x @ w + b is stored, then softmax_cross_entropy reads it
back and writes dlogits. The update: gw = x^T @ dy is stored, bias_grad sums
dy's columns into gb, and sgd_update reads gw and gb back to update w and b,
for each layer. Both chains are elementwise in the GEMM's output, so here they
run in its epilogue, on the fp32 tile still in registers: the logits and the
weight gradients never reach memory, and each chain is one launch instead of
two or three (plus, in the trainer, a gather of the batch's rows: both ops take
row indices, as matmul's a_rows does, so x may be the whole dataset).

linear_cross_entropy(x, w, labels) is matmul.py's kernel with EPILOGUE =
CROSS_ENTROPY. A program owns BLOCK_M whole rows of logits (the config must
have BLOCK_N >= N: one tile per row of tiles). It adds the bias, rounds the
logits to x's dtype as matmul would store them, masks the columns past N to
-inf, and writes dlogits = (softmax - onehot) / M in x's dtype; a label
outside [0, N) makes its row's loss NaN, leaves its dlogits row softmax / M
and raises the contract's label flag, as softmax_cross_entropy does. The
mean loss needs every row, and float atomics would make its last bits depend
on arrival order, so it takes the split-K protocol of matmul.py (whose
docstring explains the memory ordering): each row tile stores the sum of its
rows' losses in its slot, then bumps an arrival counter (release); the tile
that arrives last (acquire) sums the slots in slot order 0, 1, ..., writes
loss = sum / M and puts the counter back to 0. The same bits on every run.
With SPLIT_K > 1 a tile's slices first meet as in a split-K matmul, and the
last slice to arrive runs the epilogue and then the row-tile protocol.

The scratch of both protocols is one `splitk_workspace(device,
partial_elems + row_tiles, tiles + 1)` (the CUDA twin lays it out the same):

    fp32 partials: [split-K partials of every tile (none when SPLIT_K = 1)]
                   [row_tiles loss slots]
    int32 counters: [one per tile (split-K arrivals)][one loss counter]

so a call allocates nothing but its loss and, unless given, dlogits; and a
captured CUDA graph keeps pointing at live scratch. Every config uses this
scratch (SPLIT_K = 1 too), which split-K matmuls share: calls on one device
must be ordered, as split-K calls must (one stream, as a training step runs).
M == 0: the loss is NaN (torch's mean of nothing) and nothing is launched.

linear_sgd(x, dy, w, bias, ...) is the kernel with EPILOGUE = SGD, on the
"tn" product gw = x[x_rows]^T @ dy (M = K_in, N = N_out, K = the batch;
x_rows gathers along K). Each program applies sgd_update's rule (optim.py's
`sgd_rule`, the one definition) to its tile of w, and of w_buf and w_low,
from the fp32 tile in registers; the programs of tile-row 0 also sum dy's
columns for their BLOCK_N columns, in BLOCK_K-row chunks in a fixed order
(the same bits on every run), and update bias, b_buf and b_low the same way.
Every element of w and bias has one owner, so SPLIT_K is fixed to 1 (a split
would need gw whole before the update: the partials' round trip this op
exists to avoid). A batch of 0 still launches, the K loop empty, so weight
decay and momentum still apply; K_in == 0 leaves no tile of w to launch, and
the bias's step then takes the unfused kernels.

Both spaces are matmul's tunables and rules (linear_sgd's with SPLIT_K = 1),
with defaults of their own: see SPACES.
"""
from __future__ import annotations

import dataclasses

import torch

from kernels_core import contract

from . import _runtime as rt
from .matmul import CROSS_ENTROPY, SGD, gather_args, kernel_plan
from .matmul import SPACES as _MATMUL_SPACES
from .optim import sgd_update
from .reduction import bias_grad


# matmul's tunables and rules, with defaults of their own: the epilogues hold more of a tile in
# registers than a store does (logits, their exponentials and dlogits; w, its buffer and the
# gradient), and matmul's 16-bit default of 128x256 on 8 warps spills there (compile_report: 0.4
# to 2 KB on sm_80 and sm_90). These compile without spills for sm_80 and sm_90. The loss's
# default holds rows of up to 128 classes; a wider N needs a config with BLOCK_N >= N.
_CE_DEFAULTS = {
    "fp16": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
    "bf16": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
    "fp32": dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=1, TF32=0,
                 SPLIT_AHEAD=0),
}
_SGD_DEFAULTS = {
    "fp16": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
    "bf16": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
    "fp32": dict(_MATMUL_SPACES["fp32"].default),
}

def _no_split_ahead(params: dict) -> dict:
    """matmul's tunables with the operands split in the kernel only: the epilogues' operands are
    the weights the step updates (linear_sgd) and a batch read by index (both)."""
    return {**params, "SPLIT_AHEAD": (0,)} if "SPLIT_AHEAD" in params else params


SPACES = {
    # The loss's GEMM is a matmul, split-K included. A config whose BLOCK_N is below the call's
    # N is refused at the call (contract.check_block_holds_row).
    "linear_cross_entropy": {dtype: dataclasses.replace(sp, params=_no_split_ahead(sp.params),
                                                        default=_CE_DEFAULTS[dtype])
                             for dtype, sp in _MATMUL_SPACES.items()},
    # One program owns each element of w and bias: no split.
    "linear_sgd": {dtype: dataclasses.replace(sp, params=_no_split_ahead({**sp.params, "SPLIT_K": (1,)}),
                                              default=_SGD_DEFAULTS[dtype])
                   for dtype, sp in _MATMUL_SPACES.items()},
}


def plan_linear_cross_entropy(x, w, labels, *, bias=None, label_rows=None, out_grad=None, config=None):
    M, N, K = contract.linear_cross_entropy_args(x, w, labels, bias, label_rows)
    rt.check_device("x", x)
    out_grad = contract.output("out_grad", out_grad, (M, N), x.dtype, x.device, contiguous=False)
    dtype = contract.dtype_name(x.dtype)
    cfg = rt.resolve(SPACES["linear_cross_entropy"][dtype], config, x.element_size(), x.device)
    contract.check_block_holds_row(cfg, N)
    if M == 0:  # the mean of no rows, as torch defines it
        return torch.full((), float("nan"), dtype=torch.float32, device=x.device), out_grad, None
    loss = torch.empty((), dtype=torch.float32, device=x.device)  # written by the last row tile
    p = kernel_plan(
        "linear_cross_entropy", dtype, cfg, x, w, out_grad, M, N, K, bias=bias, epilogue=CROSS_ENTROPY,
        labels_ptr=labels, label_rows_ptr=label_rows if label_rows is not None else labels,
        flag_ptr=contract.label_flag(x.device, "linear_cross_entropy"), loss_ptr=loss, LABELS=labels.shape[0],
        stride_label=labels.stride(0), inv_m=1.0 / M, rows_f=float(M), LABEL_ROWS=label_rows is not None,
    )
    return loss, out_grad, p


def linear_cross_entropy(x, w, labels, *, bias=None, label_rows=None, out_grad=None, config=None):
    loss, grad, p = plan_linear_cross_entropy(x, w, labels, bias=bias, label_rows=label_rows, out_grad=out_grad,
                                              config=config)
    if p is not None:
        rt.launch(p)
    return loss, grad


def plan_linear_sgd(x, dy, w, bias, w_buf, b_buf, *, lr, momentum=0.0, weight_decay=0.0, x_rows=None,
                    w_low=None, b_low=None, config=None):
    """The fused launch, or None when w has no element (K_in or N_out is 0; see linear_sgd)."""
    B, K_in, N_out, lr, momentum, weight_decay = contract.linear_sgd_args(
        x, dy, w, bias, w_buf, b_buf, lr, momentum, weight_decay, x_rows, w_low, b_low)
    rt.check_device("x", x)
    dtype = contract.dtype_name(x.dtype)
    cfg = rt.resolve(SPACES["linear_sgd"][dtype], config, x.element_size(), x.device)
    if K_in == 0 or N_out == 0:
        return None
    return kernel_plan(
        "linear_sgd", dtype, cfg, x, dy, w, K_in, N_out, B, trans_a=True, epilogue=SGD,
        **gather_args(x, x_rows, True),
        bias_ptr=bias, buf_ptr=w_buf if w_buf is not None else w, bias_buf_ptr=b_buf if b_buf is not None else bias,
        low_ptr=w_low if w_low is not None else w, bias_low_ptr=b_low if b_low is not None else bias,
        lr=lr, momentum=momentum, weight_decay=weight_decay, HAS_MOMENTUM=bool(momentum),
        HAS_WEIGHT_DECAY=bool(weight_decay), W_LOW=w_low is not None, B_LOW=b_low is not None,
    )


def linear_sgd(x, dy, w, bias, w_buf, b_buf, *, lr, momentum=0.0, weight_decay=0.0, x_rows=None,
               w_low=None, b_low=None, config=None):
    p = plan_linear_sgd(x, dy, w, bias, w_buf, b_buf, lr=lr, momentum=momentum, weight_decay=weight_decay,
                        x_rows=x_rows, w_low=w_low, b_low=b_low, config=config)
    if p is not None:
        rt.launch(p)
    elif bias.numel():
        # No input features (K_in == 0): no tile of w to hang the bias's step on, so it takes the
        # unfused kernels; a layer with no inputs is no hot path.
        sgd_update([bias], [bias_grad(dy)], [b_buf] if momentum else None, lr=lr, momentum=momentum,
                   weight_decay=weight_decay)
        if b_low is not None:
            b_low.copy_(bias)
