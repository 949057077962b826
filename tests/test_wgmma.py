"""The CUDA twin's wgmma + TMA matmul (kernels_cuda/matmul_wgmma.cu, WGMMA=1 in the fp16/bf16 space).

On the CPU: which GPUs the space offers it to, how the host lays operands out for the TMA (and
which it refuses, as config errors the tuner prunes), and offline builds for sm_90a whose SASS must
show HGMMA and TMA loads without spills. On a GPU (`gpu`, sm_90 only): results against float64
at ragged shapes in every layout, bias and ReLU, a graph-captured call, and the refusals.
"""
from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess

import pytest
import torch

import kernels_cuda as kc
from kernels_core import contract
from kernels_core.reference import exact
from kernels_cuda import _tma
from kernels_cuda.matmul import TC_SPACE, tma_reads, wgmma_variant
from tests.test_ops import TRANSPOSES, assert_rel, matmul_tol, poisoned, randn

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
WGMMA_DTYPES = ("fp16", "bf16")


def wgmma_configs(arch=90) -> list[dict]:
    return [c for c in TC_SPACE.configs(2, arch) if c["WGMMA"]]


# ----------------------------------------------------------------------------- the space


@pytest.mark.parametrize("arch", (75, 80, 86, 89, 100))
def test_only_sm90_is_offered_the_wgmma_kernel(arch):
    assert not wgmma_configs(arch), "wgmma exists on sm_90a alone; older and newer GPUs run mma.sync"
    assert kc.space("matmul", "fp16").default_for(arch)["WGMMA"] == 0


def test_wgmma_configs_fit_the_kernel():
    """Each config's warpgroups own 64 or 128 rows, at most 128 accumulators per thread, one wgmma
    spans the tile's columns, and the fused ops never get the kernel (their epilogues are not in it)."""
    configs = wgmma_configs()
    assert len(configs) >= 30
    for c in configs:
        consumers = c["num_warps"] // 4
        assert c["BLOCK_M"] // consumers in (64, 128) and c["BLOCK_N"] in (64, 128, 256), c
        assert c["BLOCK_M"] * c["BLOCK_N"] // (128 * consumers) <= 128, c
        assert c["BLOCK_K"] == 64 and c["SPLIT_K"] == 1, c
        assert TC_SPACE.cost(c, 2, 90)["threads"] == 128 * (consumers + 1), c
    for op in contract.FUSED_OPS:
        for dtype in WGMMA_DTYPES:
            assert kc.space(op, dtype).params["WGMMA"] == (0,)


# ----------------------------------------------------------------------------- host layout


def _reads(t, trans, outer, k, prefer_kc=True, box_rows=128):
    """tma_reads on X = op(t) seen as outer x k (a's M x K when trans is trans_a)."""
    s0, s1 = t.stride()
    s_outer, s_k = (s1, s0) if trans else (s0, s1)
    return tma_reads(t, s_outer, s_k, outer, k, box_rows, prefer_kc)


def test_row_major_and_transposed_operands_are_read_as_stored():
    a = torch.empty(70, 96, dtype=torch.float16)
    assert _reads(a, False, 70, 96) == (True, _tma.Map2D(a.data_ptr(), 70, 96, 96, 128))  # K-major A
    # a^T as the operand (96 x 70, M contiguous): MN-major boxes of 64 x 64 over a's own rows
    assert _reads(a, True, 96, 70) == (False, _tma.Map2D(a.data_ptr(), 70, 96, 96, _tma.BOX_COLS))
    b = torch.empty(96, 72, dtype=torch.float16)  # a K x N operand, N contiguous: MN-major
    assert _reads(b, True, 72, 96) == (False, _tma.Map2D(b.data_ptr(), 96, 72, 72, _tma.BOX_COLS))


@pytest.mark.parametrize("shape,trans,outer,k", [
    ((1, 96), False, 1, 96),   # one row of A (M = 1): any row stride does
    ((96, 1), True, 1, 96),    # the same, stored as a column
    ((33, 1), False, 33, 1),   # K = 1: a column, read as one k row of 33 contiguous elements
    ((1, 33), True, 33, 1),
])
def test_vectors_are_read_both_ways(shape, trans, outer, k):
    t = torch.empty(shape, dtype=torch.float16)
    for prefer in (True, False):
        read = _reads(t, trans, outer, k, prefer_kc=prefer)
        assert read is not None, (shape, prefer)
        _, m = read
        assert m.readable() and m.row_stride_bytes() % 16 == 0 and (m.rows == 1 or m.ld >= m.cols)


@pytest.mark.parametrize("case", ["k_not_multiple_of_8", "offset_start", "strided_rows"])
def test_what_the_tma_cannot_read_is_refused(case):
    if case == "k_not_multiple_of_8":  # rows 14 bytes apart
        t, outer, k = torch.empty(40, 7, dtype=torch.float16), 40, 7
    elif case == "offset_start":  # one element into its allocation
        t, outer, k = torch.empty(40 * 64 + 1, dtype=torch.float16)[1:].view(40, 64), 40, 64
    else:  # every other column: no unit stride either way
        t, outer, k = torch.empty(40, 128, dtype=torch.float16)[:, ::2], 40, 64
    assert _reads(t, False, outer, k) is None


def test_maps_of_one_row_get_a_valid_stride():
    m = _tma.Map2D(0, 1, 33, 33, 64)
    assert m.readable() and m.row_stride_bytes() == 80  # 66 bytes rounded up to 16


def test_maps_of_32_bit_elements_count_four_bytes_an_element():
    """The 3xTF32 wgmma kernel's fp32 operands: rows 4 x ld bytes apart, readable where that is a
    multiple of 16 (ld a multiple of 4, where 16-bit rows need 8)."""
    assert _tma.Map2D(0, 40, 36, 36, 128, 4).readable() and not _tma.Map2D(0, 40, 36, 36, 128).readable()
    assert not _tma.Map2D(0, 40, 34, 34, 128, 4).readable()
    assert _tma.Map2D(0, 40, 36, 36, 128, 4).row_stride_bytes() == 144
    assert _tma.Map2D(0, 1, 33, 33, 128, 4).row_stride_bytes() == 144  # 132 bytes rounded up to 16


# ----------------------------------------------------------------------------- offline builds


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


@needs_nvcc
@pytest.mark.parametrize("dtype", WGMMA_DTYPES)
def test_every_tile_builds_for_sm90a_without_spills(dtype):
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]): c for c in wgmma_configs() if c["GROUP_M"] == 8}
    configs = list(tiles.values())
    for cfg, rep in zip(configs, kc.compile_reports("matmul", dtype, configs, 90)):
        assert rep["spill_bytes"] == 0 and 0 < rep["registers"] <= 255, (cfg, rep)
        assert rep["smem_bytes"] <= TC_SPACE.cost(cfg, 2, 90)["smem_bytes"], (cfg, rep)


@needs_nvcc
@pytest.mark.skipif(_cuobjdump() is None, reason="no cuobjdump (nvcc's or Triton's)")
def test_sass_issues_hgmma_and_tma_loads_in_every_layout(tmp_path):
    """The sm_90a build really runs on the warpgroup tensor cores (HGMMA, not HMMA) fed by the TMA
    (UTMALDG), with the producer giving registers away (USETMAXREG), for each operand layout."""
    cfg = TC_SPACE.resolve({"WGMMA": 1, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8}, 2, 90)
    exprs = [wgmma_variant(cfg, "fp16", a_kc, b_kc, True, True, True).name_expr
             for a_kc, b_kc in itertools.product((0, 1), repeat=2)]
    src = tmp_path / "w.cu"
    refs = ",\n".join(f"(void*)&{e}" for e in exprs)
    src.write_text(f'#include "matmul_wgmma.cu"\nvoid* const refs[] = {{{refs}}};\n')
    cubin = tmp_path / "w.cubin"
    subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
                    f"-I{os.path.dirname(kc.__file__)}", "-o", str(cubin), str(src)], check=True, capture_output=True)
    sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    per_kernel = sass.split("Function : ")[1:]
    assert len(per_kernel) == 4
    for text in per_kernel:
        assert "HGMMA.64x256x16.F32" in text and "UTMALDG.2D" in text and "USETMAXREG" in text, text[:200]
        assert "HMMA" not in text.replace("HGMMA", "")


# ----------------------------------------------------------------------------- on the GPU

def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90 = pytest.mark.skipif(not _sm90(), reason="the wgmma kernel runs on sm_90 only")

# Ragged everywhere the TMA allows (each stored row a multiple of 16 bytes, so M, N and K multiples
# of 8 or 1): M and N not multiples of any tile, K with a tail after its 64-wide slices, one row,
# one column, K = 8 (a single partial slice), and grids of more tiles than blocks (persistence).
GPU_SHAPES = [(1, 72, 96), (72, 1, 200), (136, 264, 8), (264, 200, 784), (1000, 1000, 1000), (1024, 2056, 520)]
GPU_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4},  # two consumers, one slab each
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},  # one consumer, two slabs
    {"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "GROUP_M": 1},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
]


def _cfg(c):
    return {"WGMMA": 1, "BLOCK_K": 64, "SPLIT_K": 1, **c}


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", WGMMA_DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_wgmma_matmul_against_float64(rng, m, n, k, trans_a, trans_b, dtype):
    config = _cfg(random.Random(f"{m}-{n}-{k}-{trans_a}-{trans_b}-{dtype}").choice(GPU_CONFIGS))
    a = randn(rng, (k, m) if trans_a else (m, k), dtype, "cuda")
    b = randn(rng, (n, k) if trans_b else (k, n), dtype, "cuda")
    bias = randn(rng, (n,), dtype, "cuda")
    out = poisoned((m, n), dtype, "cuda")
    kc.matmul(a, b, bias=bias, activation="relu", trans_a=trans_a, trans_b=trans_b, out=out, config=config)
    ref = exact.matmul(a, b, bias=bias, activation="relu", trans_a=trans_a, trans_b=trans_b)
    assert_rel(out, ref, matmul_tol(dtype, k), what=f"{config}")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: f"{c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}")
def test_every_tile_shape_without_bias(rng, config):
    a, b = randn(rng, (333, 520), "fp16", "cuda"), randn(rng, (520, 600), "fp16", "cuda")
    out = kc.matmul(a, b, config=_cfg(config))
    assert_rel(out, exact.matmul(a, b), matmul_tol("fp16", 520))


@pytest.mark.gpu
@sm90
def test_wgmma_call_replays_in_a_cuda_graph(rng):
    a, b, out = replayed_matmul(rng, "bf16", _cfg(GPU_CONFIGS[1]))
    assert_rel(out, exact.matmul(a, b), matmul_tol("bf16", 784))


def replayed_matmul(rng, dtype: str, config: dict):
    """(a, b, out): kc.matmul(a, b) of 300 x 784 by 784 x 136 captured in a CUDA graph (compiled, and
    its tensor maps encoded, by a call outside the capture), then replayed on new values of a."""
    a, b = randn(rng, (300, 784), dtype, "cuda"), randn(rng, (784, 136), dtype, "cuda")
    out = torch.empty(300, 136, dtype=contract.DTYPES[dtype], device="cuda")
    kc.matmul(a, b, out=out, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kc.matmul(a, b, out=out, config=config)
    a.copy_(randn(rng, (300, 784), dtype, "cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return a, b, out


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("what", ["k_not_multiple_of_8", "a_rows", "accumulate_fp16", "relu_grad_of"])
def test_calls_the_kernel_cannot_take_are_config_errors(rng, what):
    """Refused with a `config:` message (the tuner's invalid outcome), never run wrongly."""
    k = 90 if what == "k_not_multiple_of_8" else 96
    a, b = randn(rng, (64, k), "fp16", "cuda"), randn(rng, (k, 64), "fp16", "cuda")
    kwargs = {"a_rows": torch.arange(64, device="cuda")} if what == "a_rows" else \
        {"accumulate": "fp16"} if what == "accumulate_fp16" else \
        {"relu_grad_of": randn(rng, (64, 64), "fp16", "cuda")} if what == "relu_grad_of" else {}
    with pytest.raises(ValueError, match="^config: .*WGMMA=0"):
        kc.matmul(a, b, config=_cfg(GPU_CONFIGS[3]), **kwargs)


def test_a_persistent_kernel_launches_what_shared_memory_holds_and_no_more_blocks_than_tiles(monkeypatch):
    from kernels_cuda import _runtime as rt

    monkeypatch.setattr(rt, "sm_count", lambda index: 132)
    monkeypatch.setattr(rt, "device_props", lambda index: (90, 232448))
    assert rt.persistent_blocks(0, 1024, 197680) == 132  # one 193 KB ring an SM
    assert rt.persistent_blocks(0, 1024, 100000) == 264  # two an SM
    assert rt.persistent_blocks(0, 100, 100000) == 100  # fewer tiles than room
    assert rt.persistent_blocks(0, 1024, 300000) == 132  # over the opt-in limit: launch refuses it, not this
