"""CPU-only checks of kernels_cuda: every op's kernels build with nvcc for
sm_75 / sm_80 / sm_90 over a deterministic sample of each search space, and
the Python layer rejects bad configs and CPU tensors before compiling
anything. GPU correctness lives in tests/test_ops.py."""
from __future__ import annotations

import itertools
import math
import random
import re
import shutil
import subprocess

import pytest
import torch

import kernels_cuda as kc
from kernels_cuda import _runtime as rt
from kernels_cuda import reports
from kernels_core.contract import DTYPES, FUSED_OPS, OPS

ARCHS = (75, 80, 90)
GEMM_OPS = ("matmul",) + FUSED_OPS  # the ops of the matmul kernels: no bf16 before sm_80
SAMPLES = 8
FAST_SAMPLES = 3  # the fast tier's: the fused GEMMs' 1 + 8 configs take up to 10 CPU seconds of nvcc a case
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def _elt(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _sample(op: str, dtype: str, arch: int, samples: int = SAMPLES) -> list[dict]:
    """The arch's default first, then up to `samples` configs drawn with a fixed seed."""
    sp = kc.space(op, dtype)
    default = sp.default_for(arch)
    valid = [c for c in sp.configs(_elt(dtype), arch) if c != default]
    rng = random.Random(f"{op}-{dtype}-{arch}")
    return [default] + rng.sample(valid, min(samples, len(valid)))


CASES = [(op, dtype, arch) for arch in ARCHS for op in OPS for dtype in DTYPES]


@needs_nvcc
@pytest.mark.matrix
@pytest.mark.parametrize("op,dtype,arch", CASES, ids=[f"{o}-{d}-sm{a}" for o, d, a in CASES])
def test_space_sample_compiles(op, dtype, arch, request):
    if op in GEMM_OPS and dtype == "bf16" and arch < 80:
        pytest.skip("sm_75 tensor cores have no bf16 mma; matmul raises a clear error there")
    configs = _sample(op, dtype, arch, FAST_SAMPLES if request.config.getoption("--fast") else SAMPLES)
    reports = kc.compile_reports(op, dtype, configs, arch)
    sp = kc.space(op, dtype)
    assert len(reports) == len(configs)
    for cfg, rep in zip(configs, reports):
        assert set(rep) == {"registers", "smem_bytes", "spill_bytes", "compile_s"}
        assert 0 < rep["registers"] <= 255, (cfg, rep)
        # The space's smem expression is an upper bound (exact for all but matmul's layouts).
        assert rep["smem_bytes"] <= sp.cost(cfg, _elt(dtype), arch)["smem_bytes"], (cfg, rep)
        if op in GEMM_OPS + ("bias_grad", "softmax_cross_entropy"):
            assert rep["smem_bytes"] > 0, (cfg, rep)
    assert reports[0]["spill_bytes"] == 0, f"default config spills: {reports[0]}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", tuple(DTYPES))
def test_each_archs_default_is_valid(op, dtype, arch):
    sp = kc.space(op, dtype)
    problem = sp.violated(sp.default_for(arch), _elt(dtype), arch)
    if op in GEMM_OPS and dtype == "bf16" and arch < 80:
        assert problem == "restriction `arch >= 80` fails: bf16 tensor cores start at sm_80"  # pruned as invalid
        assert not list(sp.configs(_elt(dtype), arch))
    else:
        assert problem is None


def test_sm75_tensor_core_default_double_buffers_through_registers():
    sp = kc.space("matmul", "fp16")
    assert sp.default_for(75)["num_stages"] == 2 and sp.default_for(90)["num_stages"] == sp.default["num_stages"]
    assert sp.resolve(None, 2, 75) == sp.default_for(75)


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a compiler was invoked for a config that should have been rejected")

    monkeypatch.setattr(reports, "compile_variants", refuse)
    monkeypatch.setattr(rt, "function", refuse)


@pytest.mark.parametrize("op,dtype", [("matmul", "fp32"), ("matmul", "fp16"), ("relu", "bf16"),
                                      ("bias_grad", "fp32"), ("softmax_cross_entropy", "fp16")])
@pytest.mark.parametrize("bad,key", [
    ({"VEC": 3}, "VEC"),
    ({"num_warps": 1024}, "num_warps"),
    ({"VEC": 4.0}, "VEC"),
    ({"VEC": "4"}, "VEC"),
    ({"VEC": True}, "VEC"),
    ({"NOT_A_TUNABLE": 1}, "NOT_A_TUNABLE"),
])
def test_bad_config_rejected_before_compiling(no_compile, op, dtype, bad, key):
    with pytest.raises(ValueError, match=key):
        kc.compile_report(op, dtype, bad, 90)


def test_restriction_rejected_before_compiling(no_compile):
    with pytest.raises(ValueError, match="restriction"):
        kc.compile_report("matmul", "fp16", {"BLOCK_M": 256, "BLOCK_N": 256}, 90)
    with pytest.raises(ValueError, match="restriction.*split-K"):
        kc.compile_report("matmul", "fp16", {"SPLIT_K": 4, "GROUP_M": 1}, 90)
    with pytest.raises(ValueError, match="num_stages"):
        kc.compile_report("matmul", "fp16", {"num_stages": 4}, 75)
    with pytest.raises(ValueError, match="bf16"):
        kc.compile_report("matmul", "bf16", None, 75)
    with pytest.raises(TypeError, match="config"):
        kc.compile_report("relu", "fp32", [("VEC", 4)], 90)


def test_unknown_op_and_dtype():
    with pytest.raises(ValueError, match="op"):
        kc.space("conv", "fp32")
    with pytest.raises(ValueError, match="dtype"):
        kc.space("relu", "fp64")


def test_cpu_tensors_rejected(no_compile):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="a: .*CUDA"):
        kc.matmul(x, x.t())
    with pytest.raises(ValueError, match="x: .*CUDA"):
        kc.relu(x)
    with pytest.raises(ValueError, match="grad: .*CUDA"):
        kc.relu_backward(x, x)
    with pytest.raises(ValueError, match="x: .*CUDA"):
        kc.bias_add(x, torch.zeros(8))
    with pytest.raises(ValueError, match="grad: .*CUDA"):
        kc.bias_grad(x)
    with pytest.raises(ValueError, match="logits: .*CUDA"):
        kc.softmax_cross_entropy(x, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"params\[0\]: .*CUDA"):
        kc.sgd_update([torch.zeros(3)], [torch.zeros(3)], None, lr=0.1)


def test_bad_arguments_named(no_compile):
    with pytest.raises(TypeError, match="a:"):
        kc.matmul([[1.0]], torch.ones(1, 1))
    with pytest.raises(ValueError, match="b: inner dimensions"):
        kc.matmul(torch.ones(2, 3), torch.ones(4, 5))
    with pytest.raises(TypeError, match="x: dtype"):
        kc.relu(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="lr"):
        kc.sgd_update([], [], None, lr="fast")
    with pytest.raises(ValueError, match="momentum_bufs"):
        kc.sgd_update([torch.zeros(3)], [torch.zeros(3)], None, lr=0.1, momentum=0.9)


def test_import_needs_no_cupy():
    import subprocess
    import sys

    code = ("import sys; sys.modules['cupy'] = None; import kernels_cuda as kc; "
            "kc.space('matmul', 'fp16'); assert 'cupy' not in [m for m in sys.modules if sys.modules[m]]")
    subprocess.run([sys.executable, "-c", code], check=True)


CU_FILES = sorted(p.name for p in __import__("pathlib").Path(rt.HERE).glob("*.cu"))


# matmul_tc.cu's build line instantiates five kernels (fp16 and 3xTF32, plain and fused): 6-8 CPU s on
# two cores, at the fast tier's bound, so its case runs in the full tier only.
HEAVY_BUILDS = {"matmul_tc.cu"}


@needs_nvcc
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY_BUILDS else n
                                  for n in CU_FILES])
def test_each_cu_files_header_build_line_works(name):
    """The standalone build line at the top of every .cu file builds its default kernels (a learner's
    first command), and its resource report lists at least one kernel."""
    import shlex
    import subprocess

    with open(f"{rt.HERE}/{name}") as f:
        lines = [line for line in f.read().splitlines()[:12] if line.startswith("//   nvcc ")]
    assert len(lines) == 1, f"{name}: no '//   nvcc ...' build line near the top"
    cmd = shlex.split(lines[0][len("//   "):])
    done = subprocess.run(cmd, cwd=rt.HERE + "/..", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Used" in done.stdout + done.stderr, f"{name}: the build instantiated no kernel"


# ----------------------------------------------------------------------------- split-K and small tiles

# Configs the trainer's shapes want (16-wide tiles for N = 10 and M = 32, one-warp blocks, SPLIT_K
# from 2 to 64), over the arch's default for the rest; each must build on every arch without spilling
# more than ptxas does when it caps a kernel at 128 registers for occupancy (12 bytes here for
# 64 x 64 / 4 warps / SPLIT_K = 8 at sm_75; the split-K-free kernels show 8-16 bytes the same way).
MAX_SPILL = 16
SPLITK_SAMPLES = {
    "fp32": [
        {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 8, "THREAD_M": 4, "THREAD_N": 4, "SPLIT_K": 16},
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "THREAD_M": 2, "THREAD_N": 2, "SPLIT_K": 64},
        {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "THREAD_M": 4, "THREAD_N": 4, "SPLIT_K": 32},
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4, "SPLIT_K": 8},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "THREAD_M": 4, "THREAD_N": 4, "SPLIT_K": 4},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 8, "SPLIT_K": 2},
    ],
    "fp16": [
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 1, "SPLIT_K": 16},
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "SPLIT_K": 64},
        {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "SPLIT_K": 32},
        {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "SPLIT_K": 8},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 2, "SPLIT_K": 4},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "SPLIT_K": 8},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "SPLIT_K": 2},
    ],
}
SPLITK_CASES = [(dtype, arch) for arch in ARCHS for dtype in DTYPES if not (dtype == "bf16" and arch < 80)]


@needs_nvcc
@pytest.mark.matrix
@pytest.mark.parametrize("dtype,arch", SPLITK_CASES, ids=[f"{d}-sm{a}" for d, a in SPLITK_CASES])
def test_splitk_and_small_tile_configs_compile(dtype, arch):
    sp = kc.space("matmul", dtype)
    configs = [sp.resolve(c, _elt(dtype), arch) for c in SPLITK_SAMPLES["fp32" if dtype == "fp32" else "fp16"]]
    for cfg, rep in zip(configs, kc.compile_reports("matmul", dtype, configs, arch)):
        assert 0 < rep["registers"] <= 255 and rep["spill_bytes"] <= MAX_SPILL, (cfg, rep)
        assert 0 < rep["smem_bytes"] <= sp.cost(cfg, _elt(dtype), arch)["smem_bytes"], (cfg, rep)


# Split-K's epilogues beyond bias and ReLU: (HAS_BIAS, RELU, A_ROWS, EPI). Gathered rows move the
# index vector rather than A when k runs along A's rows (enter_slice); linear_cross_entropy's last
# slice runs the row-tile loss protocol after the tile's own.
SPLITK_FUSED = ((0, 0, 1, "plain"), (0, 0, 0, "relu_grad"), (0, 0, 1, "relu_grad"), (1, 0, 0, "xent"))


@needs_nvcc
@pytest.mark.slow  # 6-10 CPU seconds of nvcc a case
@pytest.mark.parametrize("dtype,arch", SPLITK_CASES, ids=[f"{d}-sm{a}" for d, a in SPLITK_CASES])
def test_splitk_builds_for_every_layout_and_epilogue(dtype, arch):
    """A slice moves A and B along k one way per layout (enter_slice), and the last arrival
    runs every epilogue: each combination, fp16 accumulation included, must build."""
    from kernels_cuda.matmul import simt_variant, tc_variant

    sp = kc.space("matmul", dtype)
    cfg = sp.resolve({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16 if dtype == "fp32" else 32, "SPLIT_K": 4,
                      **({"THREAD_M": 4, "THREAD_N": 4} if dtype == "fp32" else {"num_warps": 1})}, _elt(dtype), arch)
    vec = 16 // _elt(dtype)
    variants = []
    for a_kc, b_kc in itertools.product((0, 1), (0, 1)):
        for epilogue in ((0, 0), (1, 1), (1, 0)):
            if dtype == "fp32":
                variants.append(simt_variant(cfg, a_kc, b_kc, vec, 1, *epilogue))
            else:
                for acc16 in ((0, 1) if dtype == "fp16" else (0,)):
                    variants.append(tc_variant(cfg, dtype, arch, a_kc, b_kc, vec, 2, *epilogue, acc16))
        for has_bias, relu, a_rows, epi in SPLITK_FUSED:
            if dtype == "fp32":
                variants.append(simt_variant(cfg, a_kc, b_kc, vec, 1, has_bias, relu, a_rows, epi))
            else:
                variants.append(tc_variant(cfg, dtype, arch, a_kc, b_kc, vec, 2, has_bias, relu, 0, a_rows, epi))
    smem = sp.cost(cfg, _elt(dtype), arch)["smem_bytes"]
    for v, rep in zip(variants, reports.compile_variants(variants, [smem] * len(variants), arch)):
        assert 0 < rep["registers"] <= 255, (v.name_expr, rep)


def _ptx(variant: rt.Variant, arch: int, tmp_path) -> list[str]:
    """The instructions of one kernel instantiation's PTX, in order."""
    import subprocess

    tu = tmp_path / "one.cu"
    tu.write_text(f'#include "{variant.source}"\nvoid* const kernel_ref = (void*)&{variant.name_expr};\n')
    out = tmp_path / "one.ptx"
    subprocess.run(["nvcc", "-std=c++17", "-ptx", f"-arch=sm_{arch}", f"-I{rt.HERE}", "-o", str(out), str(tu)],
                   check=True, capture_output=True)
    return [line.strip() for line in out.read_text().splitlines() if line.strip() and not line.strip().startswith("//")]


@needs_nvcc
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_splitk_handshake_in_ptx(dtype, tmp_path):
    """The order kernels_cuda/splitk.cuh (splitk_arrive_last) argues for, in the compiled code:
    partial stores, bar.sync, release fence, the one atomic, acquire fence, bar.red.or, and only
    then the .cg loads of the other slices. SPLIT_K = 1 compiles none of it."""
    from kernels_cuda.matmul import report_variant

    sp = kc.space("matmul", dtype)

    def instructions(split_k, tmp):
        tmp.mkdir()
        cfg = sp.resolve({"BLOCK_M": 32, "BLOCK_N": 32, "SPLIT_K": split_k,
                          **({"THREAD_M": 4, "THREAD_N": 4} if dtype == "fp32" else {"num_warps": 1})}, _elt(dtype))
        return _ptx(report_variant("matmul", dtype, cfg, 90)[0], 90, tmp)

    marks = ("atom.", "red.", "membar", "fence.", "ld.global.cg")
    assert not [i for i in instructions(1, tmp_path / "one") if i.startswith(marks)]

    code = instructions(4, tmp_path / "four")
    where = lambda prefix: [n for n, i in enumerate(code) if i.startswith(prefix)]
    (atom,) = where("atom.global.add")
    release, acquire = where("membar.gl")
    (vote,) = where("bar.red.or")
    partial_stores = [n for n in where("st.global.v4.f32") if n < atom]
    assert partial_stores
    assert max(partial_stores) < max(n for n in where("bar.sync") if n < release) < release < atom < acquire < vote
    loads = where("ld.global.cg")
    assert loads and min(loads) > vote


# ----------------------------------------------------------------------------- fused paths

# (A_KC, B_KC, HAS_BIAS, RELU, A_ROWS, EPI) of the paths the fused ops and matmul's a_rows /
# relu_grad_of launch: gathered rows along M (a batch of a dataset, k contiguous) and along K
# (x_rows of x^T); relu_grad_of on dy @ w^T (B k-contiguous) and on a gathered batch;
# linear_cross_entropy as the trainer calls it and on transposed operands (ptxas gave that one
# the most registers of every layout); linear_sgd's x^T @ dy, with x_rows, and transposed.
FUSED_VARIANTS = (
    (1, 0, 1, 1, 1, "plain"), (0, 0, 1, 1, 1, "plain"),
    (1, 1, 0, 0, 0, "relu_grad"), (1, 0, 0, 0, 1, "relu_grad"),
    (1, 0, 1, 0, 0, "xent"), (0, 1, 0, 0, 0, "xent"),
    (0, 0, 0, 0, 0, "sgd"), (0, 0, 0, 0, 1, "sgd"), (1, 1, 0, 0, 0, "sgd"),
)


@needs_nvcc
@pytest.mark.slow  # about two minutes of nvcc; each op's representative variant is in test_space_sample_compiles
@pytest.mark.parametrize("dtype,arch", SPLITK_CASES, ids=[f"{d}-sm{a}" for d, a in SPLITK_CASES])
def test_fused_paths_build_without_spills(dtype, arch):
    """Every fused path on the arch's default config builds without spilling: a gathered load or
    a fused epilogue must not cost the GEMM its registers (ptxas gives the plain kernels of these
    configs 128 registers in fp32, 168-238 in fp16/bf16, no spills; the fused paths 123-151 and
    166-242 when this test was written)."""
    from kernels_cuda.matmul import simt_variant, tc_variant

    sp = kc.space("matmul", dtype)
    cfg = sp.default_for(arch)
    vec = 16 // _elt(dtype)
    variants = [simt_variant(cfg, a_kc, b_kc, vec, vec, bias, relu, rows, epi) if dtype == "fp32" else
                tc_variant(cfg, dtype, arch, a_kc, b_kc, vec, vec, bias, relu, 0, rows, epi)
                for a_kc, b_kc, bias, relu, rows, epi in FUSED_VARIANTS]
    smem = sp.cost(cfg, _elt(dtype), arch)["smem_bytes"]
    for v, rep in zip(variants, reports.compile_variants(variants, [smem] * len(variants), arch)):
        assert 0 < rep["registers"] <= 255 and rep["spill_bytes"] == 0, (v.name_expr, rep)


@needs_nvcc
@pytest.mark.slow  # about 20 s of nvcc per arch
@pytest.mark.parametrize("arch", [a for a in ARCHS if a >= 80])
def test_simt_ring_builds_for_every_layout_and_epilogue(arch, tmp_path):
    """The SIMT kernel's cp.async ring (num_stages 3 and 4) in every layout and epilogue, gathered
    rows and split-K included, on a thread tile of 2 x 2, 4 x 4 and 8 x 2: at most 32 bytes of
    spills (ptxas may park a few values that live across the whole loop, stored before it and
    loaded after: 20 bytes in xent on k-contiguous operands at sm_80 when this was written); only
    16-byte copies in the PTX of aligned operands (a k-contiguous one is kept as it is stored), no
    cp.async in num_stages 2's; and sm_75, which has no cp.async, has no such config."""
    from kernels_cuda.matmul import SIMT_SPACE, simt_variant

    cfgs = [SIMT_SPACE.resolve(c, 4, arch) for c in (
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "THREAD_M": 2, "THREAD_N": 2, "num_stages": 3, "SPLIT_K": 16},
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "THREAD_M": 4, "THREAD_N": 4, "num_stages": 4, "SPLIT_K": 4},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "THREAD_M": 8, "THREAD_N": 2, "num_stages": 4, "GROUP_M": 1})]
    variants, smem = [], []
    for cfg in cfgs:
        for a_kc, b_kc in itertools.product((0, 1), (0, 1)):
            for has_bias, relu, a_rows, epi in ((1, 1, 0, "plain"), (1, 1, 1, "plain"), (0, 0, 1, "relu_grad"),
                                                (1, 0, 0, "xent"), (0, 0, 1, "sgd")):
                if epi == "sgd" and cfg["SPLIT_K"] > 1:
                    continue
                for va, vb in ((4, 4),) + (((1, 2),) if epi == "plain" else ()):
                    variants.append(simt_variant(cfg, a_kc, b_kc, va, vb, has_bias, relu, a_rows, epi))
                    smem.append(SIMT_SPACE.cost(cfg, 4, arch)["smem_bytes"])
    for v, rep in zip(variants, reports.compile_variants(variants, smem, arch)):
        assert 0 < rep["registers"] <= 255 and rep["spill_bytes"] <= 32, (v.name_expr, rep)
    nn = next(v for v in variants if v.targs[10:12] == (1, 0))  # A's rows kept k-contiguous (SimtTile::DK)
    ring = {i.split()[0] for i in _ptx(nn, arch, tmp_path) if i.startswith("cp.async")}
    assert ring == {"cp.async.cg.shared.global", "cp.async.commit_group;", "cp.async.wait_group"}, ring
    two = simt_variant({**cfgs[0], "num_stages": 2}, 1, 0, 4, 4, 1, 1, 0, "plain")
    assert not [i for i in _ptx(two, arch, tmp_path) if i.startswith("cp.async")]
    assert not [c for c in SIMT_SPACE.configs(4, 75) if c["num_stages"] > 2]


@needs_nvcc
@pytest.mark.slow  # about 25 s of nvcc
def test_simt_configs_at_the_register_rules_edge_build_without_real_spills():
    """The SIMT space allows THREAD_M * THREAD_N accumulators + staged copies up to 96 floats per
    thread (kernels_cuda/matmul.py). The configs at the rule's edge (the most floats per thread
    the space allows for each thread tile, with BLOCK_K >= 64 and two stages; of each, the
    smallest and the largest block) spilled at most 24 bytes under ptxas for sm_90 (64 x 64 x 64
    on 4 x 8 threads, both operands k-contiguous), where configs of 112 spilled up to 204: a rule
    moved past what the registers hold moves this edge, and fails here."""
    from kernels_cuda.matmul import SIMT_SPACE, simt_variant

    def floats(c):
        return c["THREAD_M"] * c["THREAD_N"] + c["BLOCK_K"] * (c["BLOCK_M"] + c["BLOCK_N"]) * (
            c["THREAD_M"] * c["THREAD_N"]) / (c["BLOCK_M"] * c["BLOCK_N"])

    wide = [c for c in SIMT_SPACE.configs(4, 90)
            if c["BLOCK_K"] >= 64 and c["num_stages"] == 2 and c["SPLIT_K"] == 1 and c["GROUP_M"] == 1]
    edge = []
    for tile in sorted({(c["THREAD_M"], c["THREAD_N"]) for c in wide}):
        mine = [c for c in wide if (c["THREAD_M"], c["THREAD_N"]) == tile]
        top = [c for c in mine if floats(c) == max(map(floats, mine))]
        edge += {id(c): c for c in (min(top, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"]),
                                    max(top, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"]))}.values()
    assert len(edge) >= 3
    # The forward product, linear_sgd's x^T @ dy, relu_grad_of's dy @ w^T.
    layouts = ((1, 0, 1, 1, 0, "plain"), (0, 0, 0, 0, 0, "sgd"), (1, 1, 0, 0, 0, "relu_grad"))
    variants = [simt_variant(cfg, a_kc, b_kc, 4, 4, bias, relu, rows, epi)
                for cfg in edge for a_kc, b_kc, bias, relu, rows, epi in layouts]
    smem = [SIMT_SPACE.cost(cfg, 4, 90)["smem_bytes"] for cfg in edge for _ in layouts]
    for v, rep in zip(variants, reports.compile_variants(variants, smem, 90)):
        assert 0 < rep["registers"] <= 255 and rep["spill_bytes"] <= 32, (v.name_expr, rep)


@needs_nvcc
@pytest.mark.slow  # about 20 s of nvcc
def test_tensor_core_k_steps_of_128_build_without_spills():
    """BLOCK_K = 128 on the mma.sync kernel, at the smallest tile (16 x 16, one warp, 4 stages) and
    at a large one (64 x 128, 8 warps, 3 stages: 156 KiB of ring), for the forward product with
    gathered rows, linear_sgd and the loss: ptxas (sm_90) spilled none of 56 such variants. And one
    warp reading k-contiguous rows of 128 4 bytes at a time (K = 10), which TcTile::Async's chunk map
    cannot cover (it static_asserts): the kernel must take load_async there, and so build (ptxas
    spilled 13 KB of its 64 copies per stage: a slow config, which the tuner times as such)."""
    from kernels_cuda.matmul import TC_SPACE, tc_variant

    configs = [{**TC_SPACE.default, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 128, "num_warps": w, "num_stages": st,
                "GROUP_M": 1} for m, n, w, st in ((16, 16, 1, 4), (64, 128, 8, 3))]
    paths = ((1, 0, 1, 1, 1, "plain"), (0, 0, 0, 0, 0, "sgd"), (1, 0, 1, 0, 0, "xent"))
    variants, smem = [], []
    for cfg in configs:
        assert TC_SPACE.violated(cfg, 2, 90) is None, cfg
        for a_kc, b_kc, bias, relu, rows, epi in paths:
            variants.append(tc_variant(cfg, "fp16", 90, a_kc, b_kc, 8, 8, bias, relu, 0, rows, epi))
            smem.append(TC_SPACE.cost(cfg, 2, 90)["smem_bytes"])
    narrow = {**configs[0], "BLOCK_M": 32, "BLOCK_N": 64, "num_stages": 2}
    variants.append(tc_variant(narrow, "fp16", 90, 1, 1, 2, 2, 0, 0, 0, 0, "relu_grad"))
    smem.append(TC_SPACE.cost(narrow, 2, 90)["smem_bytes"])
    reps = reports.compile_variants(variants, smem, 90)
    for v, rep in zip(variants[:-1], reps):
        assert 0 < rep["registers"] <= 255 and rep["spill_bytes"] == 0, (v.name_expr, rep)
    assert not reps[-1].get("error") and 0 < reps[-1]["registers"] <= 255, (variants[-1].name_expr, reps[-1])


@needs_nvcc
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_row_tile_loss_protocol_in_ptx(dtype, tmp_path):
    """linear_cross_entropy's deterministic mean in the compiled code, in the order fused.cuh and splitk.cuh
    (xent_tile, splitk_arrive_last) argues for: the tile's slot store, bar.sync, release fence,
    the loss counter's atomic (without split-K the only one), acquire fence, bar.red.or, then
    the .cg loads of the slots, and the loss's store after them."""
    from kernels_cuda import fused

    cfg = kc.space("linear_cross_entropy", dtype).resolve(
        {"BLOCK_M": 32, "BLOCK_N": 32, **({"THREAD_M": 4, "THREAD_N": 4} if dtype == "fp32" else {"num_warps": 1})},
        _elt(dtype))
    code = _ptx(fused.report_variant("linear_cross_entropy", dtype, cfg, 90)[0], 90, tmp_path)
    where = lambda prefix: [n for n, i in enumerate(code) if i.startswith(prefix)]
    (atom,) = where("atom.global.add")
    release, acquire = where("membar.gl")
    (vote,) = where("bar.red.or")
    slot = max(n for n in where("st.global.f32") if n < atom)
    assert slot < max(n for n in where("bar.sync") if n < release) < release < atom < acquire < vote
    loads = where("ld.global.cg.f32")
    assert loads and min(loads) > vote
    assert max(where("st.global.f32")) > max(loads)


@pytest.mark.parametrize("arch", ARCHS)
def test_tc_warp_grid_is_one_the_kernel_runs(arch):
    """The tensor-core kernel's warp grid is derived (matmul.warp_grid), so the space's rules
    must admit only configs whose grid gives warp tiles of whole fragment pairs (16 x 16),
    32 x 32 to 64 x 64 (smaller only in one-warp blocks), at most 2:1; in blocks of at most 512
    outputs on 2-4 warps, warp tiles of 16 x 8 to 32 x 16 (one n-tile: ldmatrix x2)."""
    from kernels_cuda.matmul import warp_grid

    sp = kc.space("matmul", "fp16")
    configs = list(sp.configs(2, arch))
    assert configs
    for cfg in configs:
        gm, gn = warp_grid(cfg)
        wm, wn = cfg["BLOCK_M"] // gm, cfg["BLOCK_N"] // gn
        assert gm * gn == cfg["num_warps"] and (wm * gm, wn * gn) == (cfg["BLOCK_M"], cfg["BLOCK_N"]), cfg
        assert max(wm, wn) <= 2 * min(wm, wn), cfg
        if cfg["num_warps"] > 1 and cfg["BLOCK_M"] * cfg["BLOCK_N"] <= 512 and not cfg["WGMMA"]:
            assert wm % 16 == 0 and wn % 8 == 0 and 16 * 8 <= wm * wn <= 32 * 16, cfg
            continue
        assert wm % 16 == 0 and wn % 16 == 0, cfg
        assert wm * wn <= 64 * 64 and (wm * wn >= 32 * 32 or cfg["num_warps"] == 1), cfg
    # The defaults keep the grids they had when the grid was tunable.
    assert warp_grid(sp.default_for(90)) == (2, 2) and warp_grid(sp.default_for(75)) == (2, 4)


@pytest.mark.parametrize("dtype", tuple(DTYPES))
def test_matmul_space_is_dense_enough_to_search(dtype):
    """A sampler that suggests each tunable on its own (among the values valid configs use), the
    tuner's `--sampler tpe`, gives up a study after 100 invalid suggestions in a row
    (autotune.samplers; the default, tpe-valid, suggests valid configs only). Replaying plain TPE on
    the spaces before split-K (valid fraction 0.13-0.20) and with it (0.14-0.15), no run came
    within 60 of that; at 0.08, one in four came within 6. The wgmma kernel (WGMMA=1, sm_90 only)
    adds a sparse region: the whole fp16 space at sm_90 was 0.075 dense, and 8 replays of 60 trials
    on it (fake times) never gave up (experiments/FINDINGS.md, "wgmma + TMA kernel on Hopper"). SPLIT_K 32 and 64 (experiments/FINDINGS.md, "Split-K") take
    the whole fp16 space to 0.069, where 1 of 8 replays gave up after 48 trials, and the SIMT space
    to 0.106, where none of 8 did (results/h200/splitk64_space_replay_*.txt): these bounds are that
    edge. The mma.sync region keeps its density. The fp32 space is a union of three kernels, each
    with tunables the others fix (SIMT for TF32 = 0, mma.sync for TF32 > 0 and WGMMA = 0, wgmma on
    split operands for WGMMA = 1, sm_90 only): each region keeps the SIMT space's density, and the
    whole's sets how many invalid suggestions in a row the tuner waits through (autotune.studies:
    StudyRunner.patience)."""
    sp = kc.space("matmul", dtype)
    valid = list(sp.configs(_elt(dtype), 90))

    def density(configs):
        return len(configs) / math.prod(len({c[name] for c in configs}) for name in sp.params)

    if "TF32" in sp.params:
        assert density([c for c in valid if not c["TF32"]]) >= 0.10
        assert density([c for c in valid if c["TF32"] and not c["WGMMA"]]) >= 0.10
        assert density([c for c in valid if c["WGMMA"]]) >= 0.10
    else:
        assert density(valid) >= 0.065
        assert density([c for c in valid if not c["WGMMA"]]) >= 0.12


@pytest.mark.parametrize("mangled,expr", [
    ("_Z20relu_backward_kernelILi2ELi4ELi4ELi128EEvPKN3EltIXT_EE1TES4_PS2_x", "relu_backward_kernel<2,4,4,128>"),
    ("_Z18matmul_simt_kernelILi64ELi64ELi16ELi4ELi4ELi4ELi4ELi1ELi1ELi1ELi1ELi0ELi0ELi0EEvPKfS1_S1_PfiiixxS2_Pii",
     "matmul_simt_kernel<64,64,16,4,4,4,4,1,1,1,1,0,0,0>"),
    ("_Z3fooILin5ELj7EEvv", "foo<-5,7>"),
])
def test_ptxas_names_are_read_without_a_demangler(mangled, expr):
    """The H200's image printed ptxas's kernel names through c++filt in a form nothing matched, so
    every compile report failed there: the name expression is read off the mangling itself."""
    assert reports._name_expr(mangled) == expr


# ----------------------------------------------------------------------------- fp32 on TF32 tensor cores

# (A_KC, B_KC, HAS_BIAS, RELU, A_ROWS, EPI) of the fp32 tensor-core paths: every operand layout
# (k along the tiles' rows takes 32-bit shared loads, along their columns ldmatrix), and each
# fused epilogue in the layout the trainer runs it.
TF32_PATHS = [(a_kc, b_kc, 1, 1, 0, "plain") for a_kc, b_kc in itertools.product((0, 1), repeat=2)] + [
    (1, 0, 0, 0, 1, "plain"), (1, 1, 0, 0, 0, "relu_grad"), (1, 0, 1, 0, 0, "xent"), (0, 0, 0, 0, 1, "sgd")]


def _tf32_variants(cfg, arch):
    """TF32_PATHS' variants of cfg (linear_sgd's only without split-K)."""
    from kernels_cuda.matmul import tc_variant

    return [tc_variant(cfg, "fp32", arch, a_kc, b_kc, 4, 4, bias, relu, 0, rows, epi)
            for a_kc, b_kc, bias, relu, rows, epi in TF32_PATHS if epi != "sgd" or cfg["SPLIT_K"] == 1]


@needs_nvcc
@pytest.mark.slow  # about 40 s of nvcc per arch
@pytest.mark.parametrize("arch", (80, 90))
def test_tf32_paths_build_without_spills(arch):
    """3xTF32 and plain TF32 on every layout and fused path, a one-warp split-K tile and a large
    one of the fused ops' largest 3xTF32 warp tiles (64 x 32), at 16-byte and 4-byte copies."""
    sp = kc.space("linear_sgd", "fp32")
    variants, smem = [], []
    for tf32 in (3, 1):
        for tile in ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "SPLIT_K": 1},
                     {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3}):
            cfg = sp.resolve({**tile, "TF32": tf32}, 4, arch)
            for split in (1, 4) if tile["num_warps"] == 1 else (1,):
                built = _tf32_variants({**cfg, "SPLIT_K": split}, arch)
                variants += built
                smem += [sp.cost(cfg, 4, arch)["smem_bytes"]] * len(built)
    for v, rep in zip(variants, reports.compile_variants(variants, smem, arch)):
        assert 0 < rep["registers"] <= 255 and rep["spill_bytes"] == 0, (v.name_expr, rep)


@needs_nvcc
@pytest.mark.parametrize("arch", (80, 90))
def test_tf32_sass_runs_three_tf32_mmas_per_product_and_no_16_bit_ones(arch, tmp_path):
    """The fp32 tensor-core kernel issues TF32 HMMAs (m16n8k8) only, three times as many in 3xTF32
    as in plain TF32 on the same tile, in both layouts of A (ldmatrix, and 32-bit shared loads)."""
    from tests.test_wgmma import _cuobjdump

    if _cuobjdump() is None:
        pytest.skip("no cuobjdump (nvcc's or Triton's)")
    sp = kc.space("matmul", "fp32")
    counts = {}
    for tf32 in (3, 1):
        cfg = sp.resolve({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "TF32": tf32}, 4, arch)
        for a_kc in (1, 0):
            v = _tf32_variants(cfg, arch)[1 if a_kc else 0]  # bias + ReLU, B k-major; A either way
            src, cubin = tmp_path / f"t{tf32}{a_kc}.cu", tmp_path / f"t{tf32}{a_kc}.cubin"
            src.write_text(f'#include "matmul_tc.cu"\nvoid* const refs[] = {{(void*)&{v.name_expr}}};\n')
            subprocess.run(["nvcc", "-cubin", f"-arch=sm_{arch}", "-std=c++17", f"-I{rt.HERE}", "-o", str(cubin),
                            str(src)], check=True, capture_output=True)
            sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True,
                                  text=True).stdout
            hmma = re.findall(r"HMMA\.[0-9A-Z.]+", sass)
            assert hmma and set(hmma) == {"HMMA.1688.F32.TF32"}, sorted(set(hmma))
            counts[tf32, a_kc] = len(hmma)
    assert counts[3, 1] == 3 * counts[1, 1] and counts[3, 0] == 3 * counts[1, 0], counts
