"""Matrix multiplication with a fused bias + ReLU epilogue.

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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_core import contract
from kernels_core.contract import cdiv
from kernels_core.space import Space
from kernels_core.workspace import splitk_slices, splitk_workspace

from . import _runtime as rt


@triton.jit
def _epilogue(out, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
              HAS_BIAS: tl.constexpr, RELU: tl.constexpr):
    """Bias, ReLU and the store of one fp32 tile of C: applied once per tile."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        out += bias.to(tl.float32)[None, :]
    if RELU:
        out = tl.where(out < 0, 0.0, out)  # NaN < 0 is false: NaN passes through
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, partials_ptr, counters_ptr,
    M, N, K, K_SLICE,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, RELU: tl.constexpr, ACC_FP16: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
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
    a_ptrs = a_ptr + ((offs_m % M)[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak)
    b_ptrs = b_ptr + ((k_start + offs_k)[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn)

    acc_dtype = tl.float16 if ACC_FP16 else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        k_left = k_len - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            # Triton's interpreter (3.9) returns garbage for bf16 x bf16 dots;
            # fp32 tiles hold bf16 values exactly, so the product is unchanged.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # "ieee" keeps fp32 inputs exact (no TF32); it does not affect fp16/bf16.
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc_dtype)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SPLIT_K == 1:
        _epilogue(acc.to(tl.float32), c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
                  HAS_BIAS, RELU)
    else:
        # Rows and columns past M and N are stored too (wrapped values that
        # never reach C), so the partial needs no mask.
        tile_elems = BLOCK_M * BLOCK_N
        offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ptr = partials_ptr + pid * (SPLIT_K * tile_elems)
        tl.store(tile_ptr + tl.program_id(1) * tile_elems + offs_tile, acc.to(tl.float32))
        # All threads' stores before the one thread's release (see the module
        # docstring). Triton 3.9 happens to put a barrier there for its own
        # shared-memory reuse; this one does not depend on that.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # Last of the tile: every partial is visible (acquire, then ".cg"
            # reads from L2), summed in slice order whoever this program is.
            out = tl.load(tile_ptr + offs_tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                out += tl.load(tile_ptr + s * tile_elems + offs_tile, cache_modifier=".cg")
            tl.store(counters_ptr + pid, 0)  # zero again for the next call: nothing else reads it in this one
            _epilogue(out, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
                      HAS_BIAS, RELU)


# num_stages 2 and 5 and num_warps 1 are left out to keep the space small and
# dense (the tuner draws each tunable on its own; its first draws are random,
# so the share of valid configs matters): in a full grid over this space on
# the H200 (experiments/results/search_quality_grid_h200.csv, fp16) 2 stages
# were a third slower than 3 or 4 at both 4096^3 and 128x1024x784; 5 never won.
_PARAMS = {
    "BLOCK_M": (16, 32, 64, 128, 256),
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (32, 64, 128),
    "GROUP_M": (1, 8),
    "num_warps": (2, 4, 8),
    "num_stages": (3, 4),
    "SPLIT_K": (1, 2, 4, 8, 16),
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
    # A slice is a whole number of BLOCK_K steps: at K = 784, 128-wide steps
    # would leave 9 of SPLIT_K = 16 slices empty (64-wide: 3).
    "SPLIT_K == 1 or BLOCK_K <= 64",
    # No GPU offers more than 227 KiB per block; larger rings fit nowhere.
    "(BLOCK_M + BLOCK_N) * BLOCK_K * elt * num_stages <= 232448",
)
_SMEM = "(BLOCK_M + BLOCK_N) * BLOCK_K * elt * num_stages"
_NOTES = ("threads = 32 * num_warps; smem_bytes counts the operand ring only "
          "(Triton may reuse it for the epilogue)")

SPACES = {
    # Hopper's sweet spot for 16-bit inputs: a 128x256 tile over two warpgroups.
    "fp16": Space(
        params=_PARAMS,
        default=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
        restrictions=_RESTRICTIONS, smem_bytes=_SMEM, notes=_NOTES,
    ),
    "bf16": Space(
        params=_PARAMS,
        default=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1),
        restrictions=_RESTRICTIONS + ("arch >= 80  # bf16 tensor cores start at sm_80",),
        smem_bytes=_SMEM, notes=_NOTES,
    ),
    # Exact fp32 runs on the FMA units, where register pressure, not shared
    # memory, bounds the tile.
    "fp32": Space(
        params=_PARAMS,
        default=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=1),
        restrictions=_RESTRICTIONS, smem_bytes=_SMEM, notes=_NOTES,
    ),
}

_MAX_I32 = 2**31 - 1


def _span(t: torch.Tensor) -> int:
    """Largest element offset the kernel computes into `t` (in 32-bit math)."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def plan(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
         accumulate="fp32") -> tuple[torch.Tensor, rt.Plan | None]:
    M, N, K = contract.matmul_args(a, b, bias, activation, trans_a, trans_b, accumulate)
    rt.check_device("a", a)
    out = contract.output("out", out, (M, N), a.dtype, a.device, contiguous=False)
    dtype = contract.dtype_name(a.dtype)
    cfg = rt.resolve(SPACES[dtype], config, a.element_size(), a.device)
    if M == 0 or N == 0:
        return out, None
    for name, t in (("a", a), ("b", b), ("out", out)):
        if _span(t) > _MAX_I32:
            raise ValueError(f"{name}: spans more than 2**31 elements; the kernel uses 32-bit offsets")
    stride_am, stride_ak = (a.stride(1), a.stride(0)) if trans_a else (a.stride(0), a.stride(1))
    stride_bk, stride_bn = (b.stride(1), b.stride(0)) if trans_b else (b.stride(0), b.stride(1))
    constexprs = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    # The kernel's SPLIT_K is the number of slices that hold any K: empty ones are not launched.
    k_slice, split_k = splitk_slices(K, cfg["SPLIT_K"], cfg["BLOCK_K"])
    constexprs["SPLIT_K"] = split_k
    partials = counters = out  # placeholders: SPLIT_K == 1 compiles no access to them
    if split_k > 1:
        partial_elems = tiles * split_k * cfg["BLOCK_M"] * cfg["BLOCK_N"]
        if partial_elems > _MAX_I32:
            raise ValueError(f"config: SPLIT_K={cfg['SPLIT_K']} needs {partial_elems} partial sums for a {M}x{N} "
                             "output, more than 2**31; the kernel uses 32-bit offsets")
        partials, counters = splitk_workspace(a.device, partial_elems, tiles)
    args = dict(
        a_ptr=a, b_ptr=b, c_ptr=out, bias_ptr=bias if bias is not None else out,
        partials_ptr=partials, counters_ptr=counters,
        M=M, N=N, K=K, K_SLICE=k_slice,
        stride_am=stride_am, stride_ak=stride_ak, stride_bk=stride_bk, stride_bn=stride_bn,
        stride_cm=out.stride(0), stride_cn=out.stride(1), stride_bias=bias.stride(0) if bias is not None else 1,
        HAS_BIAS=bias is not None, RELU=activation == "relu", ACC_FP16=accumulate == "fp16",
        UPCAST=a.device.type == "cpu" and a.dtype == torch.bfloat16,  # CPU tensors: the interpreter
        **constexprs,
    )
    grid = (tiles, split_k)
    return out, rt.Plan("matmul", dtype, cfg, _matmul_kernel, grid, args, cfg["num_warps"], cfg["num_stages"])


def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
           accumulate="fp32"):
    out, p = plan(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b, out=out,
                  config=config, accumulate=accumulate)
    if p is not None:
        rt.launch(p)
    return out
