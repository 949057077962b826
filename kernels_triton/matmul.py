"""Matrix multiplication with a fused bias + ReLU epilogue, and the fused step's GEMMs.

Each program computes one BLOCK_M x BLOCK_N tile of C = op(A) @ op(B) by
walking K in BLOCK_K steps, accumulating in fp32 (or fp16 on request) with
`tl.dot`, which Triton lowers to tensor-core instructions (wgmma on Hopper,
mma elsewhere) and software-pipelines over `num_stages` shared-memory buffers.

Program order matters as much as the tile. Launching tiles row by row streams
all of B through the L2 cache for every row of tiles; instead programs are
grouped: GROUP_M consecutive tile-rows are visited column by column, so a
group reuses the same panel of B while it is still cached (the "swizzled" or
"grouped" order of Triton's matmul tutorial).

Transposes cost nothing: op(A) is read through its two strides, whichever is
the unit one, and Triton specializes a stride of 1 as a constant so the loads
vectorize. Ragged edges: rows and columns past M and N wrap around (modulo)
instead of being masked, which keeps the inner loop's loads unmasked along M
and N; only the K tail is masked, and the final store drops the wrapped rows.

Gathers and the ReLU-gradient mask, for the fused training step. With a_rows
(GATHER_A) op(A) is read as a[a_rows], rows of the stored tensor, so a batch
drawn by index from the whole dataset costs no gather kernel: along M (no
transpose) a tile loads its BLOCK_M indices once and offsets its row pointers
by them; along K (trans_a, linear_sgd's x_rows) every K step loads its
BLOCK_K indices. An index outside a is masked: a row of zeros, never a read
out of bounds (those loads, and only they, carry a mask along M). With
relu_grad_of (RELU_GRAD) the epilogue reads y and stores 0 where y <= 0: the
gradient through a ReLU without a relu_backward kernel. The EPILOGUE constexpr
picks what happens to the finished fp32 tile: stored as C (PLAIN), or the
softmax cross-entropy or SGD step of fused.py (CROSS_ENTROPY, SGD; their
docstring). Every flag left off compiles nothing: plain matmul is the kernel
it was, its extra parameters placeholders it never reads.

Split-K, for outputs of few tiles. The trainer's products are short and deep
(128x1024 or 32x10 outputs over K = 784..8192): one program per tile leaves
most of a 132-SM GPU idle whatever the tile. With SPLIT_K > 1 the grid gets a
second axis: program (tile, s) computes tile's product over the s-th slice
of K, K_SLICE = ceil(K / (SPLIT_K * BLOCK_K)) * BLOCK_K long (the last slice
may be short; slices left empty are not launched, so the kernel's SPLIT_K is
the number that hold any K: kernels_core.workspace.splitk_slices). Its fp32 partial tile
goes to the shared split-K workspace (kernels_core.workspace), laid out tile
by tile: tile t's SPLIT_K partials are consecutive BLOCK_M x BLOCK_N row-major
blocks from t * SPLIT_K * BLOCK_M * BLOCK_N on, so each store and read is one
contiguous block. Then the program bumps its tile's arrival counter; the one
that arrives last (it reads SPLIT_K - 1 back) sums the SPLIT_K partials in
slice order 0, 1, ..., applies bias and ReLU once, stores C, and puts the
counter back to 0 for the next call. One launch, no host synchronization, and
the same bits on every run: who arrives last changes nothing in the sum.

Why the last program sees every partial on a GPU (the interpreter runs
programs one after another, so it cannot show this): a program's threads
store their part of the partial, a barrier orders those stores before the
one thread that then does the counter's atomic add, with release semantics
at GPU scope (cumulative, so it publishes what the whole CTA stored). The
last arriver's atomic has acquire semantics; Triton hands its result to the
other threads through shared memory behind a barrier, so their reads come
after the acquire, and they read the partials with ".cg" loads, from L2,
never from a line of this SM's L1 that an earlier call left behind. SPLIT_K
= 1 compiles none of this: it is the one-program-per-tile kernel above.
With fp16 accumulation each slice accumulates in fp16 as asked, and the
partials are summed in fp32: never less accurate than no split.

fp32 on the tensor cores (the TF32 tunable). TF32 = 0 multiplies fp32 exactly,
on the FMA units (tl.dot's "ieee"). TF32 tensor cores multiply operands of 10
mantissa bits, several times as fast: TF32 = 1 rounds each operand to TF32 and
takes one product, about 2^-11 relative error per product, a lower precision
the tuner tries only when asked. TF32 = 3 (3xTF32) splits each operand as it is
loaded into a TF32 big part and the TF32-rounded rest, x = big + small with
|small| <= 2^-11 |x|, and sums three TF32 products, small*big + big*small +
big*big, smallest first: what it drops (small*small, and small's own rounding)
is at most 3 * 2^-22 |a||b| per product, so the error is dominated by the fp32
accumulation, as with TF32 = 0. For that to hold, each k block's three products
are summed from zero and added to the fp32 accumulator by an fp32 add, which
rounds to nearest, as Triton's own "tf32x3" does: the tensor cores add into
their accumulator rounding toward zero, a bias that grows with K, and summed in
the accumulator over all of K it, not the split, set the error (2.9e-5 of the
result's norm at 4096^3 on the H200, against 1.15e-6 on the FMA units;
experiments/FINDINGS.md, "fp32 on TF32 tensor cores"). Infinities and
NaNs come out as IEEE's: a non-finite x splits into big = +-1 and small = x,
so a * b's three products are small_a*big_b (the infinity, or NaN where b is
0, as inf * 0 is) and finite ones, where big = x with small = 0 would make
inf * 0 = NaN of an infinity that meets a b whose small part is 0, and of
inf * inf; a finite x that rounds to infinity is rounded down instead. The
one difference left: a b too small for TF32's grid (under 2^-136, big and
small both 0) times an infinity gives NaN, not an infinity. The split is
written out here (_to_tf32), not left to tl.dot's input_precision="tf32x3",
so that Triton's interpreter, which multiplies in fp32 whatever the precision,
computes the same parts and products as the GPU: the tests check the bound on
the CPU. The GPU's TF32 products of exact TF32 parts are exact; only the
tensor cores' sum within a k block differs from the interpreter's.

SPLIT_AHEAD = 1 (fp32, with TF32 = 3 or 1): the operands are split once, before
the GEMM, rather than in every tile that loads them: a pass (_split_kernel, one
launch per operand) writes op(A)'s parts and op(B)^T's, k-contiguous, into a
workspace, and the GEMM reads them as an nt product, the small parts a fixed
offset from the big ones. On Hopper wgmma's tf32 form reads both operands
k-major from shared memory; a row-major B reaches it 4 bytes a copy, to be laid
out so, and a k-major one 16 bytes a copy: at 4096^3 on the H200 Triton's TF32
dot ran 3.5x faster so, and 3xTF32 on split parts 2.7x faster
(experiments/FINDINGS.md, "fp32 on TF32 tensor cores"). The parts are the split
above, bit for bit, so the products are the same as SPLIT_AHEAD = 0's; the
ring holds four operand tiles a stage in 3xTF32. No gathered rows (a_rows);
the fused ops keep SPLIT_AHEAD = 0.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels_core import contract
from kernels_core.contract import cdiv
from kernels_core.space import Space
from kernels_core.workspace import splitk_slices, splitk_workspace

from . import _runtime as rt
from .optim import sgd_rule


@triton.jit
def _finite(x):
    return tl.abs(x) <= 3.4028234663852886e38  # false for NaN and the infinities


@triton.jit
def _to_tf32(x):
    """fp32 x rounded to TF32 (10 mantissa bits): to nearest, ties to even, in integer arithmetic so
    that the interpreter rounds as the GPU does; Inf and NaN pass unchanged."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + (0xFFF + ((bits >> 13) & 1))) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where(_finite(x), rounded, x)


@triton.jit
def _split_tf32(x):
    """3xTF32's parts of fp32 x, x = big + small (the module docstring)."""
    finite = _finite(x)
    xf = tl.where(finite, x, 0.0)
    big = _to_tf32(xf)
    down = (xf.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    big = tl.where(_finite(big), big, down)  # past TF32's largest: rounded down
    small = _to_tf32(xf - big)  # xf - big is exact in fp32
    return tl.where(finite, big, tl.where(x < 0, -1.0, 1.0)), tl.where(finite, small, x)


@triton.jit
def _dot(a, b, acc, acc_dtype: tl.constexpr, TF32: tl.constexpr):
    """acc + a @ b at the precision TF32 asks for (the module docstring)."""
    if TF32 == 0:
        # "ieee" keeps fp32 inputs exact; it does not affect fp16/bf16.
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc_dtype)
    elif TF32 == 1:
        acc = tl.dot(_to_tf32(a), _to_tf32(b), acc, input_precision="tf32", out_dtype=acc_dtype)
    else:
        a_big, a_small = _split_tf32(a)
        b_big, b_small = _split_tf32(b)
        acc = _three(a_big, a_small, b_big, b_small, acc, acc_dtype)
    return acc


@triton.jit
def _three(a_big, a_small, b_big, b_small, acc, acc_dtype: tl.constexpr):
    """acc + 3xTF32's three products of the parts, smallest first, summed from zero and then added."""
    step = tl.dot(a_small, b_big, input_precision="tf32", out_dtype=acc_dtype)
    step = tl.dot(a_big, b_small, step, input_precision="tf32", out_dtype=acc_dtype)
    step = tl.dot(a_big, b_big, step, input_precision="tf32", out_dtype=acc_dtype)
    return acc + step  # rounded to nearest, outside the tensor cores (the module docstring)


@triton.jit
def _dependent_start(PDL: tl.constexpr):
    """A dependent launch's start (kernels_core/dependent_launch.py): wait for the kernel before to
    finish and its writes to land, then (PDL = 1, early) let the next kernel's blocks be placed; PDL
    = 2 (exit) leaves that to this kernel's end. Before any access to global memory; PDL = 0
    compiles nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _split_kernel(x_ptr, big_ptr, R, K, stride_r, stride_k, ld, part, TF32: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """SPLIT_AHEAD's pass: X (R x K, element (r, k) at x_ptr + r * stride_r + k * stride_k) into its
    TF32 parts, k-contiguous, ld elements a row: 3xTF32's big and, `part` elements on, small
    (TF32 = 3), or TF32's rounding (TF32 = 1). Triton lays a tile out anew between the load and the
    store when X is not k-contiguous: the transpose of a row-major B. One grid axis, rows fastest (a
    second axis would hold at most 65535 k blocks, K up to about 4.2M)."""
    _dependent_start(PDL)
    tiles_r = tl.cdiv(R, BLOCK_R)
    offs_r = (tl.program_id(0) % tiles_r) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = (tl.program_id(0) // tiles_r) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_r[:, None] < R) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_k[None, :] * stride_k, mask=mask, other=0.0)
    dst = big_ptr + offs_r[:, None] * ld + offs_k[None, :]
    if TF32 == 1:
        tl.store(dst, _to_tf32(x), mask=mask)
    else:
        big, small = _split_tf32(x)
        tl.store(dst, big, mask=mask)
        tl.store(dst + part, small, mask=mask)


@triton.jit
def _epilogue(out, c_ptr, bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
              stride_ym, stride_yn, HAS_BIAS: tl.constexpr, RELU: tl.constexpr, RELU_GRAD: tl.constexpr):
    """Bias, ReLU (or relu_grad_of's mask) and the store of one fp32 tile of C: applied once per tile."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        out += bias.to(tl.float32)[None, :]
    if RELU:
        out = tl.where(out < 0, 0.0, out)  # NaN < 0 is false: NaN passes through
    if RELU_GRAD:
        # Compared in fp32: the interpreter holds bf16 as raw bits, whose order is not the values'.
        y = tl.load(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, mask=mask, other=1.0)
        out = tl.where(y.to(tl.float32) <= 0, 0.0, out)  # NaN <= 0 is false: a NaN y passes the gradient on
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_epilogue(
    out, dlogits_ptr, bias_ptr, labels_ptr, label_rows_ptr, flag_ptr, loss_ptr, slots_ptr, loss_counter_ptr,
    pid_m, num_pid_m, offs_m, offs_n, M, N, LABELS, stride_cm, stride_cn, stride_bias, stride_label, inv_m, rows_f,
    HAS_BIAS: tl.constexpr, LABEL_ROWS: tl.constexpr,
):
    """linear_cross_entropy's epilogue (fused.py): softmax cross-entropy of the tile's rows, whole rows
    (BLOCK_N >= N), then the row tile's share of the mean loss by the last-arrival protocol."""
    row_ok = offs_m < M
    col_ok = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=col_ok, other=0.0)
        out += bias.to(tl.float32)[None, :]
    # The logits as matmul would store them (x's dtype). Columns past N hold
    # wrapped copies of real ones: -inf keeps them out of the softmax.
    z = tl.where(col_ok[None, :], out.to(dlogits_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    m = tl.max(z, axis=1)
    shift = tl.where(m == float("-inf"), 0.0, m)  # a row of -inf: exp(-inf - 0) = 0, where -inf - -inf is NaN
    lse = shift + tl.log(tl.sum(tl.exp(z - shift[:, None]), axis=1))
    if LABEL_ROWS:  # an index outside labels reads label 0, as a_rows reads a row of zeros
        picks = tl.load(label_rows_ptr + offs_m, mask=row_ok, other=0)
        picked = row_ok & (picks >= 0) & (picks < LABELS)
        label = tl.load(labels_ptr + tl.where(picked, picks, 0) * stride_label, mask=picked, other=0)
    else:
        label = tl.load(labels_ptr + offs_m * stride_label, mask=row_ok, other=0)
    hit = offs_n[None, :] == label[:, None]
    bad = row_ok & ((label < 0) | (label >= N))
    row_loss = tl.where(bad, float("nan"), lse - tl.sum(tl.where(hit, z, 0.0), axis=1))
    g = (tl.exp(z - lse[:, None]) - tl.where(hit, 1.0, 0.0)) * inv_m
    tl.store(dlogits_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             g.to(dlogits_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    # The contract's label flag; rows racing here all write a bad label and the same N.
    same = offs_m * 0
    tl.store(flag_ptr + same, 1, mask=bad)
    tl.store(flag_ptr + 1 + same, label, mask=bad)
    tl.store(flag_ptr + 2 + same, N + same, mask=bad)

    # The mean over rows without float atomics: this row tile's sum goes to its
    # slot; the last tile to arrive sums the slots in slot order (memory
    # ordering as for the split-K partials: see the module docstring).
    tl.store(slots_ptr + pid_m, tl.sum(tl.where(row_ok, row_loss, 0.0), axis=0))
    tl.debug_barrier()
    arrived = tl.atomic_add(loss_counter_ptr, 1, sem="acq_rel")
    if arrived == num_pid_m - 1:
        total = tl.load(slots_ptr, cache_modifier=".cg")
        for t in range(1, num_pid_m):
            total += tl.load(slots_ptr + t, cache_modifier=".cg")
        tl.store(loss_ptr, tl.math.div_rn(total, rows_f))  # sum / M, correctly rounded (fp32 "/" is not)
        tl.store(loss_counter_ptr, 0)  # zero again for the next call


@triton.jit
def _sgd_epilogue(
    gw, w_ptr, bias_ptr, w_buf_ptr, b_buf_ptr, w_low_ptr, b_low_ptr, dy_ptr,
    pid_m, offs_m, offs_n, M, N, B, stride_wm, stride_wn, stride_dyb, stride_dyn, lr, momentum, weight_decay,
    HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, W_LOW: tl.constexpr, B_LOW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """linear_sgd's epilogue (fused.py): sgd_update's rule on the tile of w from its gradient in
    registers; the tile-row 0 programs also sum dy's columns for the bias and update it."""
    col_ok = offs_n < N
    offs = offs_m[:, None] * stride_wm + offs_n[None, :] * stride_wn
    sgd_rule(gw, w_ptr + offs, w_buf_ptr + offs, w_low_ptr + offs, (offs_m < M)[:, None] & col_ok[None, :],
             lr, momentum, weight_decay, HAS_MOMENTUM, HAS_WEIGHT_DECAY, W_LOW)
    if pid_m == 0:
        # Column sums of dy in BLOCK_K-row chunks, chunk after chunk: a fixed order, so the same bits on every run.
        gb = tl.zeros((BLOCK_N,), dtype=tl.float32)
        rows = tl.arange(0, BLOCK_K)
        for r0 in range(0, B, BLOCK_K):
            r = r0 + rows
            chunk = tl.load(dy_ptr + r[:, None] * stride_dyb + offs_n[None, :] * stride_dyn,
                            mask=(r < B)[:, None] & col_ok[None, :], other=0.0)
            gb += tl.sum(chunk.to(tl.float32), axis=0)
        sgd_rule(gb, bias_ptr + offs_n, b_buf_ptr + offs_n, b_low_ptr + offs_n, col_ok,
                 lr, momentum, weight_decay, HAS_MOMENTUM, HAS_WEIGHT_DECAY, B_LOW)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, partials_ptr, counters_ptr, a_rows_ptr, y_ptr,
    labels_ptr, label_rows_ptr, flag_ptr, loss_ptr, slots_ptr, loss_counter_ptr,
    buf_ptr, bias_buf_ptr, low_ptr, bias_low_ptr,
    M, N, K, K_SLICE, A_ROWS, LABELS, part_a, part_b,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias, stride_ym, stride_yn,
    stride_label, inv_m, rows_f, lr, momentum, weight_decay,
    HAS_BIAS: tl.constexpr, RELU: tl.constexpr, ACC_FP16: tl.constexpr, UPCAST: tl.constexpr,
    GATHER_A: tl.constexpr, RELU_GRAD: tl.constexpr, EPILOGUE: tl.constexpr, LABEL_ROWS: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, W_LOW: tl.constexpr, B_LOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, TF32: tl.constexpr, SPLIT_AHEAD: tl.constexpr, PDL: tl.constexpr,
):
    _dependent_start(PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last group may be short
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    if SPLIT_K == 1:
        k_start = 0
        k_len = K
    else:  # this program's slice of K; the last may be short
        k_start = tl.program_id(1) * K_SLICE
        k_len = tl.minimum(K - k_start, K_SLICE)  # only slices that hold K are launched

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if GATHER_A == 1:  # a_rows along M: this tile's rows of a, a row of zeros for an index outside a
        picks = tl.load(a_rows_ptr + offs_m % M)
        a_row_ok = (picks >= 0) & (picks < A_ROWS)
        a_ptrs = a_ptr + (tl.where(a_row_ok, picks, 0)[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak)
    elif GATHER_A == 2:  # a_rows along K: the column offsets come from a_rows, step by step
        a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am
    else:
        a_ptrs = a_ptr + ((offs_m % M)[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak)
    b_ptrs = b_ptr + ((k_start + offs_k)[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn)

    acc_dtype = tl.float16 if ACC_FP16 else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        k_left = k_len - k * BLOCK_K
        if GATHER_A == 2:  # a_rows along K: each step gathers its BLOCK_K rows of the stored a
            picks = tl.load(a_rows_ptr + k_start + k * BLOCK_K + offs_k, mask=offs_k < k_left, other=-1)
            k_ok = (picks >= 0) & (picks < A_ROWS)
            a = tl.load(a_ptrs + tl.where(k_ok, picks, 0)[None, :] * stride_ak, mask=k_ok[None, :], other=0.0)
        elif GATHER_A == 1:
            a = tl.load(a_ptrs, mask=a_row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            # Triton's interpreter (3.9) returns garbage for bf16 x bf16 dots;
            # fp32 tiles hold bf16 values exactly, so the product is unchanged.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SPLIT_AHEAD == 0:
            acc = _dot(a, b, acc, acc_dtype, TF32)
        elif TF32 == 1:  # a and b hold TF32 numbers already
            acc = tl.dot(a, b, acc, input_precision="tf32", out_dtype=acc_dtype)
        else:  # a and b are the big parts; the small ones lie part_a and part_b elements on
            a_small = tl.load(a_ptrs + part_a, mask=offs_k[None, :] < k_left, other=0.0)
            b_small = tl.load(b_ptrs + part_b, mask=offs_k[:, None] < k_left, other=0.0)
            acc = _three(a, a_small, b, b_small, acc, acc_dtype)
        if GATHER_A != 2:
            a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    out = acc.to(tl.float32)
    if SPLIT_K == 1:
        last = True
    else:
        # Rows and columns past M and N are stored too (wrapped values that
        # never reach C), so the partial needs no mask.
        tile_elems = BLOCK_M * BLOCK_N
        offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ptr = partials_ptr + pid * (SPLIT_K * tile_elems)
        tl.store(tile_ptr + tl.program_id(1) * tile_elems + offs_tile, out)
        # All threads' stores before the one thread's release (see the module
        # docstring). Triton 3.9 happens to put a barrier there for its own
        # shared-memory reuse; this one does not depend on that.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + pid, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
    if last:  # SPLIT_K == 1: a constant, so no branch is compiled
        if SPLIT_K > 1:
            # Last of the tile: every partial is visible (acquire, then ".cg"
            # reads from L2), summed in slice order whoever this program is.
            out = tl.load(tile_ptr + offs_tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                out += tl.load(tile_ptr + s * tile_elems + offs_tile, cache_modifier=".cg")
            tl.store(counters_ptr + pid, 0)  # zero again for the next call: nothing else reads it in this one
        if EPILOGUE == 0:
            _epilogue(out, c_ptr, bias_ptr, y_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
                      stride_ym, stride_yn, HAS_BIAS, RELU, RELU_GRAD)
        elif EPILOGUE == 1:
            _cross_entropy_epilogue(
                out, c_ptr, bias_ptr, labels_ptr, label_rows_ptr, flag_ptr, loss_ptr, slots_ptr, loss_counter_ptr,
                pid_m, num_pid_m, offs_m, offs_n, M, N, LABELS, stride_cm, stride_cn, stride_bias, stride_label,
                inv_m, rows_f, HAS_BIAS, LABEL_ROWS)
        else:
            _sgd_epilogue(
                out, c_ptr, bias_ptr, buf_ptr, bias_buf_ptr, low_ptr, bias_low_ptr, b_ptr,
                pid_m, offs_m, offs_n, M, N, K, stride_cm, stride_cn, stride_bk, stride_bn, lr, momentum,
                weight_decay, HAS_MOMENTUM, HAS_WEIGHT_DECAY, W_LOW, B_LOW, BLOCK_N, BLOCK_K)


# num_stages 2 and 5 and num_warps 1 are left out to keep the space small and
# dense (the tuner draws each tunable on its own; its first draws are random,
# so the share of valid configs matters): in a full grid over this space on
# the H200 (experiments/results/h200/search_quality_grid.csv, fp16) 2 stages
# were a third slower than 3 or 4 at both 4096^3 and 128x1024x784; 5 never won.
_PARAMS = {
    "BLOCK_M": (16, 32, 64, 128, 256),
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (32, 64, 128),
    "GROUP_M": (1, 8),
    "num_warps": (2, 4, 8),
    "num_stages": (3, 4),
    "SPLIT_K": (1, 2, 4, 8, 16, 32, 64),
}
_RESTRICTIONS = (
    # The fp32 accumulator lives in registers: at most 128 per thread.
    "BLOCK_M * BLOCK_N <= 128 * 32 * num_warps",
    # Fewer than 16 outputs per thread leaves the tensor cores starved, except
    # on 2 warps: a warp's smallest mma is 16x8, so a 16x16 tile still
    # computes nothing twice, and small tiles are for outputs of few tiles.
    "num_warps == 2 or BLOCK_M * BLOCK_N >= 16 * 32 * num_warps",
    # 2 warps only for tiles of at most 32x32: a bigger tile on so few warps
    # leaves half of an SM's 4 schedulers idle where it runs alone.
    "num_warps >= 4 or BLOCK_M * BLOCK_N <= 1024",
    # 16x256 reads 16 + 256 operand rows per K step for 4096 outputs, where
    # 32x128 reads 32 + 128 for as many.
    "max(BLOCK_M, BLOCK_N) <= 8 * min(BLOCK_M, BLOCK_N)",
    # Split tiles of at most 64x64 outputs: on the trainer's small outputs
    # (128x1024, 32x4096, 128x10) these give 1..512 tiles, which SPLIT_K up to
    # 16 lifts to or past the H200's 132 SMs; bigger ones would only add configs.
    "SPLIT_K == 1 or BLOCK_M * BLOCK_N <= 64 * 64",
    # 32 and 64 slices only for tiles of at most 512 outputs: the logits'
    # products (32x10 or 128x10 over K = 1024..8192) have 1..8 such tiles,
    # which 16 slices leave at 16..128 programs of 8..32 serial K steps.
    "SPLIT_K <= 16 or BLOCK_M * BLOCK_N <= 512",
    # A slice is a whole number of BLOCK_K steps: at K = 784, 128-wide steps
    # would leave 9 of SPLIT_K = 16 slices empty (64-wide: 3).
    "SPLIT_K == 1 or BLOCK_K <= 64",
)
_SMEM = "(BLOCK_M + BLOCK_N) * BLOCK_K * elt * num_stages"
_SMEM_FP32 = f"{_SMEM} * (2 if SPLIT_AHEAD and TF32 == 3 else 1)"  # big and small parts, split ahead


def _ring_fits(smem: str) -> str:
    return f"{smem} <= 232448  # no GPU offers more than 227 KiB per block; larger rings fit nowhere"

_NOTES = ("threads = 32 * num_warps; smem_bytes counts the operand ring only "
          "(Triton may reuse it for the epilogue)")

SPACES = {
    # Hopper's sweet spot for 16-bit inputs: a 128x256 tile over two warpgroups.
    "fp16": Space(
        params=_PARAMS,
        default=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
        restrictions=_RESTRICTIONS + (_ring_fits(_SMEM),), smem_bytes=_SMEM, notes=_NOTES,
    ),
    "bf16": Space(
        params=_PARAMS,
        default=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
        restrictions=_RESTRICTIONS + (_ring_fits(_SMEM), "arch >= 80  # bf16 tensor cores start at sm_80"),
        smem_bytes=_SMEM, notes=_NOTES,
    ),
    # Exact fp32 runs on the FMA units, where register pressure, not shared
    # memory, bounds the tile. TF32: 0 exact, 3 3xTF32, 1 plain TF32; SPLIT_AHEAD: the
    # operands split before the GEMM (the module docstring), four tiles a stage in 3xTF32.
    "fp32": Space(
        params={**_PARAMS, "TF32": (0, 3, 1), "SPLIT_AHEAD": (0, 1)},
        default=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=1, TF32=0,
                     SPLIT_AHEAD=0),
        restrictions=_RESTRICTIONS + (
            _ring_fits(_SMEM_FP32),
            "TF32 == 0 or arch >= 80  # TF32 tensor cores start at sm_80",
            "SPLIT_AHEAD == 0 or TF32 > 0  # the parts are TF32 numbers",
        ),
        smem_bytes=_SMEM_FP32, notes=_NOTES,
        lower_precision={"TF32": {1: "tf32"}}, emulated={"TF32": (3,)}, families=("TF32", "SPLIT_AHEAD"),
    ),
}

_MAX_I32 = 2**31 - 1


def _span(t: torch.Tensor) -> int:
    """Largest element offset the kernel computes into `t` (in 32-bit math)."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


# The kernel's epilogues (its EPILOGUE constexpr): matmul's own, and fused.py's two.
PLAIN, CROSS_ENTROPY, SGD = 0, 1, 2


def kernel_plan(op: str, dtype: str, cfg: dict, a, b, c, M: int, N: int, K: int, *, trans_a=False, trans_b=False,
                bias=None, activation=None, accumulate="fp32", epilogue=PLAIN, **extra) -> rt.Plan:
    """The launch of _matmul_kernel for checked arguments (M, N > 0): strides, split-K slices and
    scratch, and every parameter an epilogue or gather does not set in `extra` as a placeholder
    that its constexprs leave unread (pointers: c itself)."""
    for name, t in (("a", a), ("b", b), ("out", c)):
        if _span(t) > _MAX_I32:
            raise ValueError(f"{name}: spans more than 2**31 elements; the kernel uses 32-bit offsets")
    stride_am, stride_ak = (a.stride(1), a.stride(0)) if trans_a else (a.stride(0), a.stride(1))
    stride_bk, stride_bn = (b.stride(1), b.stride(0)) if trans_b else (b.stride(0), b.stride(1))
    constexprs = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    row_tiles = cdiv(M, cfg["BLOCK_M"])
    tiles = row_tiles * cdiv(N, cfg["BLOCK_N"])
    # The kernel's SPLIT_K is the number of slices that hold any K: empty ones are not launched.
    k_slice, split_k = splitk_slices(K, cfg["SPLIT_K"], cfg["BLOCK_K"])
    constexprs["SPLIT_K"] = split_k
    partials = counters = c  # placeholders: SPLIT_K == 1 compiles no access to them
    partial_elems = tiles * split_k * cfg["BLOCK_M"] * cfg["BLOCK_N"] if split_k > 1 else 0
    loss_slots = row_tiles if epilogue == CROSS_ENTROPY else 0
    if partial_elems + loss_slots > _MAX_I32:
        raise ValueError(f"config: SPLIT_K={cfg['SPLIT_K']} needs {partial_elems + loss_slots} scratch floats "
                         f"(partial sums and loss slots) for a {M}x{N} output, more than 2**31; the kernel uses "
                         "32-bit offsets")
    if partial_elems or loss_slots:
        # One workspace for both protocols (fused.py's docstring): partials, then the row tiles' loss
        # slots; the tiles' counters, then the loss counter.
        partials, counters = splitk_workspace(a.device, partial_elems + loss_slots, tiles + (1 if loss_slots else 0),
                                              what="linear_cross_entropy" if loss_slots else "a split-K matmul")
    if loss_slots:
        extra.update(slots_ptr=partials[partial_elems:], loss_counter_ptr=counters[tiles:])
    args = dict(
        a_ptr=a, b_ptr=b, c_ptr=c, bias_ptr=bias if bias is not None else c,
        partials_ptr=partials, counters_ptr=counters,
        a_rows_ptr=c, y_ptr=c, labels_ptr=c, label_rows_ptr=c, flag_ptr=c, loss_ptr=c, slots_ptr=c,
        loss_counter_ptr=c, buf_ptr=c, bias_buf_ptr=c, low_ptr=c, bias_low_ptr=c,
        M=M, N=N, K=K, K_SLICE=k_slice, A_ROWS=0, LABELS=0, part_a=0, part_b=0,
        stride_am=stride_am, stride_ak=stride_ak, stride_bk=stride_bk, stride_bn=stride_bn,
        stride_cm=c.stride(0), stride_cn=c.stride(1), stride_bias=bias.stride(0) if bias is not None else 1,
        stride_ym=0, stride_yn=0, stride_label=0, inv_m=0.0, rows_f=0.0, lr=0.0, momentum=0.0, weight_decay=0.0,
        HAS_BIAS=bias is not None, RELU=activation == "relu", ACC_FP16=accumulate == "fp16",
        UPCAST=a.device.type == "cpu" and a.dtype == torch.bfloat16,  # CPU tensors: the interpreter
        GATHER_A=0, RELU_GRAD=False, EPILOGUE=epilogue, LABEL_ROWS=False, HAS_MOMENTUM=False,
        HAS_WEIGHT_DECAY=False, W_LOW=False, B_LOW=False, PDL=0,
        **{"TF32": 0, "SPLIT_AHEAD": 0, **constexprs},  # 16-bit spaces have neither tunable
    )
    unknown = set(extra) - set(args)
    assert not unknown, f"not parameters of _matmul_kernel: {sorted(unknown)}"
    args.update(extra)
    return rt.Plan(op, dtype, cfg, _matmul_kernel, (tiles, split_k), args, cfg["num_warps"], cfg["num_stages"])


def gather_args(a, a_rows, trans_a: bool) -> dict:
    """kernel_plan's arguments that read op(a) as a[a_rows] (rows of the stored a): along M, or along
    K when op transposes."""
    if a_rows is None:
        return {}
    return dict(a_rows_ptr=a_rows, A_ROWS=a.shape[0], GATHER_A=2 if trans_a else 1)


def plan(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
         accumulate="fp32", a_rows=None, relu_grad_of=None) -> tuple[torch.Tensor, rt.Plan | None]:
    M, N, K = contract.matmul_args(a, b, bias, activation, trans_a, trans_b, accumulate, a_rows, relu_grad_of)
    rt.check_device("a", a)
    out = contract.output("out", out, (M, N), a.dtype, a.device, contiguous=False)
    dtype = contract.dtype_name(a.dtype)
    cfg = rt.resolve(SPACES[dtype], config, a.element_size(), a.device)
    if M == 0 or N == 0:
        return out, None
    extra = gather_args(a, a_rows, trans_a)
    before = ()
    if cfg.get("SPLIT_AHEAD"):
        if a_rows is not None:
            raise ValueError("config: SPLIT_AHEAD=1 splits op(a) before the GEMM and reads no gathered rows (a_rows); "
                             "use SPLIT_AHEAD=0 for this call")
        (a, a_split), (b, b_split) = (split_ahead(x, rows, K, trans, cfg["TF32"], dtype, cfg)
                                      for x, rows, trans in ((a, M, trans_a), (b, N, not trans_b)))
        trans_a, trans_b, before = False, True, (a_split, b_split)
        extra.update(part_a=a_split.args["part"], part_b=b_split.args["part"])
    if relu_grad_of is not None:
        if _span(relu_grad_of) > _MAX_I32:
            raise ValueError("relu_grad_of: spans more than 2**31 elements; the kernel uses 32-bit offsets")
        extra.update(y_ptr=relu_grad_of, stride_ym=relu_grad_of.stride(0), stride_yn=relu_grad_of.stride(1),
                     RELU_GRAD=True)
    p = kernel_plan("matmul", dtype, cfg, a, b, out, M, N, K, trans_a=trans_a, trans_b=trans_b, bias=bias,
                    activation=activation, accumulate=accumulate, **extra)
    return out, dataclasses.replace(p, before=before)


SPLIT_BLOCK = 64  # rows and k of a split pass's tile


def split_ahead(x: torch.Tensor, rows: int, K: int, trans: bool, tf32: int, dtype: str, cfg: dict
                ) -> tuple[torch.Tensor, rt.Plan]:
    """(the big part, the launch that writes it): op(x)'s parts for SPLIT_AHEAD, rows x K with k
    contiguous (trans: x stores K x rows), ld = K rounded up to 4 (16-byte rows), in a new workspace
    (a CUDA graph's pool in a capture); 3xTF32's small part lies `part` elements after the big."""
    ld = cdiv(K, 4) * 4
    shape = (2 if tf32 == 3 else 1, rows, ld)
    if shape[0] * rows * ld > _MAX_I32 or _span(x) > _MAX_I32:
        raise ValueError(f"config: SPLIT_AHEAD=1 would split a {rows}x{K} operand into more than 2**31 elements; "
                         "the kernel uses 32-bit offsets")
    parts = torch.empty(shape, dtype=torch.float32, device=x.device)
    stride_r, stride_k = (x.stride(1), x.stride(0)) if trans else (x.stride(0), x.stride(1))
    part = parts.stride(0) if tf32 == 3 else 0
    grid = (cdiv(rows, SPLIT_BLOCK) * cdiv(K, SPLIT_BLOCK),)
    return parts[0], rt.Plan("tf32_split", dtype, cfg, _split_kernel, grid,
                             dict(x_ptr=x, big_ptr=parts, R=rows, K=K, stride_r=stride_r, stride_k=stride_k, ld=ld,
                                  part=part, TF32=tf32, BLOCK_R=SPLIT_BLOCK, BLOCK_K=SPLIT_BLOCK, PDL=0),
                             num_warps=4)


def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
           accumulate="fp32", a_rows=None, relu_grad_of=None):
    out, p = plan(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b, out=out,
                  config=config, accumulate=accumulate, a_rows=a_rows, relu_grad_of=relu_grad_of)
    if p is not None:
        rt.launch(p)
    return out
