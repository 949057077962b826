"""CPU-only checks of kernels_cuda: every op's kernels build with nvcc for
sm_75 / sm_80 / sm_90 over a deterministic sample of each search space, and
the Python layer rejects bad configs and CPU tensors before compiling
anything. GPU correctness lives in tests/test_ops.py."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

import kernels_cuda as kc
from kernels_cuda import _runtime as rt
from kernels_cuda import reports
from kernels_core.contract import DTYPES, OPS

ARCHS = (75, 80, 90)
SAMPLES = 8
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def _elt(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _sample(op: str, dtype: str, arch: int) -> list[dict]:
    """The arch's default first, then up to SAMPLES configs drawn with a fixed seed."""
    sp = kc.space(op, dtype)
    default = sp.default_for(arch)
    valid = [c for c in sp.configs(_elt(dtype), arch) if c != default]
    rng = random.Random(f"{op}-{dtype}-{arch}")
    return [default] + rng.sample(valid, min(SAMPLES, len(valid)))


CASES = [(op, dtype, arch) for arch in ARCHS for op in OPS for dtype in DTYPES]


@needs_nvcc
@pytest.mark.parametrize("op,dtype,arch", CASES, ids=[f"{o}-{d}-sm{a}" for o, d, a in CASES])
def test_space_sample_compiles(op, dtype, arch):
    if op == "matmul" and dtype == "bf16" and arch < 80:
        pytest.skip("sm_75 tensor cores have no bf16 mma; matmul raises a clear error there")
    configs = _sample(op, dtype, arch)
    reports = kc.compile_reports(op, dtype, configs, arch)
    sp = kc.space(op, dtype)
    assert len(reports) == len(configs)
    for cfg, rep in zip(configs, reports):
        assert set(rep) == {"registers", "smem_bytes", "spill_bytes", "compile_s"}
        assert 0 < rep["registers"] <= 255, (cfg, rep)
        # The space's smem expression is an upper bound (exact for all but matmul's layouts).
        assert rep["smem_bytes"] <= sp.cost(cfg, _elt(dtype), arch)["smem_bytes"], (cfg, rep)
        if op in ("matmul", "bias_grad", "softmax_cross_entropy"):
            assert rep["smem_bytes"] > 0, (cfg, rep)
    assert reports[0]["spill_bytes"] == 0, f"default config spills: {reports[0]}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", tuple(DTYPES))
def test_each_archs_default_is_valid(op, dtype, arch):
    sp = kc.space(op, dtype)
    problem = sp.violated(sp.default_for(arch), _elt(dtype), arch)
    if op == "matmul" and dtype == "bf16" and arch < 80:
        assert problem == "restriction `arch >= 80` fails: bf16 tensor cores start at sm_80"  # pruned as invalid
        assert not list(sp.configs(_elt(dtype), arch))
    else:
        assert problem is None


def test_sm75_tensor_core_default_double_buffers_through_registers():
    sp = kc.space("matmul", "fp16")
    assert sp.default_for(75)["num_stages"] == 2 and sp.default_for(90)["num_stages"] == sp.default["num_stages"]
    assert sp.resolve(None, 2, 75) == sp.default_for(75)


def test_spaces_are_searchable():
    assert 50 <= len(list(kc.space("matmul", "fp32").configs(4, 90))) <= 2000
    assert 50 <= len(list(kc.space("matmul", "fp16").configs(2, 90))) <= 2000


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
        kc.compile_report("matmul", "fp16", {"WARPS_M": 4, "WARPS_N": 4}, 90)
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


@needs_nvcc
@pytest.mark.parametrize("name", CU_FILES)
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
