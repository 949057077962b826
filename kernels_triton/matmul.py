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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_core import contract
from kernels_core.space import Space

from . import _runtime as rt


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, RELU: tl.constexpr, ACC_FP16: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last group may be short
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + ((offs_m % M)[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn)

    acc_dtype = tl.float16 if ACC_FP16 else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
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

    out = acc.to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        out += bias.to(tl.float32)[None, :]
    if RELU:
        out = tl.where(out < 0, 0.0, out)  # NaN < 0 is false: NaN passes through
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_PARAMS = {
    "BLOCK_M": (32, 64, 128, 256),
    "BLOCK_N": (32, 64, 128, 256),
    "BLOCK_K": (32, 64, 128),
    "GROUP_M": (1, 8),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}
_RESTRICTIONS = (
    # The fp32 accumulator lives in registers: at most 128 per thread.
    "BLOCK_M * BLOCK_N <= 128 * 32 * num_warps",
    # Fewer than 16 outputs per thread leaves the tensor cores starved.
    "BLOCK_M * BLOCK_N >= 16 * 32 * num_warps",
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
        default=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        restrictions=_RESTRICTIONS, smem_bytes=_SMEM, notes=_NOTES,
    ),
    "bf16": Space(
        params=_PARAMS,
        default=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        restrictions=_RESTRICTIONS + ("arch >= 80  # bf16 tensor cores start at sm_80",),
        smem_bytes=_SMEM, notes=_NOTES,
    ),
    # Exact fp32 runs on the FMA units, where register pressure, not shared
    # memory, bounds the tile.
    "fp32": Space(
        params=_PARAMS,
        default=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
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
    tiles = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    grid = (rt.cdiv(M, cfg["BLOCK_M"]) * rt.cdiv(N, cfg["BLOCK_N"]),)
    args = dict(
        a_ptr=a, b_ptr=b, c_ptr=out, bias_ptr=bias if bias is not None else out,
        M=M, N=N, K=K,
        stride_am=stride_am, stride_ak=stride_ak, stride_bk=stride_bk, stride_bn=stride_bn,
        stride_cm=out.stride(0), stride_cn=out.stride(1), stride_bias=bias.stride(0) if bias is not None else 1,
        HAS_BIAS=bias is not None, RELU=activation == "relu", ACC_FP16=accumulate == "fp16",
        UPCAST=a.device.type == "cpu" and a.dtype == torch.bfloat16,  # CPU tensors: the interpreter
        **tiles,
    )
    return out, rt.Plan("matmul", dtype, cfg, _matmul_kernel, grid, args, cfg["num_warps"], cfg["num_stages"])


def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
           accumulate="fp32"):
    out, p = plan(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b, out=out,
                  config=config, accumulate=accumulate)
    if p is not None:
        rt.launch(p)
    return out
