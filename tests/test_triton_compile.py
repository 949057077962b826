"""The Triton kernels compile for real GPUs, checked on a machine without one.

Triton's interpreter runs kernels without compiling them, so a kernel that
passes test_ops.py on a CPU may still fail to build for a GPU. Here every op's
default config and a deterministic sample of others are compiled offline
through `compile_report` for sm_75, sm_80 and sm_90, in one helper process
with the interpreter off (the interpreter and the compiler cannot share a
process; see kernels_triton/reports.py), and so are the fused step's paths
that no op's sample plan takes (matmul's gathers and ReLU-gradient mask, the
fused loss on split-K).
"""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import kernels_triton
from kernels_core import contract

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = (75, 80, 90)
SMEM_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}  # opt-in bytes per block


def _cases():
    cases = []
    for op in contract.OPS:
        for dtype in contract.DTYPES:
            elt = contract.DTYPES[dtype].itemsize
            for arch in ARCHS:
                sp = kernels_triton.space(op, dtype)
                cases.append((op, dtype, arch, "default", None))
                fitting = [c for c in sp.configs(elt, arch) if sp.cost(c, elt, arch)["smem_bytes"] <= SMEM_LIMIT[arch]]
                for i, cfg in enumerate(random.Random(f"{op}/{dtype}/{arch}").sample(fitting, min(2, len(fitting)))):
                    if cfg != sp.default:
                        cases.append((op, dtype, arch, f"sample{i}", cfg))
    return cases


# Split-K and small-tile matmuls the interpreter cannot vouch for: the
# arrival counter's atomic, the ".cg" reads of the partials, 16-wide dots on
# two warps. Each with the tensor-core instructions its dot must lower to on
# that arch: none for exact fp32 (TF32 = 0), which stays on the FMA units
# ("ieee"); TF32 ones (3xTF32 and plain TF32) for fp32 with TF32 > 0.
_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K")
SPLITK_CASES = [
    (dtype, arch, dict(zip(_TILE, tile), GROUP_M=1), instruction)
    for dtype, arch, tile, instruction in [
        ("fp32", 90, (64, 64, 32, 4, 4, 16), []),
        ("fp32", 90, (16, 16, 32, 2, 3, 8), []),
        ("fp32", 90, (128, 16, 64, 4, 4, 16), []),
        ("fp32", 80, (32, 32, 32, 2, 4, 8), []),
        ("fp16", 90, (64, 64, 64, 4, 4, 4), ["wgmma"]),  # a warpgroup per 64 rows
        ("fp16", 90, (128, 32, 64, 8, 3, 2), ["wgmma"]),
        ("bf16", 90, (64, 32, 64, 4, 3, 16), ["wgmma"]),
        ("fp16", 90, (16, 16, 64, 2, 4, 16), ["mma.sync"]),  # under 64 rows or 4 warps: Ampere's mma
        ("bf16", 90, (32, 32, 64, 2, 4, 8), ["mma.sync"]),
        ("fp16", 90, (16, 128, 64, 4, 4, 2), ["mma.sync"]),
        ("fp16", 80, (16, 16, 32, 2, 3, 16), ["mma.sync"]),
        ("bf16", 80, (64, 64, 64, 4, 4, 8), ["mma.sync"]),
    ]
] + [
    ("fp32", arch, dict(zip(_TILE, tile), GROUP_M=1, TF32=tf32), instruction)
    for arch, tile, tf32, instruction in [
        (90, (64, 64, 32, 4, 3, 1), 3, ["wgmma", "tf32"]),
        (90, (128, 128, 32, 8, 3, 1), 3, ["wgmma", "tf32"]),
        (90, (16, 16, 32, 2, 3, 4), 3, ["mma.sync", "tf32"]),
        (80, (32, 32, 32, 2, 4, 1), 3, ["mma.sync", "tf32"]),
        (90, (64, 64, 32, 4, 3, 1), 1, ["wgmma", "tf32"]),
    ]
]
CASES = _cases() + [("matmul", dtype, arch, f"splitk{i}", cfg) for i, (dtype, arch, cfg, _) in enumerate(SPLITK_CASES)]

# fp32 on TF32 tensor cores with the operands split per tile and split ahead, on sm_90: wgmma
# either way. Split per tile, the parts are made in registers and stored back into shared memory
# (k-major, as wgmma's tf32 form reads them) every k step; split ahead, they arrive there in
# 16-byte copies (cp.async.cg) and nothing else is stored but the epilogue's.
SPLIT_AHEAD_CASES = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1,
                          TF32=tf32, SPLIT_AHEAD=ahead) for tf32 in (3, 1) for ahead in (0, 1)]

# The fused step's paths that no sample plan of compile_report takes, on the trainer's shapes
# (built in the helper process by _SCRIPT's fused_path_plan), each with what its PTX must hold:
# matmul gathering rows along M (the first forward) and along K (split-K slices offset their
# gather), the ReLU-gradient mask, and the loss on split-K, whose two last-arrival protocols
# need their acquire-release atomics, L2 (".cg") reads and the correctly rounded sum / M.
# Tiles that compile without spills on sm_75 as well (a 64x64 16-bit matmul spills there, plain or not).
_SMALL = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=1)
_PROTOCOL = ["atom.global.gpu.acq_rel.add", "ld.global.cg", "div.rn.f32"]
FUSED_PATH_CASES = [
    (path, dtype, arch, config, ptx)
    for arch in ARCHS
    for path, dtype, config, ptx in [
        ("gather_m", "fp16", _SMALL, []),
        ("gather_k", "fp32", {**_SMALL, "SPLIT_K": 4}, ["atom.global.gpu.acq_rel.add"]),
        ("relu_grad", "fp16", _SMALL, []),
        ("loss", "fp32", {**_SMALL, "BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 2, "SPLIT_K": 4}, _PROTOCOL),
        ("loss", "bf16" if arch >= 80 else "fp16", {**_SMALL, "BLOCK_M": 64, "BLOCK_N": 32, "SPLIT_K": 2}, _PROTOCOL),
    ]
]

# Runs in the helper process: one report (or error) per case, which tensor-core
# instructions the 16-bit matmul defaults and SPLITK_CASES use, and for each
# FUSED_PATH_CASES entry its spills and the PTX it lacks.
_SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
import kernels_triton as kt
from kernels_core import contract
from kernels_triton import reports
from kernels_triton.matmul import plan as plan_matmul

def fused_path_plan(path, dtype, cfg):
    def t(*shape, dtype=contract.DTYPES[dtype]):
        return torch.empty(shape, dtype=dtype, device="meta")
    rows = t(128, dtype=torch.int64)  # a batch of the 60000 images of 784 pixels
    if path == "gather_m":
        return plan_matmul(t(60000, 784), t(784, 1024), bias=t(1024), activation="relu", a_rows=rows, config=cfg)[1]
    if path == "gather_k":
        return plan_matmul(t(60000, 784), t(128, 1024), trans_a=True, a_rows=rows, config=cfg)[1]
    if path == "relu_grad":
        return plan_matmul(t(128, 10), t(1024, 10), trans_b=True, relu_grad_of=t(128, 1024), config=cfg)[1]
    return reports._sample_plan("linear_cross_entropy", dtype, cfg)

cases, splitk, fused_paths, wgmma, ahead = json.load(sys.stdin)
results = {}
for op, dtype, arch, label, cfg in cases:
    key = f"{op}-{dtype}-sm{arch}-{label}"
    try:
        results[key] = {"report": kt.compile_report(op, dtype, cfg, arch)}
    except Exception as e:
        results[key] = {"error": f"{type(e).__name__}: {e}"}
for dtype, arch, cfg, label in [(dtype, 90, None, f"wgmma-{dtype}") for dtype in wgmma] + splitk:
    elt = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
    plan = reports._sample_plan("matmul", dtype, kt.space("matmul", dtype).resolve(cfg, elt, arch))
    compiled = triton.compile(reports._ast_source(plan), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    ptx = compiled.asm["ptx"]
    results[label] = [name for name in ("wgmma", "mma.sync", "tf32") if name in ptx]
for i, cfg in ahead:
    plan = reports._sample_plan("matmul", "fp32", kt.space("matmul", "fp32").resolve(cfg, 4, 90))
    compiled = triton.compile(reports._ast_source(plan), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    ptx = compiled.asm["ptx"]
    results[f"ahead{i}"] = {"instructions": [name for name in ("wgmma", "mma.sync", "tf32") if name in ptx],
                            "narrow_copies": ptx.count("cp.async.ca."), "wide_copies": ptx.count("cp.async.cg."),
                            "shared_stores": ptx.count("st.shared")}
for path, dtype, arch, cfg, needles, i in fused_paths:
    try:
        cfg = kt.space("matmul", dtype).resolve(cfg, contract.DTYPES[dtype].itemsize, arch)
        plan = fused_path_plan(path, dtype, cfg)
        compiled = triton.compile(reports._ast_source(plan), target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
        _, spill_bytes = reports._ptxas_usage(compiled.asm["ptx"])
        missing = [n for n in needles if n not in compiled.asm["ptx"]]
        results[f"fused{i}"] = {"spill_bytes": spill_bytes, "missing": missing}
    except Exception as e:
        results[f"fused{i}"] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(results))
"""


# The reports fixture compiles what the run's tests of this module read, in one process of their own.
pytestmark = pytest.mark.xdist_group("triton_compile")


@pytest.fixture(scope="module")
def reports(request):
    """Only the cases the run selected (the fast tier samples test_compiles' matrix)."""
    here = [item for item in request.session.items if item.module is request.module]
    params = {item.originalname: [] for item in here}
    for item in here:
        if hasattr(item, "callspec"):
            params[item.originalname].append(item.callspec.params)
    cases = [c for c in CASES if c[:4] in {tuple(p[k] for k in ("op", "dtype", "arch", "label"))
                                           for p in params.get("test_compiles", [])}]
    wanted = {p["i"] for p in params.get("test_splitk_dot_instructions", [])}
    splitk = [(dtype, arch, cfg, f"instructions-splitk{i}") for i, (dtype, arch, cfg, _) in enumerate(SPLITK_CASES)
              if i in wanted]
    wanted = {p["i"] for p in params.get("test_fused_paths_compile", [])}
    fused = [(*case, i) for i, case in enumerate(FUSED_PATH_CASES) if i in wanted]
    wgmma = [p["dtype"] for p in params.get("test_matmul_default_uses_wgmma_on_hopper", [])]
    ahead = [(i, c) for i, c in enumerate(SPLIT_AHEAD_CASES)
             if c["TF32"] in {p["tf32"] for p in params.get("test_split_ahead_stores_no_parts_in_the_k_loop", [])}]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps([cases, splitk, fused, wgmma, ahead]),
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.matrix
@pytest.mark.parametrize("op,dtype,arch,label,config", CASES,
                         ids=[f"{c[0]}-{c[1]}-sm{c[2]}-{c[3]}" for c in CASES])
def test_compiles(reports, op, dtype, arch, label, config):
    result = reports[f"{op}-{dtype}-sm{arch}-{label}"]
    if op in ("matmul", *contract.FUSED_OPS) and dtype == "bf16" and arch < 80:  # the fused ops are matmuls
        assert "arch >= 80" in result.get("error", ""), f"bf16 {op} must be refused below sm_80"
        pytest.skip("bf16 dot needs sm_80+")
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert set(report) == {"registers", "smem_bytes", "spill_bytes", "compile_s"}
    assert 0 < report["registers"] <= 255
    assert report["compile_s"] >= 0
    sp = kernels_triton.space(op, dtype)
    cfg = {**sp.default, **(config or {})}
    elt = contract.DTYPES[dtype].itemsize
    if sp.cost(cfg, elt, arch)["smem_bytes"] > SMEM_LIMIT[arch]:
        return  # compiles, but cannot run here (the Hopper matmul default on sm_75): nothing more to hold it to
    assert report["smem_bytes"] <= SMEM_LIMIT[arch], "fits by the space's estimate but not in fact"
    if label == "default" or label.startswith("splitk"):
        assert report["spill_bytes"] == 0, f"{label} config spills {report['spill_bytes']} bytes"


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_matmul_default_uses_wgmma_on_hopper(reports, dtype):
    assert "wgmma" in reports[f"wgmma-{dtype}"], "the 16-bit matmul default must run on Hopper's wgmma tensor cores"


@pytest.mark.matrix
@pytest.mark.parametrize("i", range(len(SPLITK_CASES)),
                         ids=[f"{c[0]}-sm{c[1]}-{'x'.join(str(c[2][k]) for k in _TILE)}"
                              + (f"-TF32={c[2]['TF32']}" if "TF32" in c[2] else "") for c in SPLITK_CASES])
def test_splitk_dot_instructions(reports, i):
    dtype, arch, cfg, instructions = SPLITK_CASES[i]
    assert reports[f"instructions-splitk{i}"] == instructions, f"{dtype} {cfg} on sm_{arch}"


@pytest.mark.parametrize("tf32", [3, 1])
def test_split_ahead_stores_no_parts_in_the_k_loop(reports, tf32):
    per_tile, ahead = (reports[f"ahead{i}"] for i, c in enumerate(SPLIT_AHEAD_CASES) if c["TF32"] == tf32)
    for result in (per_tile, ahead):
        assert result["instructions"] == ["wgmma", "tf32"] and result["narrow_copies"] == 0, result
    assert ahead["wide_copies"] == (2 if tf32 == 3 else 1) * per_tile["wide_copies"], (ahead, per_tile)
    assert ahead["shared_stores"] < per_tile["shared_stores"], (ahead, per_tile)


@pytest.mark.matrix
@pytest.mark.parametrize("i", range(len(FUSED_PATH_CASES)),
                         ids=[f"{c[0]}-{c[1]}-sm{c[2]}-split{c[3]['SPLIT_K']}" for c in FUSED_PATH_CASES])
def test_fused_paths_compile(reports, i):
    path, dtype, arch, config, _ = FUSED_PATH_CASES[i]
    result = reports[f"fused{i}"]
    assert "error" not in result, result.get("error")
    assert result["spill_bytes"] == 0, f"{path} {dtype} {config} on sm_{arch} spills {result['spill_bytes']} bytes"
    assert not result["missing"], f"{path} on sm_{arch}: the PTX lacks {result['missing']}"


def test_compile_report_rejects_bad_config():
    with pytest.raises(ValueError, match="config"):
        kernels_triton.compile_report("matmul", "fp16", {"BLOCK_M": 3}, 90)
    with pytest.raises(TypeError, match="arch"):
        kernels_triton.compile_report("relu", "fp32", None, "hopper")


def test_resource_report_without_launch_is_none():
    assert kernels_triton.resource_report("relu", "fp32", {"BLOCK": 2048}) is None


@pytest.mark.gpu
def test_resource_report_after_launch():
    x = torch.randn(10_000, device="cuda")
    kernels_triton.relu(x)
    report = kernels_triton.resource_report("relu", "fp32", None)
    assert report is not None and report["registers"] > 0 and report["spill_bytes"] == 0
    a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    kernels_triton.matmul(a, a)
    report = kernels_triton.resource_report("matmul", "fp16", None)
    assert report is not None and report["smem_bytes"] > 0
