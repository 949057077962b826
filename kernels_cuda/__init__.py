"""Raw CUDA C++ twins of the lab's kernels, compiled at run time with NVRTC
(through CuPy) and launched on torch's current stream without copies.

Exports the contract's functions (kernels_core/contract.py) plus:
    space(op, dtype) -> Space            the op's search space
    compile_report(op, dtype, config, arch) -> dict
    compile_reports(op, dtype, configs, arch) -> list[dict]
        offline nvcc builds (no GPU needed): registers, smem_bytes,
        spill_bytes, compile_s of the op's representative variant per config
    resource_report(op, dtype, config) -> dict | None
        the same numbers from the variant loaded on this GPU, None if that
        config has not been launched here yet

Module map, the same as the Triton twin's: matmul.py (matmul_simt.cu,
matmul_tc.cu), fused.py (linear_cross_entropy, linear_sgd: the same two
kernels with fused epilogues), elementwise.py (relu, relu_backward,
bias_add), reduction.py (bias_grad), loss.py (softmax_cross_entropy),
optim.py (sgd_update), persistent.py (persistent.cu: the persistent training
kernel, persistent.plan), reports.py (resource figures), _runtime.py
(compiling and launching).
Importing this package needs neither CuPy nor a GPU.
"""
from __future__ import annotations

from kernels_core.contract import FUSED_OPS, check_op
from kernels_core.persistent import SPACE as PERSISTENT_SPACE
from kernels_core.space import Space

from . import elementwise, fused, loss, matmul as _matmul, optim, persistent, reduction
from .elementwise import bias_add, relu, relu_backward
from .fused import linear_cross_entropy, linear_sgd
from .loss import softmax_cross_entropy
from .matmul import matmul
from .optim import sgd_update
from .reduction import bias_grad
from .reports import compile_report, compile_reports, resource_report

__all__ = [
    "matmul", "relu", "relu_backward", "bias_add", "bias_grad", "softmax_cross_entropy", "sgd_update",
    "linear_cross_entropy", "linear_sgd", "persistent", "space", "compile_report", "compile_reports",
    "resource_report",
]


def space(op: str, dtype: str) -> Space:
    """The search space of `op` for inputs of `dtype` ("fp32", "fp16", "bf16";
    for sgd_update the gradients' dtype)."""
    check_op(op, dtype)
    if op == "persistent":
        return PERSISTENT_SPACE
    if op == "matmul":
        return _matmul.space_for(dtype)
    if op in FUSED_OPS:
        return fused.space_for(op, dtype)
    return {"bias_grad": reduction.SPACE, "softmax_cross_entropy": loss.SPACE, "sgd_update": optim.SPACE}.get(
        op, elementwise.SPACE)
