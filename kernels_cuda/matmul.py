"""matmul: exact fp32 on CUDA cores (matmul_simt.cu), fp16/bf16 and fp32 in TF32 on tensor cores
(matmul_tc.cu, matmul_wgmma.cu); the search spaces of the kernels live here as data, and so
do the parts of a launch the fused ops (fused.py) share with matmul: operand
layouts, variants, the kernels' parameter list."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

import torch

from kernels_core import contract
from kernels_core.contract import cdiv, dtype_name, matmul_args, matrix_layout, output
from kernels_core.space import Space
from kernels_core.workspace import splitk_slices, splitk_workspace

from . import _runtime as rt
from . import _tma

# Split-K (both kernels; kernels_cuda/splitk.cuh has the protocol) pays for
# outputs of few tiles. Its configs fix what matters least there, to keep each
# space to a few thousand configs (sm_90: tensor cores 1734, SIMT 8422) and dense enough
# that about 1 in 7 of a tunable-by-tunable sampler's suggestions is valid (the
# default sampler proposes valid configs only): GROUP_M = 8 (a grid of few tiles
# runs at once, the order of its blocks hardly matters), on the SIMT kernel
# num_stages >= 2 (a prefetching loop), on the tensor-core kernel tiles up
# to 128 x 128 (an output that needs split-K is cut into smaller tiles first).
# 32 and 64 slices only for tiles of at most 512 outputs: the logits' products
# (32 x 10 or 128 x 10 over K = 1024..8192) have 1 to 8 such tiles, which 16
# slices leave at 16 to 128 blocks of 8 to 32 serial k steps each; 64 slices of
# K = 8192 are two 64-wide steps (the last arrival then reads 63 partials, 16 at a time).
#
# No VEC tunable: operands are read 16 bytes per access, and the host lowers
# the width by itself where a pointer or leading dimension is not aligned to
# it; a narrower width than alignment allows only adds instructions.
VEC_BYTES = 16
SPLIT_WIDE = "SPLIT_K <= 16 or BLOCK_M * BLOCK_N <= 512  # 32 or 64 slices: tiles of at most 512 outputs (see above)"

# Register-tiled SGEMM. THREAD_M x THREAD_N outputs per thread, so the block
# has BLOCK_M * BLOCK_N / (THREAD_M * THREAD_N) threads (whole warps, at most
# 8). Each thread holds its accumulators and its share of the register-staged
# copies, BLOCK_K * (BLOCK_M + BLOCK_N) / threads floats. Under ptxas for sm_90,
# 96 of the two together spilled nothing new in a 198-variant sample (16x32 to
# 128x128 tiles, BLOCK_K 32 to 128, three layouts and epilogues) and at most 24
# bytes in 2 of the 132 variants at that edge, where 112 spilled in a third of
# the sample's (up to 204 bytes); tests/test_cuda_compile.py builds the edge.
# So small tiles may take BLOCK_K = 64 or 128: the default protocol's K = 128
# products at H = 128 (dW, the loss, the second layer) then take one or two k
# steps, one trip to L2 each, where BLOCK_K = 32 made four (experiments/FINDINGS.md, "SIMT fp32 kernel").
# THREAD_M and THREAD_N 2 give the small tiles Triton's fp32 winners take for the step's
# products at H = 128 (16 x 16 on 2 warps), with a quarter of 4 x 4's serial FMAs per thread
# (experiments/FINDINGS.md, "SIMT fp32 kernel"). They are valid wherever the warp rules allow, not on small tiles only: the
# tuner suggests each tunable on its own, and a value valid in a corner of the grid is one it
# seldom draws (confined to tiles of 512 outputs, 2 x 2 was measured in 1 of 12 studies).
# num_stages: 1 reloads one buffer, 2 prefetches the next tile through registers, 3 and 4 keep
# that many tiles in a cp.async ring (sm_80 on), the next STAGES - 1 in flight, as Triton's fp32
# winners at the trainer's K = 784..1024 products do. The ring did not make a k step cheaper, but
# ring configs won some small products' studies (128x128x784: 6.2 -> 5.5 us; experiments/FINDINGS.md, "SIMT fp32 kernel").
# The register rule below is kept for the ring too (whose copies hold no registers), so that
# every pipeline runs the same tiles.
SIMT_THREADS = "(BLOCK_M * BLOCK_N // (THREAD_M * THREAD_N))"
SIMT_SPACE = Space(
    params={
        "BLOCK_M": (16, 32, 64, 128, 256),
        "BLOCK_N": (16, 32, 64, 128, 256),
        "BLOCK_K": (8, 16, 32, 64, 128),
        "THREAD_M": (2, 4, 8),
        "THREAD_N": (2, 4, 8),
        "num_stages": (1, 2, 3, 4),
        "GROUP_M": (1, 8),
        "SPLIT_K": (1, 2, 4, 8, 16, 32, 64),
    },
    default={
        "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 8, "THREAD_M": 8, "THREAD_N": 8,
        "num_stages": 2, "GROUP_M": 8, "SPLIT_K": 1,
    },
    restrictions=(
        f"{SIMT_THREADS} % 32 == 0 and {SIMT_THREADS} <= 256  # whole warps, at most 8",
        f"THREAD_M * THREAD_N + BLOCK_K * (BLOCK_M + BLOCK_N) / {SIMT_THREADS} <= 96"
        "  # accumulators + staged copies: at most 96 floats per thread",
        "SPLIT_K == 1 or (num_stages >= 2 and GROUP_M == 8)  # split-K configs fix these (see above)",
        "arch >= 80 or num_stages <= 2  # the cp.async ring starts at sm_80",
        SPLIT_WIDE,
        "elt == 4",
    ),
    threads=SIMT_THREADS,
    # Rows padded by 4 floats: k-major tiles have BLOCK_K rows; in the ring a k-contiguous operand
    # keeps its BLOCK_M (BLOCK_N) rows of BLOCK_K (matmul_simt.cu: SimtTile::DK), which the layout
    # decides at launch, so the ring is sized for the larger padding.
    smem_bytes="num_stages * 4 * (BLOCK_K * (BLOCK_M + BLOCK_N) + 4 * ("
               "max(BLOCK_K, BLOCK_M) + max(BLOCK_K, BLOCK_N) if num_stages > 2 else 2 * BLOCK_K))",
    notes="fp32 SIMT; 16-byte loads, lowered by the host for misaligned operands; SPLIT_K > 1 sums slices in fp32",
)

# Tensor-core GEMM, two kernels chosen by the WGMMA tunable.
#
# WGMMA = 0: mma.sync m16n8k16 (matmul_tc.cu), every arch from sm_75. num_warps warps cut the
# block tile into warp tiles (warp_grid), from 32 x 32 to 64 x 64: smaller ones are bound
# by shared-memory reads, larger ones spill, and so do 64 x 64 ones in blocks
# of 1 or 2 warps, whose threads each issue 2-4x the copies of a 4-warp
# block's (ptxas at sm_90: 300-840 bytes). A one-warp block may be as small
# as 16 x 16 (the logits' N = 10, batches of 16-32 rows: latency rather than
# throughput), and so may blocks of 2-4 warps up to 512 outputs, on warp tiles down to
# 16 x 8 (Triton's winners there are 16 x 16 on 2 warps; the SIMT kernel's thread tiles of
# 2 paid the same way: experiments/FINDINGS.md, "Tensor-core kernel: small blocks and the one-warp cost"). The warp grid is derived, not tuned: for a given warp count
# the squarest warp tile reads the least shared memory per mma, and the
# restriction on the tile's aspect is what makes an at most 2:1 warp tile
# exist. BLOCK_K 128 (Triton's winners at K >= 128 in the seed protocol take
# it) reads K = 128 in one k step: one wait and one barrier where BLOCK_K = 32
# takes four; ptxas (sm_90) spilled none of 56 variants of it, 16 x 16 on one
# warp to 128 x 128 on eight, every fused path. sm_75 has no cp.async, so it double-buffers through registers:
# exactly 2 stages, and the accumulators (BLOCK_M * BLOCK_N / 32 floats per
# warp) plus the staged copies ((BLOCK_M + BLOCK_N) * BLOCK_K / 64 registers
# per warp) must stay within 88 registers per thread: ptxas over the whole
# sm_75 space without that rule spilled in 131 of 316 configs, in 2 of the
# 156 it keeps (8 bytes each). Hence 8 warps by default there: 64 x 64 warp
# tiles spill.
# Its smem expression is the operand ring, the same size in every layout (rows
# unpadded, matmul_tc.cu's TcTile): the tuner prunes by it and the launch asks
# for it.
#
# WGMMA = 1: wgmma + TMA with a producer warpgroup (matmul_wgmma.cu), sm_90 only (built for
# sm_90a). num_warps counts the consumer (math) warps as for mma.sync: 4 or 8, one or two
# warpgroups, each owning 64 or 128 rows of the tile and at most 128 fp32 accumulators per
# thread; the producer warpgroup comes on top (threads). BLOCK_K is 64, one 128-byte swizzled
# row. No split-K, no fused epilogues, no fp16 accumulation: calls that ask
# for them, or whose operands the TMA cannot read, are refused as config errors.
_MMA_SYNC_RULES = (
    "BLOCK_M * BLOCK_N <= (64 if num_warps >= 4 else 32) * 64 * num_warps  # larger warp tiles spill",
    "BLOCK_M * BLOCK_N >= 32 * 32 * num_warps or num_warps == 1 or 128 * num_warps <= BLOCK_M * BLOCK_N <= 512"
    "  # smaller warp tiles starve on shared memory, but for tiles of at most 512 outputs latency is all (see above)",
    "BLOCK_M <= 2 * num_warps * BLOCK_N and BLOCK_N <= 2 * num_warps * BLOCK_M  # warp tiles at most 2:1",
    "arch >= 80 or num_stages == 2",
    "arch >= 80 or 2 * BLOCK_M * BLOCK_N + (BLOCK_M + BLOCK_N) * BLOCK_K <= 64 * 88 * num_warps"
    "  # sm_75: accumulators + staged copies",
    "SPLIT_K == 1 or (GROUP_M == 8 and BLOCK_M <= 128 and BLOCK_N <= 128)  # split-K configs (see above)",
    SPLIT_WIDE,
)
_WGMMA_RULES = (
    "arch == 90  # wgmma is sm_90a's alone",
    "BLOCK_K == 64 and SPLIT_K == 1 and num_warps in (4, 8)  # 128-byte k rows; 1 or 2 consumer warpgroups",
    "BLOCK_M in (16 * num_warps, 32 * num_warps) and BLOCK_N >= 64  # 64 or 128 rows per consumer warpgroup",
    "BLOCK_M * BLOCK_N <= 4096 * num_warps  # at most 128 accumulators per consumer thread",
)


def _when(flag: str, rule: str) -> str:
    """`rule` applied only where `flag` holds, its reason kept."""
    expr, _, why = rule.partition("#")
    return f"not ({flag}) or ({expr.strip()})" + (f"  # {why.strip()}" if why else "")


TC_SPACE = Space(
    params={
        "BLOCK_M": (16, 32, 64, 128, 256),
        "BLOCK_N": (16, 32, 64, 128, 256),
        "BLOCK_K": (32, 64, 128),
        "num_warps": (1, 2, 4, 8),
        "num_stages": (2, 3, 4),
        "GROUP_M": (1, 8),
        "SPLIT_K": (1, 2, 4, 8, 16, 32, 64),
        "WGMMA": (0, 1),
    },
    # Best of a 76-config sweep at 4096^3 fp16 on an H200 (266 TFLOP/s). mma.sync: every call
    # and every arch can run it, which a default must.
    default={
        "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4, "GROUP_M": 8,
        "SPLIT_K": 1, "WGMMA": 0,
    },
    defaults_below={80: {"num_stages": 2, "num_warps": 8}},
    restrictions=(
        *(_when("WGMMA == 0", rule) for rule in _MMA_SYNC_RULES),
        *(_when("WGMMA == 1", rule) for rule in _WGMMA_RULES),
        "elt == 2",
    ),
    threads="32 * num_warps + 128 * WGMMA",
    smem_bytes=(
        "num_stages * ((BLOCK_M + BLOCK_N) * BLOCK_K * elt + 16) + 1024 if WGMMA else"
        " num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * elt"
    ),
    notes="fp16/bf16 mma.sync with WGMMA=0: 16-byte cp.async, lowered by the host for misaligned operands, SPLIT_K > 1 "
          "sums slices in fp32; on sm_90 wgmma + TMA with WGMMA=1: operands with 16-byte aligned rows",
    families=("WGMMA",),
)
# bf16 mma starts at Ampere: on sm_75 every bf16 config is outside the space.
TC_BF16_SPACE = replace(TC_SPACE, restrictions=TC_SPACE.restrictions + ("arch >= 80  # bf16 tensor cores start at sm_80",))

# fp32: the SIMT kernel multiplies exactly (TF32 = 0); TF32 = 3 (3xTF32) and TF32 = 1 (plain TF32,
# a lower precision the tuner tries only when asked) run on TF32 tensor cores: with WGMMA = 0 the
# mma.sync kernel's (matmul_tc.cu's header says how it splits the operands), with WGMMA = 1 on
# sm_90 the wgmma kernel's, on operands split ahead (matmul_wgmma_tf32x3.cu). Each kernel keeps its
# own tunables and rules; the others' tunables are fixed at their defaults (num_warps 4 for SIMT,
# 8 x 8 thread tiles for the tensor cores), so that no config is another kernel's under another
# name. mma.sync TF32 tiles take at least two m16n8k8 steps a stage (BLOCK_K >= 16) in a cp.async
# ring.
_TF32_RULES = (
    "arch >= 80  # TF32 tensor cores start at sm_80",
    "THREAD_M == 8 and THREAD_N == 8  # the SIMT kernel's thread tiles: fixed at its default",
)
_TF32_MMA_SYNC_RULES = (
    "num_stages >= 2 and BLOCK_K in (16, 32)  # a cp.async ring; k rows of 64 or 128 bytes, 2 or 4 k8 mma steps",
    *_MMA_SYNC_RULES,
)
# WGMMA = 1 in fp32: a stage holds a 32-wide k slice of each operand part (two parts each for
# 3xTF32, one for TF32), 128 bytes a row; a consumer warpgroup owns 64 rows and one wgmma spans
# the tile's 64 or 128 columns. No split-K, no fused epilogues but bias and ReLU (as fp16's).
_WGMMA_TF32_RULES = (
    "arch == 90  # wgmma is sm_90a's alone",
    "BLOCK_K == 32 and SPLIT_K == 1 and num_warps in (4, 8)  # 128-byte k rows of fp32; 1 or 2 consumer warpgroups",
    "num_stages >= 2  # a slice is loaded while the one before is multiplied",
    "BLOCK_M == 16 * num_warps and BLOCK_N in (64, 128)  # 64 rows a consumer warpgroup; one wgmma spans the columns",
    "num_stages * (2 if TF32 == 3 else 1) * (BLOCK_M + BLOCK_N) * 128 <= 192 * 1024  # the ring within 227 KB",
)
_WGMMA_TF32_SMEM = "num_stages * ((2 if TF32 == 3 else 1) * (BLOCK_M + BLOCK_N) * 128 + 16) + 1024"
FP32_SPACE = Space(
    params={**SIMT_SPACE.params, "num_warps": (1, 2, 4, 8), "TF32": (0, 3, 1), "WGMMA": (0, 1)},
    default={**SIMT_SPACE.default, "num_warps": 4, "TF32": 0, "WGMMA": 0},
    restrictions=(
        *(_when("TF32 == 0", rule) for rule in SIMT_SPACE.restrictions),
        "TF32 > 0 or num_warps == 4  # the tensor cores' warp count: fixed for the SIMT kernel",
        "TF32 > 0 or WGMMA == 0  # the wgmma kernel multiplies on TF32 tensor cores",
        *(_when("TF32 > 0", rule) for rule in _TF32_RULES),
        *(_when("TF32 > 0 and WGMMA == 0", rule) for rule in _TF32_MMA_SYNC_RULES),
        *(_when("WGMMA == 1", rule) for rule in _WGMMA_TF32_RULES),
    ),
    threads=f"{SIMT_THREADS} if TF32 == 0 else 32 * num_warps + 128 * WGMMA",
    smem_bytes=f"({SIMT_SPACE.smem_bytes}) if TF32 == 0 else ({_WGMMA_TF32_SMEM}) if WGMMA else "
               "num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * elt",
    notes=SIMT_SPACE.notes + "; TF32 = 3 (3xTF32) and 1 (TF32, lower precision): mma.sync m16n8k8 on the "
          "tensor cores, sm_80 and newer; on sm_90 wgmma + TMA with WGMMA=1, the operands split ahead into a "
          "workspace",
    lower_precision={"TF32": {1: "tf32"}}, emulated={"TF32": (3,)}, families=("TF32", "WGMMA"),
)

_SPACES = {"fp32": FP32_SPACE, "fp16": TC_SPACE, "bf16": TC_BF16_SPACE}


def space_for(dtype: str) -> Space:
    return _SPACES[dtype]


def warp_grid(cfg) -> tuple[int, int]:
    """(WARPS_M, WARPS_N) of a tensor-core config: the grid of num_warps warps whose
    warp tiles are squarest, more warps along N on a tie (a taller warp tile)."""
    return _warp_grid(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"])


@functools.lru_cache(maxsize=None)
def _warp_grid(bm: int, bn: int, warps: int) -> tuple[int, int]:
    grids = [(warps // wn, wn) for wn in (1, 2, 4, 8)
             if wn <= warps and bm // (warps // wn) >= 16 and bn // wn >= 8]  # at least one 16 x 8 mma tile
    return min(grids, key=lambda g: (max(bm // g[0], bn // g[1]) / min(bm // g[0], bn // g[1]), g[0]))


def simt_variant(cfg, a_kc, b_kc, va, vb, has_bias, relu, a_rows=False, epi="plain") -> rt.Variant:
    """a_rows: A's stored rows read through an index vector; epi: an rt.EPI_CODE name (fused.cuh)."""
    return rt.Variant("matmul_simt.cu", "matmul_simt_kernel", (
        cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["THREAD_M"], cfg["THREAD_N"], va, vb,
        cfg["num_stages"], cfg["GROUP_M"], cfg["SPLIT_K"], int(a_kc), int(b_kc), int(has_bias), int(relu),
        int(a_rows), rt.EPI_CODE[epi]))


def tc_variant(cfg, dtype, arch, a_kc, b_kc, va, vb, has_bias, relu, acc16, a_rows=False, epi="plain") -> rt.Variant:
    """va, vb: elements per copy; the kernel copies 16-bit halves (an fp32 element is two)."""
    warps_m, warps_n = warp_grid(cfg)
    halves = contract.DTYPES[dtype].itemsize // 2
    return rt.Variant("matmul_tc.cu", "matmul_tc_kernel", (
        cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], warps_m, warps_n, cfg["num_stages"],
        va * halves, vb * halves, cfg["GROUP_M"], cfg["SPLIT_K"], rt.DT_CODE[dtype], int(a_kc), int(b_kc),
        int(has_bias), int(relu), int(acc16), int(arch >= 80), cfg.get("TF32", 0), int(a_rows), rt.EPI_CODE[epi]))


def wgmma_variant(cfg, dtype, a_kc, b_kc, has_bias, relu, c_pairs) -> rt.Variant:
    """c_pairs: C's columns stored two at a time (N even, C 4-byte aligned)."""
    return rt.Variant("matmul_wgmma.cu", "matmul_wgmma_kernel", (
        rt.DT_CODE[dtype], cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"] // 4, cfg["GROUP_M"],
        int(a_kc), int(b_kc), int(has_bias), int(relu), int(c_pairs)), sm_suffix="a")


def wgmma_tf32_variant(cfg, has_bias, relu, c_pairs) -> rt.Variant:
    """The fp32 wgmma GEMM on split operands: 3xTF32 (two parts each, the fp32 add after every k
    slice) or plain TF32 (one part, one accumulator). c_pairs: C's columns stored two at a time."""
    parts = 2 if cfg["TF32"] == 3 else 1
    return rt.Variant("matmul_wgmma_tf32x3.cu", "matmul_wgmma_tf32x3_kernel", (
        cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"] // 4, cfg["GROUP_M"], int(parts == 2),
        int(c_pairs), parts, int(has_bias), int(relu)), sm_suffix="a")


def on_simt(dtype: str, cfg) -> bool:
    """Whether a config runs on the SIMT kernel: exact fp32 (TF32 = 0); the rest take the tensor cores."""
    return dtype == "fp32" and not cfg["TF32"]


def variant(dtype: str, arch: int, cfg, ops: "Operands", *, has_bias=False, relu=False, acc16=False,
            epi="plain") -> rt.Variant:
    """The kernel variant of a call: SIMT for exact fp32, tensor cores otherwise."""
    if on_simt(dtype, cfg):
        return simt_variant(cfg, ops.a_kc, ops.b_kc, ops.va, ops.vb, has_bias, relu, ops.a_rows is not None, epi)
    return tc_variant(cfg, dtype, arch, ops.a_kc, ops.b_kc, ops.va, ops.vb, has_bias, relu, acc16,
                      ops.a_rows is not None, epi)


# Both matmul kernels' parameters, in order (the GEMM's, then fused.cuh's FUSED_PARAMS), with how
# each is passed. Every launch passes them all; a variant reads those its template flags use.
KERNEL_PARAMS = (
    ("A", rt.ptr), ("B", rt.ptr), ("bias", rt.ptr), ("C", rt.ptr), ("M", rt.i32), ("N", rt.i32), ("K", rt.i32),
    ("lda", rt.i64), ("ldb", rt.i64), ("partials", rt.ptr), ("counters", rt.ptr), ("k_slice", rt.i32),
    ("a_rows", rt.ptr), ("rows_of_a", rt.i64), ("relu_y", rt.ptr),
    ("labels", rt.ptr), ("label_rows", rt.ptr), ("n_labels", rt.i64), ("loss", rt.ptr), ("flag", rt.ptr),
    ("loss_slots", rt.ptr), ("loss_counter", rt.ptr),
    ("w", rt.ptr), ("w_buf", rt.ptr), ("w_low", rt.ptr), ("b", rt.ptr), ("b_buf", rt.ptr), ("b_low", rt.ptr),
    ("lr", rt.f32), ("momentum", rt.f32), ("weight_decay", rt.f32),
)
_PARAM_NAMES = frozenset(name for name, _ in KERNEL_PARAMS)


def kernel_args(ops: "Operands", **given) -> tuple:
    """The launch's arguments in KERNEL_PARAMS order: the operands' own from `ops`, the rest from
    `given` by name; any not given is 0 (a null pointer)."""
    unknown = set(given) - _PARAM_NAMES
    if unknown:
        raise TypeError(f"not parameters of the matmul kernels: {sorted(unknown)}")
    given = {"A": ops.a, "B": ops.b, "lda": ops.lda, "ldb": ops.ldb, "a_rows": ops.a_rows,
             "rows_of_a": ops.rows_of_a, **given}
    return tuple(conv(given.get(name, None if conv is rt.ptr else 0)) for name, conv in KERNEL_PARAMS)


class Operands(NamedTuple):
    """How a call's kernel reads op(a) (M x K) and op(b) (K x N): the tensors, whether k is
    contiguous, leading dimensions, vector widths, and a's gather (a_rows, a.shape[0]) if any."""
    a: torch.Tensor
    a_kc: bool
    lda: int
    va: int
    b: torch.Tensor
    b_kc: bool
    ldb: int
    vb: int
    a_rows: torch.Tensor | None
    rows_of_a: int


def gathered_layout(a: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(a, its row stride) for a read by stored rows (a_rows): each row's elements must be
    unit-stride, so another view is copied once. Of a single row only row 0 is ever read, so its
    stride is whatever keeps the vector widths widest."""
    if a.shape[1] > 1 and a.stride(1) != 1:
        a = a.contiguous()
    return a, a.stride(0) if a.shape[0] > 1 else max(a.shape[1], 1)


def operands(a, b, trans_a: bool, trans_b: bool, a_rows=None) -> Operands:
    if a_rows is None:
        a_t, a_kc, lda = matrix_layout(a, trans_a)  # op(a) is M x K: cols contiguous = k contiguous
    else:
        # a's rows are whole: k runs along them (the batch's rows gathered along M) unless
        # trans_a (x_rows gathered along K).
        a_t, lda = gathered_layout(a)
        a_kc = not trans_a
    b_t, b_n_contig, ldb = matrix_layout(b, trans_b)  # op(b) is K x N: cols contiguous = n contiguous
    elt = a.element_size()
    va = rt.pick_vec(VEC_BYTES // elt, elt, (a_t,), (lda,))
    vb = rt.pick_vec(VEC_BYTES // elt, elt, (b_t,), (ldb,))
    return Operands(a_t, a_kc, lda, va, b_t, not b_n_contig, ldb, vb, a_rows, a.shape[0] if a_rows is not None else 0)


class Split(NamedTuple):
    """A call's grid: tiles x slices blocks; cfg is what the kernel is built with (SPLIT_K = 1
    when one slice holds K), k_slice the slice length."""
    cfg: dict
    tiles: int
    slices: int
    k_slice: int

    def partial_elems(self) -> int:
        """fp32 elements of the split-K workspace's partial tiles (0 for the plain kernel)."""
        return self.tiles * self.slices * self.cfg["BLOCK_M"] * self.cfg["BLOCK_N"] if self.slices > 1 else 0


def split(cfg, M: int, N: int, K: int) -> Split:
    k_slice, slices = splitk_slices(K, cfg["SPLIT_K"], cfg["BLOCK_K"])
    # One slice that holds K is the plain kernel: no workspace, no arrival, as in the Triton twin.
    run = cfg if slices > 1 else {**cfg, "SPLIT_K": 1}
    return Split(run, cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), slices, k_slice)


def launch_cost(dtype: str, cfg, arch: int) -> tuple[int, int]:
    """(threads per block, dynamic shared memory) of a launch: the space's own cost expressions."""
    cost = _SPACES[dtype].cost(cfg, contract.DTYPES[dtype].itemsize, arch)
    return cost["threads"], cost["smem_bytes"]


def check_arch(dtype: str, arch: int, name: str) -> None:
    if dtype == "bf16" and arch < 80:
        raise ValueError(f"{name}: bf16 tensor-core matmul needs sm_80 or newer, this GPU is sm_{arch}")


def report_variant(op: str, dtype: str, cfg, arch: int) -> tuple[rt.Variant, int]:
    """What compile reports measure: row-major A and B, 16-byte loads, no epilogue extras."""
    vec = VEC_BYTES // contract.DTYPES[dtype].itemsize
    if on_simt(dtype, cfg):
        variant = simt_variant(cfg, True, False, vec, vec, False, False)
    elif cfg.get("WGMMA"):
        variant = (wgmma_tf32_variant(cfg, False, False, True) if dtype == "fp32" else
                   wgmma_variant(cfg, dtype, True, False, False, False, True))
    else:
        variant = tc_variant(cfg, dtype, arch, True, False, vec, vec, False, False, False)
    return variant, launch_cost(dtype, cfg, arch)[1]


def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, out=None, config=None,
           accumulate="fp32", a_rows=None, relu_grad_of=None):
    M, N, K = matmul_args(a, b, bias, activation, trans_a, trans_b, accumulate, a_rows, relu_grad_of)
    rt.check_cuda("a", a)
    dtype = dtype_name(a.dtype)
    dev = a.device.index
    arch, _ = rt.device_props(dev)
    check_arch(dtype, arch, "a")
    cfg = space_for(dtype).resolve(config, a.element_size(), arch)
    out = output("out", out, (M, N), a.dtype, a.device, contiguous=False)
    if M == 0 or N == 0:
        return out
    if K == 0:  # empty sum: act(bias) or zeros (relu_grad_of takes no bias: zeros)
        if bias is None:
            out.zero_()
        else:
            out.copy_(bias.expand(M, N))
            if activation == "relu":
                out.relu_()
        return out

    ops = operands(a, b, trans_a, trans_b, a_rows)
    if bias is not None:
        bias = bias.contiguous()
    # The kernels store row-major with ld = N; a strided `out` view gets the result by one copy.
    c = out if out.is_contiguous() else torch.empty((M, N), dtype=a.dtype, device=a.device)
    if cfg.get("WGMMA"):
        refused = ("gathered rows of a (a_rows)" if a_rows is not None else
                   "relu_grad_of epilogue" if relu_grad_of is not None else
                   "fp16 accumulation" if accumulate == "fp16" else None)
        if refused:
            raise ValueError(f"config: the wgmma kernel (WGMMA=1) has no {refused}; use WGMMA=0 for this call")
        run = _matmul_wgmma_tf32 if dtype == "fp32" else _matmul_wgmma
        run(dtype, dev, arch, cfg, ops, trans_a, trans_b, bias, activation == "relu", c, M, N, K)
    else:
        if relu_grad_of is not None:
            relu_grad_of = relu_grad_of.contiguous()  # read with ld = N, as C is written
        grid = split(cfg, M, N, K)
        kernel = variant(dtype, arch, grid.cfg, ops, has_bias=bias is not None, relu=activation == "relu",
                         acc16=accumulate == "fp16", epi="plain" if relu_grad_of is None else "relu_grad")
        threads, smem = launch_cost(dtype, cfg, arch)
        partials = counters = None  # SPLIT_K == 1 compiles no access to them
        if grid.slices > 1:
            # partials[tile][slice]: one fp32 BLOCK_M x BLOCK_N tile each (in the kernel's thread
            # order); counters[tile] are zero between calls (the last arrival resets its own).
            partials, counters = splitk_workspace(a.device, grid.partial_elems(), grid.tiles)
        rt.launch(kernel, dev, (grid.tiles, grid.slices, 1), (threads, 1, 1),
                  kernel_args(ops, bias=bias, C=c, M=M, N=N, K=K, partials=partials, counters=counters,
                              k_slice=grid.k_slice, relu_y=relu_grad_of),
                  smem, for_=rt.tag("matmul", dtype, cfg))
    if c is not out:
        out.copy_(c)
    return out


def tma_reads(t: torch.Tensor, s_outer: int, s_k: int, outer: int, k: int, box_rows: int,
              prefer_kc: bool) -> tuple[bool, _tma.Map2D] | None:
    """How the TMA reads X, an outer x k operand (A: M x K; B transposed: N x K) stored in `t`
    with strides s_outer, s_k: (k contiguous?, its tensor map), the layout the mma.sync path
    chose first (prefer_kc), or None if the TMA can read neither. A matrix of one row or one
    column is contiguous both ways, which is what lets M, N or K = 1 through."""
    ptr = t.data_ptr()
    k_major = _tma.Map2D(ptr, outer, k, s_outer, box_rows) if s_k == 1 or k == 1 else None
    mn_major = _tma.Map2D(ptr, k, outer, s_k, _tma.BOX_COLS) if s_outer == 1 or outer == 1 else None
    options = ((True, k_major), (False, mn_major))
    for kc, m in options if prefer_kc else options[::-1]:
        if m is not None and m.readable():
            return kc, m
    return None


def _strides(ops: Operands, trans_a, trans_b) -> tuple[int, int, int, int]:
    """(A's outer, A's k, B's outer, B's k) strides of op(a) (M x K) and op(b)^T (N x K)."""
    sa, sb = ops.a.stride(), ops.b.stride()
    a_outer, a_k = (sa[1], sa[0]) if trans_a else (sa[0], sa[1])
    b_outer, b_k = (sb[0], sb[1]) if trans_b else (sb[1], sb[0])
    return a_outer, a_k, b_outer, b_k


def _matmul_wgmma(dtype, dev, arch, cfg, ops: Operands, trans_a, trans_b, bias, relu, c, M, N, K) -> None:
    a_outer, a_k, b_outer, b_k = _strides(ops, trans_a, trans_b)
    read_a = tma_reads(ops.a, a_outer, a_k, M, K, cfg["BLOCK_M"], ops.a_kc)
    read_b = tma_reads(ops.b, b_outer, b_k, N, K, cfg["BLOCK_N"], ops.b_kc)
    for name, read, t in (("a", read_a, ops.a), ("b", read_b, ops.b)):
        if read is None:
            raise ValueError(
                f"config: the wgmma kernel (WGMMA=1) reads {name} with the TMA, which needs a 16-byte aligned "
                f"start and rows a multiple of 16 bytes apart; {name} {tuple(t.shape)} with strides {t.stride()} "
                f"(start {t.data_ptr() % 16} bytes past 16) has neither: use WGMMA=0 for this call")
    (a_kc, map_a), (b_kc, map_b) = read_a, read_b
    kernel = wgmma_variant(cfg, dtype, a_kc, b_kc, bias is not None, relu, N % 2 == 0 and c.data_ptr() % 4 == 0)
    threads, smem = launch_cost(dtype, cfg, arch)
    blocks = rt.persistent_blocks(dev, cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), smem)
    rt.launch(kernel, dev, (blocks, 1, 1), (threads, 1, 1),
              (rt.by_value(_tma.tensor_map(map_a)), rt.by_value(_tma.tensor_map(map_b)), rt.ptr(bias), rt.ptr(c),
               rt.i32(M), rt.i32(N), rt.i32(K)),
              smem, for_=rt.tag("matmul", dtype, cfg))


def tf32_parts(x: torch.Tensor, rows: int, K: int, s_r: int, s_k: int, parts: int, dev: int) -> tuple[torch.Tensor, int]:
    """X's TF32 parts (parts x rows x ld fp32, k-contiguous, ld = K rounded up to 4), X the rows x K
    matrix at x[r * s_r + k * s_k], by matmul_wgmma_tf32x3.cu's split pass: 3xTF32's big and small
    (parts 2) or TF32's rounding (parts 1). A new workspace each call, from torch's allocator (in a
    CUDA graph capture, from the graph's pool)."""
    ld = cdiv(K, 4) * 4
    out = torch.empty((parts, rows, ld), dtype=torch.float32, device=x.device)
    kernel = rt.Variant("matmul_wgmma_tf32x3.cu", "tf32_split_kernel", (parts, int(s_k == 1)), sm_suffix="a")
    rt.launch(kernel, dev, (cdiv(rows, 32), min(cdiv(K, 32), 65535), 1), (256, 1, 1),
              (rt.ptr(x), rt.ptr(out[0]), rt.ptr(out[parts - 1]), rt.i32(rows), rt.i32(K), rt.i64(s_r),
               rt.i64(s_k), rt.i64(ld)), 0, for_=("tf32_split", "fp32", (parts, int(s_k == 1))))
    return out, ld


def _matmul_wgmma_tf32(dtype, dev, arch, cfg, ops: Operands, trans_a, trans_b, bias, relu, c, M, N, K) -> None:
    """fp32 on wgmma: A's and B^T's TF32 parts split ahead (k-contiguous, as wgmma's tf32 form reads
    both operands), then the GEMM on them; any layout of a and b, any M, N, K."""
    a_outer, a_k, b_outer, b_k = _strides(ops, trans_a, trans_b)
    parts = 2 if cfg["TF32"] == 3 else 1
    (pa, lda), (pb, ldb) = (tf32_parts(t, rows, K, s_r, s_k, parts, dev)
                            for t, rows, s_r, s_k in ((ops.a, M, a_outer, a_k), (ops.b, N, b_outer, b_k)))
    maps = [rt.by_value(_tma.tensor_map(_tma.Map2D(p[i].data_ptr(), rows, K, ld, box, 4)))
            for p, rows, ld, box in ((pa, M, lda, cfg["BLOCK_M"]), (pb, N, ldb, cfg["BLOCK_N"])) for i in (0, parts - 1)]
    kernel = wgmma_tf32_variant(cfg, bias is not None, relu, N % 2 == 0 and c.data_ptr() % 8 == 0)
    threads, smem = launch_cost(dtype, cfg, arch)
    blocks = rt.persistent_blocks(dev, cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), smem)
    rt.launch(kernel, dev, (blocks, 1, 1), (threads, 1, 1),
              (*maps, rt.ptr(bias), rt.ptr(c), rt.i32(M), rt.i32(N), rt.i32(K)), smem,
              for_=rt.tag("matmul", dtype, cfg))
