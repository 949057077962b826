"""Many training steps of the MLP in one launch: the persistent training kernel.

The fused step (trainer/model.py) runs 3 GEMM kernels a layer; at H = 128 each is bound by its
latency, not its work (a few µs each for well under 1 µs of arithmetic). Here one grid of
programs stays resident for a whole segment of steps and walks each step's phases itself, a grid
barrier between phases, so a phase costs its work and one barrier (about 0.9 µs on the H200 at
132 programs: experiments/grid_barrier.py) instead of a kernel's launch, ramp and tail. A step of
784 -> H x layers -> 10 (kernels_core/persistent.py's Layout: weights W_0 .. W_L, L = layers):

    forward   A_1 = relu(x[rows] @ W_0 + b_0), A_{l+1} = relu(A_l @ W_l + b_l)   tiles of BM x BN
    loss      D_L = (softmax(A_L @ W_L + b_L) - onehot) / B, each row block's summed loss in a slot
    backward  for l = L .. 0: one program owns BR rows of W_l (all its columns, BC at a time), so
              it reads those rows for D_{l-1} = (D_l @ W_l^T) * (A_l > 0) and then updates them
              with x^T dy = A_l[:, rows]^T @ D_l (optim.py's sgd_rule): no barrier between the
              two, because no other program reads the rows it writes in this phase.

2L + 2 barriers a step (6 for the default protocol's 784-H-H-10, 8 for the seed's). The first
backward phase also sums the loss slots, in slot order (the same bits on every run), into the
step's entry of `losses`. The batch's rows come from `batches[step]` (the trainer's epoch
permutation as rows of B), the labels from y[rows]; the dataset is read in place.

Where things live: the weights and momentum buffers in the flat fp32 buffers the trainer keeps
(L2-resident: 467 KB for H = 128), the activations and gradients in a scratch of B x H a layer.
What one program writes and another reads later in the launch is seen because of the barrier: its
acquire poll compiles, on sm_90, to an invalidation of the multiprocessor's L1 (`CCTL.IVALL`), so no
line cached before the writers' stores survives it. Those loads ask for `.cg` (L2 only) too, but
Triton's pipeliner turns the ones that feed a dot into `cp.async` copies through L1, so the barrier
is what holds; a program's own rows of W are read and written only by it. The rounding
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

from kernels_core.persistent import (Layout, blocks_per_sm, check_barrier_count, check_coresident, check_inputs,
                                     resolve_config)

from . import _runtime as rt
from .matmul import _dot
from .optim import sgd_rule


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
def _linear_tile(a_ptr, src, in_m, w_ptr, b_ptr, offs_n, in_n, N: tl.constexpr, K: tl.constexpr,
                 GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """(a[src] @ w + b)[:, offs_n] in fp32, a (*, K), w (K, N): a tile of a forward layer or of the
    logits."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        in_k = offs_k < K
        a = _load_a(a_ptr, src, offs_k, in_m[:, None] & in_k[None, :], K, GATHER)
        w = tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :], mask=in_k[:, None] & in_n[None, :], other=0.0,
                    cache_modifier=".cg")
        acc = _dot(a, w.to(a.dtype), acc, tl.float32, 0)
    return acc + tl.load(b_ptr + offs_n, mask=in_n, other=0.0, cache_modifier=".cg")[None, :]


@triton.jit
def _forward(a_ptr, rows_ptr, w_ptr, b_ptr, out_ptr, M, pid, programs,
             N: tl.constexpr, K: tl.constexpr, GATHER: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out = relu(a[rows] @ w + b), a (M, K) (GATHER: rows of the dataset), w (K, N)."""
    tiles_n = tl.cdiv(N, BN)
    for t in range(pid, tl.cdiv(M, BM) * tiles_n, programs):
        offs_m = (t // tiles_n) * BM + tl.arange(0, BM)
        offs_n = (t % tiles_n) * BN + tl.arange(0, BN)
        in_m, in_n = offs_m < M, offs_n < N
        if GATHER:
            src = tl.load(rows_ptr + offs_m, mask=in_m, other=0)
        else:
            src = offs_m
        acc = tl.maximum(_linear_tile(a_ptr, src, in_m, w_ptr, b_ptr, offs_n, in_n, N, K, GATHER, BM, BN, BK), 0.0)
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _loss(a_ptr, w_ptr, b_ptr, y_ptr, rows_ptr, d_ptr, slots_ptr, M, inv_m, pid, programs,
          N: tl.constexpr, K: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr):
    """logits = a @ w + b (rounded to a's dtype, as the fused step stores them), then d = (softmax
    - onehot(y[rows])) / M in a's dtype, and each block of BL rows' summed loss into its slot."""
    offs_n = tl.arange(0, NP)
    in_n = offs_n < N
    for t in range(pid, tl.cdiv(M, BL), programs):
        offs_m = t * BL + tl.arange(0, BL)
        in_m = offs_m < M
        acc = _linear_tile(a_ptr, offs_m, in_m, w_ptr, b_ptr, offs_n, in_n, N, K, False, BL, NP, BK)
        logits = acc.to(d_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(in_n[None, :], logits, float("-inf"))
        top = tl.max(logits, axis=1)
        e = tl.exp(logits - top[:, None])
        total = tl.sum(e, axis=1)
        rows = tl.load(rows_ptr + offs_m, mask=in_m, other=0)
        label = tl.load(y_ptr + rows, mask=in_m, other=0)
        hit = offs_n[None, :] == label[:, None]
        loss = top + tl.log(total) - tl.sum(tl.where(hit, logits, 0.0), axis=1)
        d = (e / total[:, None] - tl.where(hit, 1.0, 0.0)) * inv_m
        tl.store(d_ptr + offs_m[:, None] * N + offs_n[None, :], d.to(d_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_n[None, :])
        tl.store(slots_ptr + t, tl.sum(tl.where(in_m, loss, 0.0), axis=0))


@triton.jit
def _backward(a_ptr, rows_ptr, d_ptr, w_ptr, b_ptr, w_buf_ptr, b_buf_ptr, dx_ptr, M, lr, momentum, weight_decay,
              pid, programs, K: tl.constexpr, N: tl.constexpr, GATHER: tl.constexpr, DX: tl.constexpr,
              BB: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
              HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr):
    """For the layer a (M, K) -> (M, N) with weights w (K, N) and output gradient d (M, N): DX,
    dx = (d @ w^T) * (a > 0) (its input's gradient through the relu that made a); then SGD on w
    with a^T @ d and on b with d's column sums. A program owns BR rows of w: it reads each BC
    columns of them for dx before it updates them."""
    offs_b = tl.arange(0, BB)
    in_b = offs_b < M
    if GATHER:
        src = tl.load(rows_ptr + offs_b, mask=in_b, other=0)
    else:
        src = offs_b
    for t in range(pid, tl.cdiv(K, BR), programs):
        offs_r = t * BR + tl.arange(0, BR)
        in_r = offs_r < K
        a = _load_a(a_ptr, src, offs_r, in_b[:, None] & in_r[None, :], K, GATHER)
        a_t = tl.trans(a)
        dx = tl.zeros((BB, BR), dtype=tl.float32)
        for c0 in range(0, N, BC):
            offs_c = c0 + tl.arange(0, BC)
            in_c = offs_c < N
            d = tl.load(d_ptr + offs_b[:, None] * N + offs_c[None, :], mask=in_b[:, None] & in_c[None, :], other=0.0,
                        cache_modifier=".cg")
            w_ptrs = w_ptr + offs_r[:, None] * N + offs_c[None, :]
            in_w = in_r[:, None] & in_c[None, :]
            if DX:
                w = tl.load(w_ptrs, mask=in_w, other=0.0)  # this program's own rows: before its update
                dx = _dot(d, tl.trans(w.to(d.dtype)), dx, tl.float32, 0)
            g = _dot(a_t, d, tl.zeros((BR, BC), dtype=tl.float32), tl.float32, 0)
            sgd_rule(g, w_ptrs, w_buf_ptr + offs_r[:, None] * N + offs_c[None, :], w_ptrs, in_w, lr, momentum,
                     weight_decay, HAS_MOMENTUM, HAS_WEIGHT_DECAY, False)
            if t == 0:  # the bias's owner
                gb = tl.sum(d.to(tl.float32), axis=0)
                sgd_rule(gb, b_ptr + offs_c, b_buf_ptr + offs_c, b_ptr + offs_c, in_c, lr, momentum, weight_decay,
                         HAS_MOMENTUM, HAS_WEIGHT_DECAY, False)
        if DX:
            dx = tl.where(a > 0, dx, 0.0)
            tl.store(dx_ptr + offs_b[:, None] * K + offs_r[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=in_b[:, None] & in_r[None, :])


@triton.jit(do_not_specialize=["steps", "epoch_steps"])  # one compile for every segment
def _train_kernel(
    x_ptr, y_ptr, batches_ptr, p_ptr, buf_ptr, acts_ptr, grads_ptr, slots_ptr, losses_ptr, counter_ptr, pos_ptr,
    steps, epoch_steps, lr, momentum, weight_decay, inv_m,
    M: tl.constexpr, IN: tl.constexpr, H: tl.constexpr, OUT: tl.constexpr, LAYERS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BL: tl.constexpr,
    BB: tl.constexpr, NP: tl.constexpr, HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
):
    """`steps` steps from the epoch's slot *pos_ptr on (wrapping at epoch_steps), then *pos_ptr +=
    steps (the module docstring)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    first = tl.load(pos_ptr)
    w0, b0 = 0, IN * H  # Layout.offsets: W_0, b_0, then (H x H + H) a hidden layer, then W_L, b_L
    w_last = IN * H + H + (LAYERS - 1) * (H * H + H)
    b_last = w_last + H * OUT
    d_last = grads_ptr + LAYERS * M * H
    arrivals = 0
    for step in range(steps):
        s = (first + step) % epoch_steps
        rows = batches_ptr + s * M
        _forward(x_ptr, rows, p_ptr + w0, p_ptr + b0, acts_ptr, M, pid, programs, H, IN, True, BM, BN, BK)
        arrivals += programs
        grid_barrier(counter_ptr, arrivals)
        for l in tl.static_range(1, LAYERS):
            w = IN * H + H + (l - 1) * (H * H + H)
            _forward(acts_ptr + (l - 1) * M * H, rows, p_ptr + w, p_ptr + w + H * H, acts_ptr + l * M * H, M, pid,
                     programs, H, H, False, BM, BN, BK)
            arrivals += programs
            grid_barrier(counter_ptr, arrivals)
        _loss(acts_ptr + (LAYERS - 1) * M * H, p_ptr + w_last, p_ptr + b_last, y_ptr, rows, d_last, slots_ptr, M,
              inv_m, pid, programs, OUT, H, BL, BK, NP)
        arrivals += programs
        grid_barrier(counter_ptr, arrivals)
        if pid == 0:  # the step's loss: the row blocks' sums in slot order
            total = 0.0
            for i in range(tl.cdiv(M, BL)):
                total += tl.load(slots_ptr + i, cache_modifier=".cg")
            tl.store(losses_ptr + s, total * inv_m)
        _backward(acts_ptr + (LAYERS - 1) * M * H, rows, d_last, p_ptr + w_last, p_ptr + b_last, buf_ptr + w_last,
                  buf_ptr + b_last, grads_ptr + (LAYERS - 1) * M * H, M, lr, momentum, weight_decay, pid, programs,
                  H, OUT, False, True, BB, BR, BC, HAS_MOMENTUM, HAS_WEIGHT_DECAY)
        arrivals += programs
        grid_barrier(counter_ptr, arrivals)
        for i in tl.static_range(1, LAYERS):
            l = LAYERS - i  # hidden layers, last first: W_l (H, H) between A_l and A_{l+1}
            w = IN * H + H + (l - 1) * (H * H + H)
            _backward(acts_ptr + (l - 1) * M * H, rows, grads_ptr + l * M * H, p_ptr + w, p_ptr + w + H * H,
                      buf_ptr + w, buf_ptr + w + H * H, grads_ptr + (l - 1) * M * H, M, lr, momentum, weight_decay,
                      pid, programs, H, H, False, True, BB, BR, BC, HAS_MOMENTUM, HAS_WEIGHT_DECAY)
            arrivals += programs
            grid_barrier(counter_ptr, arrivals)
        _backward(x_ptr, rows, grads_ptr, p_ptr + w0, p_ptr + b0, buf_ptr + w0, buf_ptr + b0, grads_ptr, M, lr,
                  momentum, weight_decay, pid, programs, IN, H, True, False, BB, BR, BC, HAS_MOMENTUM,
                  HAS_WEIGHT_DECAY)
        arrivals += programs
        grid_barrier(counter_ptr, arrivals)
    if pid == 0:  # every program read the position before the first barrier
        tl.store(pos_ptr, first + steps)


def barriers_per_step(layers: int) -> int:
    """Grid barriers of one step: one after each phase (the module docstring)."""
    return 2 * layers + 2


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

    def run(self, steps: int) -> None:
        check_barrier_count(steps, self.layout, self.programs)
        self.counter.zero_()
        _train_kernel[(self.programs,)](**self.args, steps=steps, num_warps=self.config["num_warps"])


def plan(x: torch.Tensor, y: torch.Tensor, batches: torch.Tensor, pos: torch.Tensor, params: torch.Tensor,
         bufs: torch.Tensor | None, losses: torch.Tensor, layout: Layout, *, lr: float, momentum: float = 0.0,
         weight_decay: float = 0.0, config: dict | None = None) -> Plan:
    """The launch that trains `params` (flat fp32, `layout`'s order; `bufs` likewise, or None
    without momentum) on x[batches[s]], y[batches[s]] for the slots s = *pos, *pos + 1, ... (mod
    the epoch's steps) a run asks for, each step's mean loss into losses[s], and advances *pos.
    x: (images, inputs) in the compute dtype; batches: (epoch's steps, batch) int64, the
    trainer's permutation as rows; pos: an int64 device scalar (trainer.data.DeviceBatches')."""
    cfg = resolve_config(config)
    for name, t in (("x", x), ("y", y), ("batches", batches), ("pos", pos), ("params", params), ("losses", losses)):
        rt.check_device(name, t)
    check_inputs(x, batches, pos, params, bufs, losses, layout, momentum)
    device = x.device
    programs = _programs(cfg, layout, device)
    m, h = layout.batch, layout.hidden
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    args = dict(
        x_ptr=x, y_ptr=y, batches_ptr=batches, p_ptr=params, buf_ptr=bufs if momentum else params,
        acts_ptr=torch.empty(layout.activation_elems, dtype=x.dtype, device=device),
        grads_ptr=torch.empty(layout.gradient_elems, dtype=x.dtype, device=device),
        slots_ptr=torch.empty(triton.cdiv(m, cfg["BL"]), dtype=torch.float32, device=device),
        losses_ptr=losses, counter_ptr=counter, pos_ptr=pos, epoch_steps=batches.shape[0], lr=lr, momentum=momentum, weight_decay=weight_decay, inv_m=1.0 / m,
        M=m, IN=layout.inputs, H=h, OUT=layout.classes, LAYERS=layout.layers,
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], BR=cfg["BR"], BC=cfg["BC"], BL=cfg["BL"],
        BB=max(16, triton.next_power_of_2(m)), NP=max(16, triton.next_power_of_2(layout.classes)),
        HAS_MOMENTUM=bool(momentum), HAS_WEIGHT_DECAY=bool(weight_decay),
    )
    p = Plan(layout, cfg, programs, args, counter)
    if device.type == "cuda":
        compiled = _train_kernel.warmup(**args, steps=0, grid=(programs,), num_warps=cfg["num_warps"])
        compiled._init_handles()
        per_sm = blocks_per_sm(compiled.function, 32 * cfg["num_warps"], compiled.metadata.shared)
        check_coresident("persistent kernel", programs, per_sm, torch.cuda.get_device_properties(device).multi_processor_count)
    return p


def _programs(cfg: dict, layout: Layout, device: torch.device) -> int:
    if rt.interpreting():  # programs run one after another: a second would wait at the first barrier forever
        if cfg["PROGRAMS"] > 1:
            raise ValueError(f"config: PROGRAMS={cfg['PROGRAMS']}; Triton's interpreter runs programs one after "
                             "another, so a grid barrier there passes only with 1")
        return 1
    return cfg["PROGRAMS"] or torch.cuda.get_device_properties(device).multi_processor_count
