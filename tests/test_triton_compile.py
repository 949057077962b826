"""The Triton kernels compile for real GPUs, checked on a machine without one.

Triton's interpreter runs kernels without compiling them, so a kernel that
passes test_ops.py on a CPU may still fail to build for a GPU. Here every op's
default config and a deterministic sample of others are compiled offline
through `compile_report` for sm_75, sm_80 and sm_90, in one helper process
with the interpreter off (the interpreter and the compiler cannot share a
process; see kernels_triton/reports.py).
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


CASES = _cases()

# Runs in the helper process: one report (or error) per case, plus whether the
# 16-bit matmul defaults use Hopper's wgmma tensor-core instructions.
_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
import kernels_triton as kt
from kernels_triton import reports

results = {}
for op, dtype, arch, label, cfg in json.load(sys.stdin):
    key = f"{op}-{dtype}-sm{arch}-{label}"
    try:
        results[key] = {"report": kt.compile_report(op, dtype, cfg, arch)}
    except Exception as e:
        results[key] = {"error": f"{type(e).__name__}: {e}"}
for dtype in ("fp16", "bf16"):
    plan = reports._sample_plan("matmul", dtype, None)
    compiled = triton.compile(reports._ast_source(plan), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    results[f"wgmma-{dtype}"] = "wgmma" in compiled.asm["ptx"]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def reports():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps(CASES), capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("op,dtype,arch,label,config", CASES,
                         ids=[f"{c[0]}-{c[1]}-sm{c[2]}-{c[3]}" for c in CASES])
def test_compiles(reports, op, dtype, arch, label, config):
    result = reports[f"{op}-{dtype}-sm{arch}-{label}"]
    if op == "matmul" and dtype == "bf16" and arch < 80:
        assert "arch >= 80" in result.get("error", ""), "bf16 matmul must be refused below sm_80"
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
    if label == "default":
        assert report["spill_bytes"] == 0, f"default config spills {report['spill_bytes']} bytes"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_matmul_default_uses_wgmma_on_hopper(reports, dtype):
    assert reports[f"wgmma-{dtype}"], "the 16-bit matmul default must run on Hopper's wgmma tensor cores"


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
