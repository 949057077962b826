"""3xTF32 with its operands split once, ahead of the GEMM: is the split what keeps it from 2x cuBLAS fp32?
(a GPU machine)

    python -m experiments.tf32x3_split_ahead [--size 4096] [--reps 20] [--only REGEX] [--out CSV]

Both twins' 3xTF32 split each operand tile as it is loaded: every k step, every tile of A and B
becomes a TF32 big part and a small part (x = big + small) in registers, and three tensor-core
products (small x big, big x small, big x big) are summed from zero and added to the fp32
accumulator. On Hopper, Triton's wgmma reads B from shared memory, so B's parts make a round trip
there every k step, outside the pipeline that prefetches the loads; and at 4096^3 with 128-wide
tiles each element of A and B is split 32 times, once per tile that reads it. Split ahead, each
element is split once (an elementwise pass: 2 x 64 MB read, 4 x 64 MB written, about 0.1 ms at
4096^2 per operand pair), and the GEMM's tiles go from memory through the pipelined loads to the
tensor cores as any TF32 GEMM's do, at twice the operand bytes (compute-bound at this size). The
price elsewhere: at the trainer's shapes (M = 128 rows of activations against a weight of H x H)
each weight element is read by one tile only, so there the pass is pure overhead.

Then the same question for a CUDA kernel on Hopper's wgmma (kernels_cuda/matmul_wgmma_tf32x3.cu,
sm_90a): the parts of A and of B^T (wgmma's tf32 form reads both operands k-major), three wgmmas a
k8 step, the fp32 add after every 1 or 4 k slices (WGMMA_SUMS) or never, at WGMMA_TILES; and one
plain TF32 product through the same pipeline, its rate against cuBLAS TF32's; then that kernel as
the CUDA twin's fp32 matmul runs it (WGMMA = 1, 3xTF32: its own split pass, then the GEMM) at every
config its space offers.

Measured on square fp32 matrices of --size, each kernel's product checked against float64 before
it is timed (kernels_core.timing, L2 flushed): cuBLAS fp32 and TF32 (the baselines), the Triton twin's
3xTF32 at its default tiles and at TILES, Triton's own tf32x3 at TILES, one plain TF32 product at TILES
(Triton's TF32 rate on those tiles: three such products bound what a Triton 3xTF32 kernel can reach,
timed whatever its error, which is TF32's), the same with B stored k-major (B^T, contiguous: wgmma's
tf32 form reads B k-major, and a row-major B reaches shared memory 4 bytes a copy to be laid out so),
the split parts read through tensor descriptors (the TMA) at TMA_TILES, B's parts alone split ahead
with A split in registers (wgmma's register A operand) at B_AHEAD_TILES, and the split-ahead kernel
below at TILES: its time with and without the split pass, with the fp32 add after every 1 (the
twins' rule), 2 or 4 k slices (SUMS), on B's parts stored k-major, and with every product carried
in one accumulator, the price of the per-slice sum (biased over a long K, so timed whatever its error). Errors are
norm-wise against float64 and must be no larger than cuBLAS fp32's on the same inputs for a
3xTF32 row to count. Then the Triton twin's own split ahead (SPLIT_AHEAD = 1: its pass, then the
GEMM on k-major parts) at the configs of its space with tiles of 64 or more each way.

-> experiments/results/<gpu>/tf32x3_split_ahead.csv: kernel, tiles, ms (median; p20, p80), tflops,
   vs_cublas_fp32, rel_err (cuBLAS fp32's is its row's), status (less_accurate: worse than cuBLAS fp32,
   not timed; refused: a tile outside the twin's space; out_of_resources: more shared memory than the
   GPU has; failed: the CUDA kernel did not build or launch, which ends its rows), and the provenance
   columns; rewritten as each row is measured, so a run stopped part way keeps what it measured.
"""
from __future__ import annotations

import argparse
import re
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch
import triton
import triton.language as tl

from experiments.paths import results_dir
from kernels_triton.matmul import _split_tf32

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): tiles of large TF32 GEMMs on Hopper (two
# warpgroups of 64 rows, k slices of 16 or 32 fp32) whose four operand parts fit shared memory
# (227 KB: 128 x 256 x 32 on 3 stages wants 288 KB). A tile the twin's space or the GPU refuses
# is a row that says so.
TILES = ((128, 128, 32, 8, 3), (128, 256, 16, 8, 4), (128, 256, 32, 8, 2), (128, 128, 16, 8, 4))
# TILES' kin for the descriptor kernel, whose ring Triton sizes at num_stages + 1 buffers of four
# parts (128 x 128 x 32 on 2 stages: 192 KB).
TMA_TILES = ((128, 128, 32, 8, 2), (128, 128, 16, 8, 4), (128, 128, 16, 8, 3), (128, 64, 32, 4, 3))
# b_ahead_kernel's: A's raw tile and B's two parts a stage (128 x 128 x 32 on 4 stages: 192 KB).
B_AHEAD_TILES = ((128, 128, 32, 8, 3), (128, 128, 32, 8, 4), (128, 64, 32, 4, 4), (128, 256, 32, 8, 2))
SPLIT_BLOCK = 4096
SUMS = (2, 4)  # k slices whose products the tensor cores sum before each fp32 add, beyond the twins' 1
# (BLOCK_M, BLOCK_N, stages, consumer warpgroups) of kernels_cuda/matmul_wgmma_tf32x3.cu, whose
# stages hold the four parts of a 32-wide k slice: 2 x (BM + BN) x 128 bytes each, 192 KB here.
WGMMA_TILES = ((128, 128, 3, 2), (128, 64, 4, 2), (64, 128, 4, 1))
WGMMA_SUMS = (1, 4)  # its SUM: k slices a step accumulator takes before the fp32 add


@triton.jit
def split_kernel(x_ptr, big_ptr, small_ptr, n, BLOCK: tl.constexpr):
    """big, small = the 3xTF32 parts of x (the Triton twin's split, element by element)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    big, small = _split_tf32(tl.load(x_ptr + offs, mask=mask))
    tl.store(big_ptr + offs, big, mask=mask)
    tl.store(small_ptr + offs, small, mask=mask)


@triton.jit
def _grouped(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row, column) of C's tile number `tile` in the grouped order: GROUP_M tile rows column by column."""
    first_m = tile // (GROUP_M * tiles_n) * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % (GROUP_M * tiles_n)) % rows, (tile % (GROUP_M * tiles_n)) // rows


@triton.jit
def _tiles(ptr_a, ptr_b, offs_m, offs_n, ks, M, N, K, stride_bk, stride_bn):
    """The (BLOCK_M x BLOCK_K) tile of A (row-major) and (BLOCK_K x BLOCK_N) tile of B at ks,
    zero outside; B row-major (stride_bn 1) or stored as B^T, k-major (stride_bk 1)."""
    a = tl.load(ptr_a + offs_m[:, None] * K + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
    b = tl.load(ptr_b + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=(ks[:, None] < K) & (offs_n[None, :] < N), other=0.0)
    return a, b


@triton.jit
def _three(a_big, a_small, b_big, b_small, offs_m, offs_n, ks, M, N, K, stride_bk, stride_bn, acc):
    """acc + the three TF32 products of one k slice's parts, in the tensor cores."""
    ab, bb = _tiles(a_big, b_big, offs_m, offs_n, ks, M, N, K, stride_bk, stride_bn)
    as_, bs = _tiles(a_small, b_small, offs_m, offs_n, ks, M, N, K, stride_bk, stride_bn)
    acc = tl.dot(as_, bb, acc, input_precision="tf32")
    acc = tl.dot(ab, bs, acc, input_precision="tf32")
    return tl.dot(ab, bb, acc, input_precision="tf32")


@triton.jit
def split_ahead_kernel(a_big, a_small, b_big, b_small, c_ptr, M, N, K, stride_bk, stride_bn, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SUM: tl.constexpr,
                       PRECISION: tl.constexpr = "tf32x3"):
    """C = A @ B (row-major, contiguous) from A's and B's parts. SUM n >= 1: the products of n k
    slices summed from zero in the tensor cores, then added to the fp32 accumulator (the twins sum
    each slice's so, n = 1); 0: every product carried in the one accumulator (biased over a long K:
    priced here, never used); -1: one Triton dot at PRECISION a slice, a_big and b_big given the fp32
    operands. B's parts row-major, or k-major (B^T's, stride_bk 1): wgmma's tf32 form reads both
    operands k-major from shared memory."""
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SUM < 0:
        for k0 in range(0, K, BLOCK_K):
            a, b = _tiles(a_big, b_big, offs_m, offs_n, k0 + offs_k, M, N, K, stride_bk, stride_bn)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    elif SUM == 0:
        for k0 in range(0, K, BLOCK_K):
            acc = _three(a_big, a_small, b_big, b_small, offs_m, offs_n, k0 + offs_k, M, N, K, stride_bk, stride_bn,
                         acc)
    else:
        # One loop over the slices (slices unrolled SUM at a time would hold SUM times the pipeline's
        # shared memory), the sum handed to the fp32 accumulator after every SUM-th.
        step = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            step = _three(a_big, a_small, b_big, b_small, offs_m, offs_n, k0 + offs_k, M, N, K, stride_bk, stride_bn,
                          step)
            if (k0 // BLOCK_K) % SUM == SUM - 1:
                acc += step  # rounded to nearest, outside the tensor cores
                step = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc += step  # the last group's, where SUM does not divide the slices
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    big, small = torch.empty_like(x), torch.empty_like(x)
    split_kernel[(triton.cdiv(x.numel(), SPLIT_BLOCK),)](x, big, small, x.numel(), BLOCK=SPLIT_BLOCK)
    return big, small


def split_ahead_matmul(a_parts, b_parts, tiles, sum_every: int = 1, out: torch.Tensor | None = None,
                       precision: str = "tf32x3", b_kmajor: bool = False) -> torch.Tensor:
    """A @ B from split parts (contiguous, row-major; with b_kmajor B's are B^T's, N x K) on `tiles`
    (a TILES entry), the fp32 add after every `sum_every` k slices (split_ahead_kernel's SUM; its
    PRECISION where that is -1)."""
    (a_big, a_small), (b_big, b_small) = a_parts, b_parts
    (m, k), n = a_big.shape, b_big.shape[0 if b_kmajor else 1]
    bm, bn, bk, warps, stages = tiles
    out = out if out is not None else torch.empty((m, n), dtype=torch.float32, device=a_big.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    stride_bk, stride_bn = (1, k) if b_kmajor else (n, 1)
    split_ahead_kernel[grid](a_big, a_small, b_big, b_small, out, m, n, k, stride_bk, stride_bn, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             GROUP_M=8, SUM=sum_every, PRECISION=precision, num_warps=warps, num_stages=stages)
    return out


def triton_dot_matmul(a: torch.Tensor, b: torch.Tensor, tiles, precision: str, b_kmajor: bool = False) -> torch.Tensor:
    """A @ B by one Triton dot a k slice at `input_precision=precision` ("tf32x3", Triton's own
    3xTF32, or "tf32") on the fp32 tiles, on `tiles`; with b_kmajor `b` is B^T (N x K, contiguous)."""
    return split_ahead_matmul((a, a), (b, b), tiles, sum_every=-1, precision=precision, b_kmajor=b_kmajor)


@triton.jit
def tma_split_ahead_kernel(a_big, a_small, bt_big, bt_small, c_ptr, M, N, K, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           PROGRAMS: tl.constexpr):
    """split_ahead_kernel's 3xTF32 (the fp32 add after every k slice) with the four parts read through
    tensor descriptors (the TMA on Hopper) rather than pointers: A's parts (M x K) and B^T's (N x K),
    k-major. PROGRAMS > 0: persistent, that many programs walking the tiles; 0: a program a tile."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    first = tl.program_id(0)
    step_tiles = PROGRAMS if PROGRAMS > 0 else tiles
    for tile in tl.range(first, tiles, step_tiles, flatten=True):
        pid_m, pid_n = _grouped(tile, tiles_m, tiles_n, GROUP_M)
        m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ab, as_ = a_big.load([m0, k0]), a_small.load([m0, k0])
            bb, bs = bt_big.load([n0, k0]).T, bt_small.load([n0, k0]).T
            step = tl.dot(as_, bb, input_precision="tf32")
            step = tl.dot(ab, bs, step, input_precision="tf32")
            step = tl.dot(ab, bb, step, input_precision="tf32")
            acc += step
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def tma_split_ahead_matmul(a_parts, bt_parts, tiles, persistent: bool = False) -> torch.Tensor:
    """A @ B by tma_split_ahead_kernel from A's parts and B^T's (contiguous, K a multiple of 4), on
    `tiles` (a TILES entry); persistent: a program an SM."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (a_big, a_small), (b_big, b_small) = a_parts, bt_parts
    (m, k), n = a_big.shape, b_big.shape[0]
    bm, bn, bk, warps, stages = tiles
    descs = [TensorDescriptor.from_tensor(t, [rows, bk]) for t, rows in ((a_big, bm), (a_small, bm), (b_big, bn),
                                                                           (b_small, bn))]
    out = torch.empty((m, n), dtype=torch.float32, device=a_big.device)
    tiles_count = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    # Persistent: a program an SM (under the interpreter 3, so that programs walk several tiles).
    sms = torch.cuda.get_device_properties(a_big.device).multi_processor_count if a_big.is_cuda else 3
    programs = min(sms, tiles_count) if persistent else 0
    tma_split_ahead_kernel[(programs or tiles_count,)](*descs, out, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                        GROUP_M=8, PROGRAMS=programs, num_warps=warps,
                                                        num_stages=stages)
    return out


@triton.jit
def b_ahead_kernel(a_ptr, bt_big, bt_small, c_ptr, M, N, K, stride_am, ld_b, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """3xTF32 with B's parts split ahead (B^T's, k-major, ld_b floats a row) and A split in the kernel:
    A (row-major fp32, k-major already) is loaded as it is and split in registers, which wgmma's tf32
    form takes as its A operand, so no part of A goes back through shared memory and no pass writes
    A's parts. The fp32 add after every k slice, as the twins'."""
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        b_mask = (ks[:, None] < K) & (offs_n[None, :] < N)
        bb = tl.load(bt_big + offs_n[None, :] * ld_b + ks[:, None], mask=b_mask, other=0.0)
        bs = tl.load(bt_small + offs_n[None, :] * ld_b + ks[:, None], mask=b_mask, other=0.0)
        ab, as_ = _split_tf32(a)
        step = tl.dot(as_, bb, input_precision="tf32")
        step = tl.dot(ab, bs, step, input_precision="tf32")
        step = tl.dot(ab, bb, step, input_precision="tf32")
        acc += step
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def twin_parts(x: torch.Tensor, rows: int, k: int, trans: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(big, small, ld): op(x)'s 3xTF32 parts (rows x k; trans: x stores k x rows), k-contiguous, by
    the Triton twin's split pass (kernels_triton/matmul.py: split_ahead)."""
    from kernels_triton import _runtime as kt_rt
    from kernels_triton.matmul import split_ahead

    big, plan = split_ahead(x, rows, k, trans, 3, "fp32", {})
    kt_rt.launch(plan)
    return big, plan.args["big_ptr"][1], plan.args["ld"]


def b_ahead_matmul(a: torch.Tensor, b: torch.Tensor, tiles, bt_parts=None) -> torch.Tensor:
    """A @ B (both row-major, contiguous) by b_ahead_kernel on `tiles` (a TILES entry): B^T's parts by
    the Triton twin's split pass, unless given (twin_parts': the GEMM alone)."""
    (m, k), n = a.shape, b.shape[1]
    big, small, ld = bt_parts or twin_parts(b, n, k, True)
    bm, bn, bk, warps, stages = tiles
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    b_ahead_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        a, big, small, out, m, n, k, a.stride(0), ld, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=warps, num_stages=stages)
    return out


def keep_row(rows: list[dict], row: dict, out) -> None:
    """A row measured: `out` rewritten with every row so far, each product's speed against the
    first's (cuBLAS fp32's; a row without TFLOP/s, a split pass, has none), so a run stopped later (a
    hung kernel, a time limit) keeps what it measured."""
    rows.append(row)
    base = rows[0].get("ms")
    pd.DataFrame([{**r, "vs_cublas_fp32": base / r["ms"] if base and r.get("tflops") is not None else None}
                  for r in rows]).to_csv(out, index=False)


def wgmma_tf32x3_matmul(a_parts, bt_parts, tile, sum_every: int = 1, parts: int = 2) -> torch.Tensor:
    """A @ B by kernels_cuda/matmul_wgmma_tf32x3.cu (sm_90a) from A's parts and B^T's (N x K), all
    contiguous, on `tile` (a WGMMA_TILES entry), the fp32 add after every `sum_every` k slices
    (0: one accumulator); `parts` 1: plain TF32 on the big parts alone (sum_every 0), the
    pipeline's own rate. Persistent, as matmul_wgmma.cu: no more blocks than fit at once."""
    import kernels_cuda as kc
    from kernels_cuda import _runtime as rt, _tma
    from kernels_cuda.matmul import launch_cost

    (a_big, a_small), (b_big, b_small) = a_parts, bt_parts
    (m, k), n = a_big.shape, b_big.shape[0]
    if b_big.shape[1] != k or any(not t.is_contiguous() for t in (a_big, a_small, b_big, b_small)):
        raise ValueError(f"A's parts {tuple(a_big.shape)} and B^T's {tuple(b_big.shape)} must be contiguous, K by K")
    bm, bn, stages, consumers = tile
    maps = [rt.by_value(_tma.tensor_map(_tma.Map2D(t.data_ptr(), rows, k, t.stride(0), box, 4)))
            for t, rows, box in ((a_big, m, bm), (a_small, m, bm), (b_big, n, bn), (b_small, n, bn))]
    c = torch.empty((m, n), dtype=torch.float32, device=a_big.device)
    pairs = int(n % 2 == 0 and c.data_ptr() % 8 == 0)
    variant = rt.Variant("matmul_wgmma_tf32x3.cu", "matmul_wgmma_tf32x3_kernel",
                         (bm, bn, stages, consumers, 8, sum_every, pairs, parts, 0, 0), sm_suffix="a")
    dev = a_big.device.index
    arch = rt.device_props(dev)[0]
    # The twin's own launch cost of the tile (the ring, its alignment, the barriers; the threads).
    cfg = kc.space("matmul", "fp32").resolve({"WGMMA": 1, "TF32": 3 if parts == 2 else 1, "BLOCK_M": bm, "BLOCK_N": bn,
                                              "BLOCK_K": 32, "num_stages": stages, "num_warps": 4 * consumers}, 4, arch)
    threads, smem = launch_cost("fp32", cfg, arch)
    blocks = rt.persistent_blocks(dev, triton.cdiv(m, bm) * triton.cdiv(n, bn), smem)
    rt.launch(variant, dev, (blocks, 1, 1), (threads, 1, 1),
              (*maps, rt.ptr(None), rt.ptr(c), rt.i32(m), rt.i32(n), rt.i32(k)), smem,
              for_=("matmul_wgmma_tf32x3", "fp32", (*tile, sum_every, parts)))
    return c


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tf32x3_split_ahead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4096, help="M = N = K (default 4096)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions a kernel (default 20)")
    p.add_argument("--out", default=None, help="CSV to write (default experiments/results/<gpu>/tf32x3_split_ahead.csv)")
    p.add_argument("--only", type=re.compile, default=None, metavar="REGEX",
                   help="time only the kernels whose name matches (cuBLAS's rows always)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("no CUDA device: the kernels are timed on a GPU")
    from autotune.workload import check_result
    from kernels_core.provenance import provenance
    from kernels_core.timing import bench
    from kernels_triton import matmul as triton_matmul

    s = args.size
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn((s, s), device="cuda", generator=gen) for _ in range(2))
    bt = b.t().contiguous()  # B stored k-major, as wgmma's tf32 form reads it
    a_parts, b_parts, bt_parts = split(a), split(b), split(bt)  # the operands split once, for the GEMMs alone
    ref = a.double() @ b.double()
    flop = 2 * s ** 3
    rows, prov = [], provenance()
    out = Path(args.out) if args.out else results_dir() / "tf32x3_split_ahead.csv"
    out.parent.mkdir(parents=True, exist_ok=True)

    keep = partial(keep_row, rows, out=out)

    def timed(kernel: str, tiles: str, fn, precise: bool = True, flops: bool = True) -> dict | None:
        """fn's product checked against float64 (a 3xTF32 one `precise`: no worse than cuBLAS fp32's,
        the first row), then timed; fn returning None is a pass with nothing to check (`flops`
        False: no product, no TFLOP/s). A kernel --only leaves out is skipped."""
        if args.only and not kernel.startswith("cublas") and not args.only.search(kernel):
            return None
        try:
            c = fn()
        except (ValueError, triton.runtime.errors.OutOfResources) as exc:  # the twin's space; shared memory
            status = "refused" if isinstance(exc, ValueError) else "out_of_resources"
            keep({**prov, "kernel": kernel, "tiles": tiles, "size": s, "status": status})
            print(f"{kernel:24} {tiles:20} {status}: {str(exc).splitlines()[0]}", flush=True)
            return None
        err = None if c is None else check_result([c], [ref])[0]  # norm-wise; inf for a NaN or Inf
        row = {**prov, "kernel": kernel, "tiles": tiles, "rel_err": err, "size": s}
        if precise and rows and err is not None and err > rows[0]["rel_err"]:
            row["status"] = "less_accurate"
        else:
            t = bench(fn, reps=args.reps, max_seconds=10.0)
            row.update(status="ok", ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms,
                       tflops=flop / t.median_ms / 1e9 if flops else None)
        keep(row)
        print(f"{kernel:24} {tiles:20} {row.get('ms', float('nan')):8.3f} ms  rel_err "
              f"{'-' if err is None else f'{err:.3g}'}  {row['status']}", flush=True)
        return row

    torch.backends.cuda.matmul.allow_tf32 = False
    timed("cublas_fp32", "", lambda: a @ b)
    torch.backends.cuda.matmul.allow_tf32 = True
    timed("cublas_tf32", "", lambda: a @ b, precise=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    timed("split_pass", "", lambda: (split(a), split(b)) and None, flops=False)
    timed("triton_twin_3xtf32", "default", lambda: triton_matmul(a, b, config={"TF32": 3}))
    for tiles in TILES:
        bm, bn, bk, warps, stages = tiles
        label = f"{bm}x{bn}x{bk} w{warps} s{stages}"
        cfg = {"TF32": 3, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        timed("triton_twin_3xtf32", label, lambda: triton_matmul(a, b, config=cfg))
        timed("triton_tf32x3", label, lambda: triton_dot_matmul(a, b, tiles, "tf32x3"))
        timed("triton_tf32", label, lambda: triton_dot_matmul(a, b, tiles, "tf32"), precise=False)
        timed("triton_tf32_kmajor_b", label, lambda: triton_dot_matmul(a, bt, tiles, "tf32", b_kmajor=True),
              precise=False)
        timed("split_ahead_gemm", label, lambda: split_ahead_matmul(a_parts, b_parts, tiles))
        timed("split_ahead_kmajor_b_gemm", label, lambda: split_ahead_matmul(a_parts, bt_parts, tiles, b_kmajor=True))

        timed("split_ahead_with_pass", label, lambda: split_ahead_matmul(split(a), split(b), tiles))
        for every in SUMS:
            timed(f"split_ahead_sum_every_{every}", label, lambda: split_ahead_matmul(a_parts, b_parts, tiles, every))
        # The price of the per-slice sum: every product carried in one accumulator, whose error over a
        # long K grows like K (experiments/FINDINGS.md, "fp32 on TF32 tensor cores"): timed, not used.
        timed("split_ahead_one_accumulator", label, lambda: split_ahead_matmul(a_parts, b_parts, tiles, 0),
              precise=False)
    # B's parts split ahead, A split in the kernel (in registers, wgmma's A operand).
    b_ahead = twin_parts(b, s, s, True)
    for tiles in B_AHEAD_TILES:
        label = "{}x{}x{} w{} s{}".format(*tiles)
        timed("b_ahead_a_in_registers_gemm", label, lambda: b_ahead_matmul(a, b, tiles, b_ahead))
        timed("b_ahead_a_in_registers_with_pass", label, lambda: b_ahead_matmul(a, b, tiles))
    # The parts (A's, B^T's) through tensor descriptors: the TMA's loads, as the CUDA kernel's.
    for tiles in TMA_TILES:
        label = "{}x{}x{} w{} s{}".format(*tiles)
        for persistent in (False, True):
            timed("split_ahead_tma_persistent_gemm" if persistent else "split_ahead_tma_gemm", label,
                  lambda: tma_split_ahead_matmul(a_parts, bt_parts, tiles, persistent))
    # The Triton twin's fp32 matmul with SPLIT_AHEAD = 1 in 3xTF32 (its own split pass, then the GEMM
    # on k-major parts) at every config of its space with tiles of 64 rows and columns or more.
    import kernels_triton as kt

    # A's parts, and B^T's from the row-major B
    timed("triton_twin_split_pass", "", lambda: (twin_parts(a, s, s, False), twin_parts(b, s, s, True)) and None,
          flops=False)
    space = kt.space("matmul", "fp32")
    for cfg in space.configs(4, 90):
        if (cfg["SPLIT_AHEAD"] and cfg["TF32"] == 3 and cfg["SPLIT_K"] == 1 and cfg["GROUP_M"] == 8
                and min(cfg["BLOCK_M"], cfg["BLOCK_N"]) >= 64 and space.cost(cfg, 4, 90)["smem_bytes"] <= 232448):
            label = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**cfg)
            timed("triton_twin_split_ahead", label, lambda: kt.matmul(a, b, config=cfg))
    # Last: a CUDA kernel that fails to build or launch stops the CUDA rows, not the run's CSV.
    try:
        if torch.cuda.get_device_capability() != (9, 0):
            raise ValueError("matmul_wgmma_tf32x3.cu is built for sm_90a")
        def transposed(x):  # B^T's parts: wgmma's tf32 form reads both operands k-major
            return split(x.t().contiguous())

        timed("wgmma_split_pass", "", lambda: (split(a), transposed(b)) and None, flops=False)
        for tile in WGMMA_TILES:
            label = "{}x{}x32 s{} c{}".format(*tile)
            for every in WGMMA_SUMS:
                name = "wgmma_tf32x3_gemm" if every == 1 else f"wgmma_tf32x3_sum_every_{every}"
                timed(name, label, lambda: wgmma_tf32x3_matmul(a_parts, bt_parts, tile, every))
            timed("wgmma_tf32x3_with_pass", label, lambda: wgmma_tf32x3_matmul(split(a), transposed(b), tile))
            timed("wgmma_tf32x3_one_accumulator", label, lambda: wgmma_tf32x3_matmul(a_parts, bt_parts, tile, 0),
                  precise=False)
            # One TF32 product through the same pipeline (TF32's error): its rate against cuBLAS TF32's
            # says whether the pipeline or the threefold work sets 3xTF32's time.
            bigs = ((a_parts[0], a_parts[0]), (bt_parts[0], bt_parts[0]))
            timed("wgmma_tf32_plain", label, lambda: wgmma_tf32x3_matmul(*bigs, tile, 0, parts=1), precise=False)
        # The same kernel as the CUDA twin runs it (fp32 matmul, WGMMA = 1, 3xTF32): its split pass
        # (A's parts and B^T's, written k-contiguous in one pass each) and GEMM, at every config its
        # space offers.
        import kernels_cuda as kc
        from kernels_cuda.matmul import tf32_parts

        dev = a.device.index
        timed("cuda_twin_split_pass", "", lambda: (tf32_parts(a, s, s, s, 1, 2, dev),
                                                   tf32_parts(b, s, s, 1, s, 2, dev)) and None, flops=False)
        for cfg in (c for c in kc.space("matmul", "fp32").configs(4, 90) if c["WGMMA"] and c["TF32"] == 3):
            label = "{}x{}x32 s{} c{} g{}".format(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"] // 4,
                                                  cfg["GROUP_M"])
            timed("cuda_twin_wgmma_3xtf32", label, lambda: kc.matmul(a, b, config=cfg))
    except Exception as exc:  # noqa: BLE001  recorded as the row that failed
        keep({**prov, "kernel": "wgmma_tf32x3", "size": s, "status": f"failed: {type(exc).__name__}: {exc}"[:300]})
        print(rows[-1]["status"], flush=True)
    print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
