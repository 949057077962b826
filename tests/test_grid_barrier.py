"""The grid barrier of experiments/grid_barrier.py, both twins' (the Triton one is the persistent
training kernel's): under Triton's interpreter (one program: the interpreter runs a grid's
programs one after another, so more would wait for ever), in the Triton twin's PTX and the CUDA
twin's SASS (compiled offline for sm_90), and on a GPU at 2 programs an SM, where every program
must arrive at every barrier exactly once."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from experiments import grid_barrier
from tests.test_wgmma import _cuobjdump

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@pytest.mark.timeout(120)  # a barrier that never opens spins: fail, not hang
def test_the_triton_barrier_counts_each_program_once_a_round():
    if torch.cuda.is_available():
        pytest.skip("the interpreter's run; the GPU's is test_each_program_arrives_at_every_barrier")
    counter = torch.zeros(1, dtype=torch.int32)
    grid_barrier.barrier_rounds[(1,)](counter, 7)
    assert counter.item() == 7


_TRITON_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from experiments.grid_barrier import barrier_rounds
source = ASTSource(fn=barrier_rounds, signature={"counter_ptr": "*i32", "rounds": "i32"}, constexprs={}, attrs={})
print(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def test_the_triton_barrier_arrives_with_release_and_waits_with_acquire_at_gpu_scope():
    """Compiled for sm_90 in a process of its own (the interpreter and the compiler cannot share
    one): the arrival a GPU-scope release atomic, the poll a GPU-scope acquire after it."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # kernels_triton would turn it on without a GPU
    ptx = subprocess.run([sys.executable, "-c", _TRITON_PTX], check=True, capture_output=True, text=True,
                         env=env, cwd=ROOT).stdout
    ops = [line.split()[1] if line.strip().startswith("@") else line.split()[0]
           for line in ptx.splitlines() if line.strip() and not line.strip().startswith("//")]
    arrive = next(i for i, op in enumerate(ops) if op.startswith(("red.", "atom.")) and ".gpu" in op
                  and ".release" in op and ".add" in op)
    assert any(".gpu" in op and ".acquire" in op for op in ops[arrive + 1:]), ops


@needs_nvcc
def test_the_cuda_barrier_arrives_with_release_and_waits_with_acquire_at_gpu_scope(tmp_path):
    """Release: a fence of the whole GPU's memory before the reduction; acquire: a load that no cache
    of the SM may answer. At CTA scope (a barrier of one block's threads) neither holds."""
    if _cuobjdump() is None:
        pytest.skip("no cuobjdump (nvcc's or Triton's)")
    source, cubin = tmp_path / "barrier.cu", tmp_path / "barrier.cubin"
    source.write_text(grid_barrier.CUDA_SOURCE)
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", str(cubin), str(source)], check=True)
    sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    ops = [line.split("*/")[1].split(";")[0].strip() for line in sass.splitlines() if "/*0" in line and "*/" in line]
    arrive = next(i for i, op in enumerate(ops) if op.startswith("REDG.E.ADD.STRONG.GPU"))
    assert any(op.startswith("MEMBAR") and op.endswith(".GPU") for op in ops[:arrive]), ops
    assert any(op.startswith("LDG.E.STRONG.GPU") for op in ops[arrive:]), ops


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_each_program_arrives_at_every_barrier(backend):
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    row = grid_barrier.measure(backend, programs, rounds=50, reps=3)  # raises on a count off
    assert 0 < row["us_per_barrier"] < 1000
