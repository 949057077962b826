"""matmul: fp32 on CUDA cores (matmul_simt.cu), fp16/bf16 on tensor cores
(matmul_tc.cu); the search spaces of both kernels live here as data."""
from __future__ import annotations

from dataclasses import replace

import torch

from kernels_core import contract
from kernels_core.contract import dtype_name, matmul_args, matrix_layout, output
from kernels_core.space import Space

from . import _runtime as rt

# Register-tiled SGEMM. THREAD_M x THREAD_N outputs per thread; the thread
# count follows from the tile sizes, so num_warps must match them. The
# register-staged copies hold BLOCK_K * (BLOCK_M + BLOCK_N) / threads floats
# per thread; capping that at 32 keeps big-tile configs from spilling.
SIMT_SPACE = Space(
    params={
        "BLOCK_M": (32, 64, 128, 256),
        "BLOCK_N": (32, 64, 128, 256),
        "BLOCK_K": (8, 16, 32),
        "THREAD_M": (4, 8),
        "THREAD_N": (4, 8),
        "num_warps": (2, 4, 8),
        "num_stages": (1, 2),
        "GROUP_M": (1, 8),
        "VEC": (1, 2, 4),
    },
    default={
        "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 8, "THREAD_M": 8, "THREAD_N": 8,
        "num_warps": 8, "num_stages": 2, "GROUP_M": 8, "VEC": 4,
    },
    restrictions=(
        "BLOCK_M * BLOCK_N == 32 * num_warps * THREAD_M * THREAD_N",
        "BLOCK_K * (BLOCK_M + BLOCK_N) <= 32 * 32 * num_warps",
        "elt == 4",
    ),
    threads="32 * num_warps",
    smem_bytes="num_stages * BLOCK_K * (BLOCK_M + BLOCK_N + 8) * 4",
    notes="fp32 SIMT; VEC = floats per global load (lowered by the host for misaligned operands)",
)

# Tensor-core GEMM (mma.sync m16n8k16). Warp tiles from 32 x 32 to 64 x 64:
# smaller ones are bound by shared-memory reads, larger ones spill. sm_75 has
# no cp.async, so it double-buffers through registers: exactly 2 stages, and
# 64 x 32 warp tiles by default, since the staging registers make 64 x 64 spill.
# The smem expression is the larger of the two shared layouts (k-contiguous
# or not) of each operand: the tuner prunes by it and the launch asks for it,
# whatever the call's layout (the kernel carves its ring from the front).
TC_SPACE = Space(
    params={
        "BLOCK_M": (64, 128, 256),
        "BLOCK_N": (64, 128, 256),
        "BLOCK_K": (32, 64),
        "WARPS_M": (1, 2, 4),
        "WARPS_N": (1, 2, 4),
        "num_warps": (4, 8),
        "num_stages": (2, 3, 4),
        "GROUP_M": (1, 8),
        "VEC": (4, 8),
    },
    # Best of a 76-config sweep at 4096^3 fp16 on an H200 (266 TFLOP/s).
    default={
        "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "WARPS_M": 2, "WARPS_N": 2,
        "num_warps": 4, "num_stages": 4, "GROUP_M": 8, "VEC": 8,
    },
    defaults_below={80: {"num_stages": 2, "WARPS_M": 2, "WARPS_N": 4, "num_warps": 8}},
    restrictions=(
        "WARPS_M * WARPS_N == num_warps",
        "BLOCK_M % (16 * WARPS_M) == 0 and BLOCK_N % (16 * WARPS_N) == 0",
        "32 * 32 <= (BLOCK_M // WARPS_M) * (BLOCK_N // WARPS_N) <= 64 * 64",
        "arch >= 80 or num_stages == 2",
        "elt == 2",
    ),
    threads="32 * num_warps",
    smem_bytes=(
        "num_stages * (max(BLOCK_M * (BLOCK_K + 8), BLOCK_K * (BLOCK_M + 8))"
        " + max(BLOCK_N * (BLOCK_K + 8), BLOCK_K * (BLOCK_N + 8))) * elt"
    ),
    notes="fp16/bf16 mma.sync; VEC = halves per global copy (8 = 16 bytes), lowered for misaligned operands",
)
# bf16 mma starts at Ampere: on sm_75 every bf16 config is outside the space.
TC_BF16_SPACE = replace(TC_SPACE, restrictions=TC_SPACE.restrictions + ("arch >= 80  # bf16 tensor cores start at sm_80",))

_SPACES = {"fp32": SIMT_SPACE, "fp16": TC_SPACE, "bf16": TC_BF16_SPACE}


def space_for(dtype: str) -> Space:
    return _SPACES[dtype]


def simt_variant(cfg, a_kc, b_kc, va, vb, has_bias, relu) -> rt.Variant:
    return rt.Variant("matmul_simt.cu", "matmul_simt_kernel", (
        cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["THREAD_M"], cfg["THREAD_N"], va, vb,
        cfg["num_stages"], cfg["GROUP_M"], int(a_kc), int(b_kc), int(has_bias), int(relu)))


def tc_variant(cfg, dtype, arch, a_kc, b_kc, va, vb, has_bias, relu, acc16) -> rt.Variant:
    return rt.Variant("matmul_tc.cu", "matmul_tc_kernel", (
        cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["WARPS_M"], cfg["WARPS_N"], cfg["num_stages"],
        va, vb, cfg["GROUP_M"], rt.DT_CODE[dtype], int(a_kc), int(b_kc), int(has_bias), int(relu),
        int(acc16), int(arch >= 80)))


def smem_bytes(dtype: str, cfg, arch: int) -> int:
    """Dynamic shared memory of a launch: the space's own cost expression."""
    return _SPACES[dtype].cost(cfg, contract.DTYPES[dtype].itemsize, arch)["smem_bytes"]


def report_variant(op: str, dtype: str, cfg, arch: int) -> tuple[rt.Variant, int]:
    """What compile reports measure: row-major A and B, no epilogue extras."""
    if dtype == "fp32":
        variant = simt_variant(cfg, True, False, cfg["VEC"], cfg["VEC"], False, False)
    else:
        variant = tc_variant(cfg, dtype, arch, True, False, cfg["VEC"], cfg["VEC"], False, False, False)
    return variant, smem_bytes(dtype, cfg, arch)


def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
           accumulate="fp32"):
    M, N, K = matmul_args(a, b, bias, activation, trans_a, trans_b, accumulate)
    rt.check_cuda("a", a)
    dtype = dtype_name(a.dtype)
    dev = a.device.index
    arch, _ = rt.device_props(dev)
    if dtype == "bf16" and arch < 80:
        raise ValueError(f"a: bf16 tensor-core matmul needs sm_80 or newer, this GPU is sm_{arch}")
    cfg = space_for(dtype).resolve(config, a.element_size(), arch)
    out = output("out", out, (M, N), a.dtype, a.device, contiguous=False)
    if M == 0 or N == 0:
        return out
    if K == 0:  # empty sum: act(bias) or zeros
        if bias is None:
            out.zero_()
        else:
            out.copy_(bias.expand(M, N))
            if activation == "relu":
                out.relu_()
        return out

    a_t, a_kc, lda = matrix_layout(a, trans_a)  # op(a) is M x K: cols contiguous = k contiguous
    b_t, b_n_contig, ldb = matrix_layout(b, trans_b)  # op(b) is K x N: cols contiguous = n contiguous
    b_kc = not b_n_contig
    if bias is not None:
        bias = bias.contiguous()
    elt = a.element_size()
    va = rt.pick_vec(cfg["VEC"], elt, (a_t,), (lda,))
    vb = rt.pick_vec(cfg["VEC"], elt, (b_t,), (ldb,))
    relu = activation == "relu"
    if dtype == "fp32":
        variant = simt_variant(cfg, a_kc, b_kc, va, vb, bias is not None, relu)
    else:
        variant = tc_variant(cfg, dtype, arch, a_kc, b_kc, va, vb, bias is not None, relu, accumulate == "fp16")
    smem = smem_bytes(dtype, cfg, arch)
    blocks = rt.cdiv(M, cfg["BLOCK_M"]) * rt.cdiv(N, cfg["BLOCK_N"])
    # The kernels store row-major with ld = N; a strided `out` view gets the result by one copy.
    c = out if out.is_contiguous() else torch.empty((M, N), dtype=a.dtype, device=a.device)
    rt.launch(variant, dev, (blocks, 1, 1), (32 * cfg["num_warps"], 1, 1),
              (rt.ptr(a_t), rt.ptr(b_t), rt.ptr(bias), rt.ptr(c), rt.i32(M), rt.i32(N), rt.i32(K),
               rt.i64(lda), rt.i64(ldb)), smem, for_=rt.tag("matmul", dtype, cfg))
    if c is not out:
        out.copy_(c)
    return out
