"""Raw CUDA C++ twins of the lab's kernels, compiled at run time with NVRTC
(through CuPy) and launched on torch's current stream without copies.

Exports the contract's functions (see contract.py) plus:
    space(op, dtype) -> Space            the op's search space
    compile_report(op, dtype, config, arch) -> dict
    compile_reports(op, dtype, configs, arch) -> list[dict]
        offline nvcc builds (no GPU needed): registers, smem_bytes,
        spill_bytes, compile_s of the op's main variant per config
    resource_report(op, dtype, config) -> dict | None
        the same numbers from the variant loaded on this GPU, None if that
        config has not been launched here yet
Importing this package needs neither CuPy nor a GPU.
"""
from __future__ import annotations

from . import _runtime as rt
from . import elementwise as _ew
from . import matmul as _mm
from . import reduce as _red
from .contract import DTYPES, OPS, Space
from .elementwise import bias_add, relu, relu_backward, sgd_update
from .matmul import matmul
from .reduce import bias_grad, softmax_cross_entropy

__all__ = [
    "matmul", "relu", "relu_backward", "bias_add", "bias_grad", "softmax_cross_entropy", "sgd_update",
    "space", "compile_report", "compile_reports", "resource_report",
]


def _check_op(op: str, dtype: str) -> None:
    if op not in OPS:
        raise ValueError(f"op: {op!r} is not one of {OPS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {tuple(DTYPES)}")


def space(op: str, dtype: str) -> Space:
    """The search space of `op` for inputs of `dtype` ("fp32", "fp16", "bf16";
    for sgd_update the gradients' dtype)."""
    _check_op(op, dtype)
    if op == "matmul":
        return _mm.space_for(dtype)
    if op == "bias_grad":
        return _red.BIAS_GRAD_SPACE
    if op == "softmax_cross_entropy":
        return _red.SOFTMAX_XENT_SPACE
    return _ew.SPACE


def _elt(op: str, dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _main_variant(op: str, dtype: str, config, arch: int):
    _check_op(op, dtype)
    if op == "matmul" and dtype == "bf16" and arch < 80:
        raise ValueError(f"dtype: bf16 tensor-core matmul needs sm_80 or newer, not sm_{arch}")
    cfg = space(op, dtype).resolve(config, _elt(op, dtype), arch)
    if op == "matmul":
        return _mm.main_variant(dtype, cfg, arch)
    if op in ("bias_grad", "softmax_cross_entropy"):
        return _red.main_variant(op, dtype, cfg)
    return _ew.main_variant(op, dtype, cfg)


def compile_reports(op: str, dtype: str, configs, arch: int) -> list[dict]:
    """Builds every config's main variant with nvcc in one call per source
    file and returns ptxas's numbers per config. All configs are checked
    against the space before anything is compiled."""
    built = [_main_variant(op, dtype, c, arch) for c in configs]
    return rt.compile_variants([v for v, _ in built], [s for _, s in built], arch)


def compile_report(op: str, dtype: str, config=None, arch: int = 90) -> dict:
    return compile_reports(op, dtype, [config], arch)[0]


def resource_report(op: str, dtype: str, config=None) -> dict | None:
    """Resources of the kernel the last call of `op` with this config launched on this GPU
    (its layout, epilogue and vector width included), or None before any such call."""
    import torch

    _check_op(op, dtype)
    arch, _ = rt.device_props(torch.cuda.current_device())
    cfg = space(op, dtype).resolve(config, _elt(op, dtype), arch)
    return rt.resource_report(rt.tag(op, dtype, cfg))
