"""Many training steps of the MLP in one launch: the persistent training kernel.

The fused step (trainer/model.py) runs 3 GEMM kernels a layer; at H = 128 each is bound by its
latency, not its work (a few µs each for well under 1 µs of arithmetic). Here one grid of
programs stays resident for a whole segment of steps and walks each step's phases itself, a grid
barrier between phases, so a phase costs its work and one barrier (about 0.9 µs on the H200 at
132 programs: experiments/grid_barrier.py) instead of a kernel's launch, ramp and tail. Each phase
is a list of tiles handed out over the whole grid (tile t to program t mod programs): a phase then
takes about one tile's chain of k-steps, where a program walking many tiles in turn would take
their sum. A step of 784 -> H x layers -> 10 (kernels_core/persistent.py's Layout: weights W_0 ..
W_L, L = layers; A_0 = x[rows], A_{l+1} = relu(A_l @ W_l + b_l), D_l the gradient at layer l's
output):

    forward     A_{l+1} in BM x BN tiles, l = 0 .. L-1. The first layer's K = 784 may split into
                SPLIT_K slices of whole k-steps, each tile-slice summing into an fp32 partial (a
                chain of about 784 / SPLIT_K k's a tile); the last slice of a tile to arrive at its
                count sums the partials in order and adds b_0, so the split costs no phase.
    loss        BL rows x BN columns of D_{L-1} a tile: the rows' D_L = (softmax(A_L @ W_L + b_L) -
                onehot) / B (each row block's summed loss in a slot), and at once D_{L-1} = (D_L @
                W_L^T) * (A_L > 0): D_L is a short product (its N is the classes) that each tile of
                the row block works out whole, so the last layer's input gradient needs no phase
                of its own and spreads over the grid.
    backward    for l = L-1 .. 1: D_{l-1} = (D_l @ W_l^T) * (A_l > 0) in BM x BN tiles, beside
                W_{l+1}'s update in BR x BC tiles (gradient A_{l+1}^T @ D_{l+1}, optim.py's
                sgd_rule; the tiles of row block 0 also update b_{l+1}); last, W_1's and W_0's
                updates (W_0's in BR0 x BC tiles). A weight is updated one phase after the phase
                that reads it for an input gradient, so no tile reads a weight another tile of
                its phase writes.

2L + 1 barriers a step (kernels_core.persistent.barriers_per_step: 5 for the default protocol's
784-H-H-10). After the loss's barrier the last program sums the loss slots, in
slot order (the same bits on every run), into the step's entry of `losses`: the phase's tiles go to
the first programs, so where they are fewer than the programs the sum's trip to L2 keeps no tile
waiting (measured no faster than program 0: that tile was not the phase's slowest). The batch's rows come
from `batches[step]` (the trainer's epoch permutation as rows of B), the labels from y[rows]; the
dataset is read in place.

Where things live: the weights and momentum buffers in the flat fp32 buffers the trainer keeps
(L2-resident: 467 KB for H = 128), the activations and gradients in a scratch of B x H a layer.
What one program writes and another reads later in the launch is seen because of the barrier: its
acquire poll compiles, on sm_90, to an invalidation of the multiprocessor's L1 (`CCTL.IVALL`), so no
line cached before the writers' stores survives it. Those loads ask for `.cg` (L2 only) too, but
Triton's pipeliner turns the ones that feed a dot into `cp.async` copies through L1, so the barrier
is what holds; a tile of W is updated by the same program every step, with plain loads. The rounding
rules are the fused step's: fp32 master weights; in fp16/bf16 the GEMMs read them rounded to the
dataset's dtype, activations and gradients are stored in it, every product accumulates in fp32;
in fp32 every product is IEEE (matmul.py's _dot with TF32 = 0).

Every program must be resident at once (the barrier waits for all): `plan` asks the driver how
many of the compiled kernel's blocks fit a multiprocessor and refuses a grid past that
(kernels_core/persistent.py). Under the interpreter programs run one after another, so only a
grid of one program can pass a barrier there: `plan` refuses more.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from kernels_core import compile_only
from kernels_core.persistent import (Layout, blocks_per_sm, check_coresident, check_inputs, check_segment,
                                     resolve_config, slice_counts)

from . import _runtime as rt
from .matmul import _dot
from .optim import sgd_apply, sgd_load


@triton.jit
def grid_barrier(counter_ptr, arrivals):
    """Wait until the counter, zeroed before the launch, reaches `arrivals`: every program has
    arrived at this barrier (arrivals = barriers so far x programs). The program's threads meet
    first, so its stores precede its release; the acquire orders every later load after all
    programs' stores (experiments/grid_barrier.py measures it). A scalar atomic runs once a program."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < arrivals:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _end_phase(counter_ptr, arrivals, stamps_ptr, pid, programs, STAMPS: tl.constexpr):
    """The grid barrier after a phase; with STAMPS, program 0 then writes the GPU's nanosecond clock
    to stamps[barriers so far] (stamps[0]: the launch's start), the phases' boundaries."""
    grid_barrier(counter_ptr, arrivals)
    if STAMPS:
        if pid == 0:
            tl.store(stamps_ptr + arrivals // programs, globaltimer())


@triton.jit
def _prefetch_rows(x_ptr, y_ptr, rows, mine, IN: tl.constexpr, LINES: tl.constexpr):
    """Sends for x's rows `rows` (row-major, IN elements a row) and their labels into L2
    (prefetch.global.L2) and goes on: every 128-byte line a row touches holds one of the LINES points
    128 bytes apart from its start (the last clamped to its end)."""
    step: tl.constexpr = 1024 // x_ptr.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line
    at = tl.minimum(tl.arange(0, LINES) * step, IN - 1)
    lines = x_ptr + rows.to(tl.int64)[:, None] * IN + at[None, :]
    _prefetch_l2(lines, tl.broadcast_to(mine[:, None], lines.shape))
    _prefetch_l2(y_ptr + rows, mine)


@triton.jit
def _prefetch_l2(ptrs, mask):
    """prefetch.global.L2 at each pointer where `mask`: sends for its line and goes on."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _source_rows(rows_ptr, offs, mask, GATHER: tl.constexpr):
    """Which rows of a layer's input the batch's rows `offs` are: the dataset's rows[offs] (GATHER)
    or the scratch's own."""
    if GATHER:
        src = tl.load(rows_ptr + offs, mask=mask, other=0)
    else:
        src = offs
    return src


@triton.jit
def _load_a(a_ptr, src, cols, mask, K: tl.constexpr, GATHER: tl.constexpr):
    """a[src, cols] of a row-major (*, K) a: the dataset's rows (GATHER; read-only, cached as usual)
    or a phase's output (`.cg`: another program wrote it)."""
    ptrs = a_ptr + src[:, None].to(tl.int64) * K + cols[None, :]
    if GATHER:
        a = tl.load(ptrs, mask=mask, other=0.0)
    else:
        a = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return a


@triton.jit
def _tile_product(a_ptr, src, in_m, w_ptr, offs_n, in_n, k_lo, k_hi, N: tl.constexpr, K: tl.constexpr,
                  GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """(a[src] @ w)[:, offs_n] over the k in [k_lo, min(k_hi, K)), in fp32: a (*, K), w (K, N)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        in_k = offs_k < K
        a = _load_a(a_ptr, src, offs_k, in_m[:, None] & in_k[None, :], K, GATHER)
        w = tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :], mask=in_k[:, None] & in_n[None, :], other=0.0,
                    cache_modifier=".cg")
        acc = _dot(a, w.to(a.dtype), acc, tl.float32, 0)
    return acc


@triton.jit
def _forward(a_ptr, rows_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counts_ptr, M, pid, programs,
             N: tl.constexpr, K: tl.constexpr, GATHER: tl.constexpr, SPLIT: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out = relu(a[rows] @ w + b), a (M, K) (GATHER: rows of the dataset), w (K, N), in BM x BN
    tiles. SPLIT > 1: tile t's slice s, k-steps [s S / SPLIT, (s + 1) S / SPLIT) of the S =
    cdiv(K, BK) (as even as whole k-steps go, none empty), sums into the fp32 partial s of part
    (SPLIT x M x N) and arrives at its tile's count (release; acquire for the last). The last
    slice to arrive adds the partials up in slice order, whichever it is, so the bits never
    depend on the order of arrival, finishes the tile into out and sets its count back to 0."""
    tiles_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * tiles_n
    for t in range(pid, tiles * SPLIT, programs):
        s = t // tiles
        tile = t % tiles
        offs_m = (tile // tiles_n) * BM + tl.arange(0, BM)
        offs_n = (tile % tiles_n) * BN + tl.arange(0, BN)
        in_m, in_n = offs_m < M, offs_n < N
        src = _source_rows(rows_ptr, offs_m, in_m, GATHER)
        if SPLIT == 1:  # sent for now, so that it arrives while the product runs
            bias = tl.load(b_ptr + offs_n, mask=in_n, other=0.0, cache_modifier=".cg")
        k_steps = tl.cdiv(K, BK)
        acc = _tile_product(a_ptr, src, in_m, w_ptr, offs_n, in_n, (s * k_steps // SPLIT) * BK,
                            ((s + 1) * k_steps // SPLIT) * BK, N, K, GATHER, BM, BN, BK)
        at = offs_m[:, None] * N + offs_n[None, :]
        mask = in_m[:, None] & in_n[None, :]
        if SPLIT > 1:
            tl.store(part_ptr + s * M * N + at, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial stored before the arrival releases them
            arrived = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if arrived == SPLIT - 1:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for q in tl.static_range(SPLIT):
                    acc += tl.load(part_ptr + q * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
                bias = tl.load(b_ptr + offs_n, mask=in_n, other=0.0, cache_modifier=".cg")
                _finish(acc, bias, out_ptr, at, mask)
                tl.store(counts_ptr + tile, 0)
        else:
            _finish(acc, bias, out_ptr, at, mask)


@triton.jit
def _finish(acc, bias, out_ptr, at, mask):
    """out[at] = relu(acc + bias), stored in out's dtype."""
    tl.store(out_ptr + at, tl.maximum(acc + bias[None, :], 0.0).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _loss(a_ptr, w_ptr, b_ptr, y_ptr, rows_ptr, d_ptr, dx_ptr, slots_ptr, M, inv_m, pid, programs,
          N: tl.constexpr, K: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          NP: tl.constexpr):
    """logits = a @ w + b (rounded to a's dtype, as the fused step stores them) and d = (softmax -
    onehot(y[rows])) / M in a's dtype, BL rows at a time; then those rows' input gradient dx = (d @
    w^T) * (a > 0) in BN of a's K columns. A row block's d is whole in the program that made it, so
    the last layer's dx needs no barrier: the tiles are (row block, BN columns of dx), each program
    working out its rows' d (a short product: N is the classes), the first tile of a row block
    storing d and the block's summed loss in its slot."""
    offs_n = tl.arange(0, NP)
    in_n = offs_n < N
    chunks = tl.cdiv(K, BN)
    for t in range(pid, tl.cdiv(M, BL) * chunks, programs):
        block = t // chunks
        offs_m = block * BL + tl.arange(0, BL)
        in_m = offs_m < M
        offs_k = (t % chunks) * BN + tl.arange(0, BN)
        in_k = offs_k < K
        # What the tile reads besides the product's operands, sent for before it so that it arrives
        # while the product runs: the bias, the rows' labels, dx's ReLU mask (a) and w's rows offs_k.
        bias = tl.load(b_ptr + offs_n, mask=in_n, other=0.0, cache_modifier=".cg")
        rows = tl.load(rows_ptr + offs_m, mask=in_m, other=0)
        label = tl.load(y_ptr + rows, mask=in_m, other=0)
        a = _load_a(a_ptr, offs_m, offs_k, in_m[:, None] & in_k[None, :], K, False)
        w_t = tl.load(w_ptr + offs_n[:, None] + offs_k[None, :] * N, mask=in_n[:, None] & in_k[None, :],
                      other=0.0, cache_modifier=".cg")  # (NP, BN): w's rows offs_k, transposed
        acc = _tile_product(a_ptr, offs_m, in_m, w_ptr, offs_n, in_n, 0, K, N, K, False, BL, NP, BK)
        acc += bias[None, :]
        logits = acc.to(d_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(in_n[None, :], logits, float("-inf"))
        top = tl.max(logits, axis=1)
        e = tl.exp(logits - top[:, None])
        total = tl.sum(e, axis=1)
        hit = offs_n[None, :] == label[:, None]
        d = ((e / total[:, None] - tl.where(hit, 1.0, 0.0)) * inv_m).to(d_ptr.dtype.element_ty)
        if t % chunks == 0:
            loss = top + tl.log(total) - tl.sum(tl.where(hit, logits, 0.0), axis=1)
            tl.store(d_ptr + offs_m[:, None] * N + offs_n[None, :], d, mask=in_m[:, None] & in_n[None, :])
            tl.store(slots_ptr + block, tl.sum(tl.where(in_m, loss, 0.0), axis=0))
        dx = _dot(d, w_t.to(d.dtype), tl.zeros((BL, BN), dtype=tl.float32), tl.float32, 0)
        tl.store(dx_ptr + offs_m[:, None] * K + offs_k[None, :], tl.where(a > 0, dx, 0.0).to(dx_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_k[None, :])


@triton.jit
def _input_grad(d_ptr, w_ptr, a_ptr, dx_ptr, t, M, K: tl.constexpr, N: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Tile t (BM x BN) of a layer's input gradient dx = (d @ w^T) * (a > 0): d (M, N) its output's
    gradient, w (K, N) its weights (before this step's update), a (M, K) its input, dx (M, K)."""
    tiles_k = tl.cdiv(K, BN)
    offs_m = (t // tiles_k) * BM + tl.arange(0, BM)
    offs_k = (t % tiles_k) * BN + tl.arange(0, BN)
    in_m, in_k = offs_m < M, offs_k < K
    a = _load_a(a_ptr, offs_m, offs_k, in_m[:, None] & in_k[None, :], K, False)  # the mask, sent for first
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for n0 in range(0, N, BK):
        offs_n = n0 + tl.arange(0, BK)
        in_n = offs_n < N
        d = tl.load(d_ptr + offs_m[:, None] * N + offs_n[None, :], mask=in_m[:, None] & in_n[None, :], other=0.0,
                    cache_modifier=".cg")
        w_t = tl.load(w_ptr + offs_n[:, None] + offs_k[None, :] * N, mask=in_n[:, None] & in_k[None, :], other=0.0,
                      cache_modifier=".cg")  # (BK, BN): w's rows offs_k, transposed
        acc = _dot(d, w_t.to(d.dtype), acc, tl.float32, 0)
    tl.store(dx_ptr + offs_m[:, None] * K + offs_k[None, :], tl.where(a > 0, acc, 0.0).to(dx_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_k[None, :])


@triton.jit
def _update(a_ptr, rows_ptr, d_ptr, w_ptr, b_ptr, w_buf_ptr, b_buf_ptr, t, M, lr, momentum, weight_decay,
            K: tl.constexpr, N: tl.constexpr, GATHER: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
            BK: tl.constexpr, HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr):
    """Tile t (BR x BC) of a layer's weights w (K, N) takes its SGD step (optim.py's sgd_rule) with
    the gradient a^T @ d, the batch BK rows at a time: a (M, K) the layer's input (GATHER: rows of
    the dataset), d (M, N) its output's gradient; the tiles of row block 0 update b with d's column
    sums."""
    tiles_c = tl.cdiv(N, BC)
    block = t // tiles_c
    offs_r = block * BR + tl.arange(0, BR)
    offs_c = (t % tiles_c) * BC + tl.arange(0, BC)
    in_r, in_c = offs_r < K, offs_c < N
    # The tile's params and buffers, sent for before the product so that they arrive while it runs.
    w_ptrs = w_ptr + offs_r[:, None] * N + offs_c[None, :]
    w_buf_ptrs = w_buf_ptr + offs_r[:, None] * N + offs_c[None, :]
    w_mask = in_r[:, None] & in_c[None, :]
    w, w_buf = sgd_load(w_ptrs, w_buf_ptrs, w_mask, HAS_MOMENTUM)
    b_mask = in_c & (block + 0 * offs_c == 0)  # the bias: row block 0 alone
    b, b_buf = sgd_load(b_ptr + offs_c, b_buf_ptr + offs_c, b_mask, HAS_MOMENTUM)
    g = tl.zeros((BR, BC), dtype=tl.float32)
    gb = tl.zeros((BC,), dtype=tl.float32)
    for b0 in range(0, M, BK):
        offs_b = b0 + tl.arange(0, BK)
        in_b = offs_b < M
        src = _source_rows(rows_ptr, offs_b, in_b, GATHER)
        a = _load_a(a_ptr, src, offs_r, in_b[:, None] & in_r[None, :], K, GATHER)
        d = tl.load(d_ptr + offs_b[:, None] * N + offs_c[None, :], mask=in_b[:, None] & in_c[None, :], other=0.0,
                    cache_modifier=".cg")
        g = _dot(tl.trans(a), d, g, tl.float32, 0)
        if block == 0:
            gb += tl.sum(d.to(tl.float32), axis=0)
    sgd_apply(g, w, w_buf, w_ptrs, w_buf_ptrs, w_ptrs, w_mask, lr, momentum, weight_decay, HAS_MOMENTUM,
              HAS_WEIGHT_DECAY, False)
    if block == 0:
        sgd_apply(gb, b, b_buf, b_ptr + offs_c, b_buf_ptr + offs_c, b_ptr + offs_c, b_mask, lr, momentum,
                  weight_decay, HAS_MOMENTUM, HAS_WEIGHT_DECAY, False)


@triton.jit(do_not_specialize=["steps", "epoch_steps"])  # one compile for every segment
def _train_kernel(
    x_ptr, y_ptr, batches_ptr, p_ptr, buf_ptr, acts_ptr, grads_ptr, part_ptr, counts_ptr, slots_ptr, losses_ptr,
    counter_ptr,
    pos_ptr, stamps_ptr, steps, epoch_steps, lr, momentum, weight_decay, inv_m,
    M: tl.constexpr, IN: tl.constexpr, H: tl.constexpr, OUT: tl.constexpr, LAYERS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BR0: tl.constexpr, BC: tl.constexpr,
    BL: tl.constexpr, NP: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, STAMPS: tl.constexpr,
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LINES: tl.constexpr,
):
    """`steps` steps from the epoch's slot *pos_ptr on (wrapping at epoch_steps), then *pos_ptr +=
    steps (the module docstring)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    if STAMPS:
        if pid == 0:
            tl.store(stamps_ptr, globaltimer())
    first = tl.load(pos_ptr)
    MH: tl.constexpr = M * H
    W1: tl.constexpr = IN * H + H  # Layout.offsets: W_0, b_0, then (H x H + H) a hidden layer, then W_L, b_L
    N1: tl.constexpr = OUT if LAYERS == 1 else H  # W_1's columns
    d_last = grads_ptr + LAYERS * MH
    arrivals = 0
    for step in range(steps):
        s = (first + step) % epoch_steps
        rows = batches_ptr + s * M
        _forward(x_ptr, rows, p_ptr, p_ptr + IN * H, acts_ptr, part_ptr, counts_ptr, M, pid, programs, H, IN, True,
                 SPLIT_K, BM, BN, BK)
        arrivals += programs
        _end_phase(counter_ptr, arrivals, stamps_ptr, pid, programs, STAMPS)
        for l in tl.static_range(1, LAYERS):
            w = W1 + (l - 1) * (H * H + H)
            _forward(acts_ptr + (l - 1) * MH, rows, p_ptr + w, p_ptr + w + H * H, acts_ptr + l * MH, part_ptr,
                     counts_ptr, M, pid, programs, H, H, False, 1, BM, BN, BK)
            arrivals += programs
            _end_phase(counter_ptr, arrivals, stamps_ptr, pid, programs, STAMPS)
        w_last = W1 + (LAYERS - 1) * (H * H + H)
        if PREFETCH:  # the next step's rows this program sends for (row r by program r mod programs)
            ahead = pid + tl.arange(0, AHEAD) * programs
            ahead_rows = tl.load(batches_ptr + (s + 1) % epoch_steps * M + ahead, mask=ahead < M, other=0)
        _loss(acts_ptr + (LAYERS - 1) * MH, p_ptr + w_last, p_ptr + w_last + H * OUT, y_ptr, rows, d_last,
              grads_ptr + (LAYERS - 1) * MH, slots_ptr, M, inv_m, pid, programs, OUT, H, BL, BN, BK, NP)
        arrivals += programs
        _end_phase(counter_ptr, arrivals, stamps_ptr, pid, programs, STAMPS)
        if PREFETCH:  # into L2 the step's remaining phases (one or more) before the next step's first layer reads them
            _prefetch_rows(x_ptr, y_ptr, ahead_rows, ahead < M, IN, LINES)
        if pid == programs - 1:  # the step's loss: the row blocks' sums in slot order
            total = 0.0
            for i in tl.static_range((M + BL - 1) // BL):
                total += tl.load(slots_ptr + i, cache_modifier=".cg")
            tl.store(losses_ptr + s, total * inv_m)
        for i in tl.static_range(1, LAYERS):
            l = LAYERS - i  # dx through W_l (H, H), and W_{l+1}'s update
            w = W1 + (l - 1) * (H * H + H)
            nxt = w + H * H + H
            n_next = OUT if l + 1 == LAYERS else H
            dx_tiles = tl.cdiv(M, BM) * tl.cdiv(H, BN)
            for t in range(pid, dx_tiles + tl.cdiv(H, BR) * tl.cdiv(n_next, BC), programs):
                if t < dx_tiles:
                    _input_grad(grads_ptr + l * MH, p_ptr + w, acts_ptr + (l - 1) * MH, grads_ptr + (l - 1) * MH, t,
                                M, H, H, BM, BN, BK)
                else:
                    _update(acts_ptr + l * MH, rows, grads_ptr + (l + 1) * MH, p_ptr + nxt, p_ptr + nxt + H * n_next,
                            buf_ptr + nxt, buf_ptr + nxt + H * n_next, t - dx_tiles, M, lr, momentum, weight_decay,
                            H, n_next, False, BR, BC, BK, HAS_MOMENTUM, HAS_WEIGHT_DECAY)
            arrivals += programs
            _end_phase(counter_ptr, arrivals, stamps_ptr, pid, programs, STAMPS)
        first_tiles = tl.cdiv(H, BR) * tl.cdiv(N1, BC)  # W_1's, then W_0's (BR0 x BC)
        for t in range(pid, first_tiles + tl.cdiv(IN, BR0) * tl.cdiv(H, BC), programs):
            if t < first_tiles:
                _update(acts_ptr, rows, grads_ptr + MH, p_ptr + W1, p_ptr + W1 + H * N1, buf_ptr + W1,
                        buf_ptr + W1 + H * N1, t, M, lr, momentum, weight_decay, H, N1, False, BR, BC, BK,
                        HAS_MOMENTUM, HAS_WEIGHT_DECAY)
            else:
                _update(x_ptr, rows, grads_ptr, p_ptr, p_ptr + IN * H, buf_ptr, buf_ptr + IN * H, t - first_tiles, M,
                        lr, momentum, weight_decay, IN, H, True, BR0, BC, BK, HAS_MOMENTUM, HAS_WEIGHT_DECAY)
        arrivals += programs
        _end_phase(counter_ptr, arrivals, stamps_ptr, pid, programs, STAMPS)
    if pid == 0:  # every program read the position before the first barrier
        tl.store(pos_ptr, first + steps)


@dataclass
class Plan:
    """A launch of the kernel for one model, dataset and config, with its scratch; `run` launches
    it for a segment of steps from the position the device holds (capturable: it allocates
    nothing and reads no device value on the host)."""

    layout: Layout
    config: dict
    programs: int
    args: dict
    counter: torch.Tensor
    tile_counts: torch.Tensor  # the first layer's split slices' (slice_counts), zero between launches
    stamps: torch.Tensor | None

    def run(self, steps: int) -> None:
        check_segment(self.layout.layers, steps, self.programs, self.stamps)
        self.counter.zero_()
        if compile_only.active():  # plan compiled the kernel already
            return
        _train_kernel[(self.programs,)](**self.args, steps=steps, num_warps=self.config["num_warps"])


def plan(x: torch.Tensor, y: torch.Tensor, batches: torch.Tensor, pos: torch.Tensor, params: torch.Tensor,
         bufs: torch.Tensor | None, losses: torch.Tensor, layout: Layout, *, lr: float, momentum: float = 0.0,
         weight_decay: float = 0.0, config: dict | None = None, stamps: torch.Tensor | None = None) -> Plan:
    """The launch that trains `params` (flat fp32, `layout`'s order; `bufs` likewise, or None
    without momentum) on x[batches[s]], y[batches[s]] for the slots s = *pos, *pos + 1, ... (mod
    the epoch's steps) a run asks for, each step's mean loss into losses[s], and advances *pos.
    x: (images, inputs) in the compute dtype; batches: (epoch's steps, batch) int64, the
    trainer's permutation as rows; pos: an int64 device scalar (trainer.data.DeviceBatches').
    stamps (int64, GPU only): each launch writes the clock (ns) at its start and after each barrier."""
    cfg = resolve_config(config)
    if stamps is not None and rt.interpreting():
        raise ValueError("stamps: Triton's interpreter has no GPU clock to read")
    for name, t in (("x", x), ("y", y), ("batches", batches), ("pos", pos), ("params", params), ("losses", losses)):
        rt.check_device(name, t)
    check_inputs(x, batches, pos, params, bufs, losses, layout, momentum)
    device = x.device
    programs = _programs(cfg, layout, device)
    m, h = layout.batch, layout.hidden
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    tile_counts = torch.zeros(slice_counts(layout, cfg), dtype=torch.int32, device=device)
    split = cfg["SPLIT_K"]
    args = dict(
        x_ptr=x, y_ptr=y, batches_ptr=batches, p_ptr=params, buf_ptr=bufs if momentum else params,
        acts_ptr=torch.empty(layout.activation_elems, dtype=x.dtype, device=device),
        grads_ptr=torch.empty(layout.gradient_elems, dtype=x.dtype, device=device),
        part_ptr=torch.empty(split * m * h if split > 1 else 1, dtype=torch.float32, device=device),
        counts_ptr=tile_counts,
        slots_ptr=torch.empty(triton.cdiv(m, cfg["BL"]), dtype=torch.float32, device=device),
        losses_ptr=losses, counter_ptr=counter, pos_ptr=pos, stamps_ptr=counter if stamps is None else stamps,
        epoch_steps=batches.shape[0], lr=lr, momentum=momentum, weight_decay=weight_decay, inv_m=1.0 / m,
        **constants(layout, cfg, bool(momentum), bool(weight_decay), stamps is not None, programs),
    )
    p = Plan(layout, cfg, programs, args, counter, tile_counts, stamps)
    if device.type == "cuda":
        compiled = _train_kernel.warmup(**args, steps=0, grid=(programs,), num_warps=cfg["num_warps"])
        compiled._init_handles()
        per_sm = blocks_per_sm(compiled.function, 32 * cfg["num_warps"], compiled.metadata.shared)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        check_coresident("persistent kernel", programs, per_sm, sms)
    return p


def constants(layout: Layout, cfg: dict, momentum: bool, weight_decay: bool, stamps: bool, programs: int) -> dict:
    """The kernel's compile-time arguments for a model, a resolved config and its grid. PREFETCH: the
    next step's rows of x sent for into L2 during a step (off under the interpreter, which has no
    inline PTX), AHEAD rows a program, each in LINES points a line apart (enough for 4-byte elements)."""
    tiles = {k: cfg[k] for k in ("BM", "BN", "BK", "BR", "BR0", "BC", "BL", "SPLIT_K")}
    return dict(M=layout.batch, IN=layout.inputs, H=layout.hidden, OUT=layout.classes, LAYERS=layout.layers, **tiles,
                NP=max(16, triton.next_power_of_2(layout.classes)),
                HAS_MOMENTUM=momentum, HAS_WEIGHT_DECAY=weight_decay, STAMPS=stamps,
                PREFETCH=not rt.interpreting(), AHEAD=triton.next_power_of_2(triton.cdiv(layout.batch, programs)),
                LINES=triton.next_power_of_2(triton.cdiv(4 * layout.inputs, 128) + 1))


def _programs(cfg: dict, layout: Layout, device: torch.device) -> int:
    if rt.interpreting():  # programs run one after another: a second would wait at the first barrier forever
        if cfg["PROGRAMS"] > 1:
            raise ValueError(f"config: PROGRAMS={cfg['PROGRAMS']}; Triton's interpreter runs programs one after "
                             "another, so a grid barrier there passes only with 1")
        return 1
    return cfg["PROGRAMS"] or torch.cuda.get_device_properties(device).multi_processor_count
