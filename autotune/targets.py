"""What each GPU target allows, in one place, and the check that prunes a config.

Sources, cited per fact below:
  [CG]  CUDA C++ Programming Guide, "Technical Specifications per Compute
        Capability" table (threads, registers, shared memory per SM/block).
  [PTX] PTX ISA, sections "Warp-level matrix multiply-accumulate instructions"
        (mma.sync shapes/types per target), "cp.async" (sm_80+),
        "cp.async.bulk.tensor" (TMA) and "wgmma.mma_async" (both sm_90a).

The SM count is a device fact (an H200 has 132 SMs, an H100 PCIe 114), so it is
read from the device at run time, never assumed from the target.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from kernels_cuda.contract import Space

KB = 1024


@dataclass(frozen=True)
class Target:
    name: str
    arch: int
    smem_per_block_default: int  # [CG] without the opt-in attribute
    smem_per_block_optin: int  # [CG] cudaFuncAttributeMaxDynamicSharedMemorySize
    smem_per_sm: int  # [CG]
    max_threads_per_sm: int  # [CG]
    mma: Mapping[str, tuple[str, ...]]  # [PTX] dtype -> mma.sync shapes
    cp_async: bool  # [PTX] cp.async needs sm_80
    tma: bool  # [PTX] cp.async.bulk.tensor needs sm_90
    wgmma: bool  # [PTX] wgmma.mma_async needs sm_90a
    registers_per_thread: int = 255  # [CG] same on every target here
    registers_per_sm: int = 64 * KB  # [CG] 65536 32-bit registers
    max_threads_per_block: int = 1024  # [CG]
    # Measured ceilings (TFLOP/s per dtype for matmul, GB/s for memory-bound
    # ops); None where nobody has measured them on a device of this target.
    matmul_tflops: Mapping[str, float] | None = None
    copy_gbps: float | None = None
    note: str = field(default="", compare=False)

    def dtype_problem(self, op: str, dtype: str) -> str | None:
        """Why this target cannot run `op` in `dtype` at all, or None.

        Only matmul needs tensor-core support for a half type; elementwise
        bf16 is emulated through fp32 on sm_75 (cuda_bf16.h), so it runs.
        """
        if op == "matmul" and dtype != "fp32" and dtype not in self.mma:
            return f"{dtype} matmul needs {dtype} tensor cores (sm_80+); {self.name} has {sorted(self.mma)} only"
        return None

    def target_violation(self, space: Space, config: Mapping[str, int], elt: int, *,
                         op: str | None = None, dtype: str | None = None) -> str | None:
        """The first reason `config` cannot run on this target, or None."""
        problem = (self.dtype_problem(op, dtype) if op is not None and dtype is not None else None) \
            or space.violated(config, elt, self.arch)
        if problem:
            return problem
        cost = space.cost(config, elt, self.arch)
        if cost["threads"] > self.max_threads_per_block:
            return f"needs {cost['threads']} threads per block; {self.name} allows {self.max_threads_per_block}"
        if cost["smem_bytes"] > self.smem_per_block_optin:
            return (f"needs {cost['smem_bytes']} bytes of shared memory per block; "
                    f"{self.name} allows {self.smem_per_block_optin} (opt-in maximum)")
        return None

    def peak(self, metric: str, dtype: str) -> float | None:
        """The measured ceiling a result is a percentage of, or None."""
        if metric == "tflops":
            return (self.matmul_tflops or {}).get(dtype)
        return self.copy_gbps


_SM80_MMA = {"fp16": ("m16n8k8", "m16n8k16"), "bf16": ("m16n8k8", "m16n8k16")}  # [PTX] sm_80

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm_75", 75, 48 * KB, 64 * KB, 64 * KB, 1024,
               mma={"fp16": ("m16n8k8",)},  # [PTX] m16n8k8 f16 since sm_75; bf16 mma since sm_80
               cp_async=False, tma=False, wgmma=False),
        Target("sm_80", 80, 48 * KB, 163 * KB, 164 * KB, 2048, mma=_SM80_MMA,
               cp_async=True, tma=False, wgmma=False),
        Target("sm_86", 86, 48 * KB, 99 * KB, 100 * KB, 1536, mma=_SM80_MMA,
               cp_async=True, tma=False, wgmma=False),
        Target("sm_89", 89, 48 * KB, 99 * KB, 100 * KB, 1536, mma=_SM80_MMA,
               cp_async=True, tma=False, wgmma=False),
        Target("sm_90", 90, 48 * KB, 227 * KB, 228 * KB, 2048,
               # [PTX] sm_90 keeps the sm_80 mma.sync shapes; wgmma m64nNk16 adds warpgroup MMA
               mma={"fp16": ("m16n8k16", "wgmma.m64nNk16"), "bf16": ("m16n8k16", "wgmma.m64nNk16")},
               cp_async=True, tma=True, wgmma=True,
               # Measured on H200 (cuBLAS large-square matmul, device-to-device copy).
               matmul_tflops={"bf16": 750.0, "fp16": 701.0, "fp32": 51.0}, copy_gbps=4245.0,
               note="ceilings measured on H200"),
        # The Triton interpreter on the host plays sm_90 (kernels_cuda.contract.device_arch),
        # so configs are pruned as for sm_90; its timings are host timings.
        Target("cpu", 90, 48 * KB, 227 * KB, 228 * KB, 2048,
               mma={"fp16": ("m16n8k16",), "bf16": ("m16n8k16",)},
               cp_async=False, tma=False, wgmma=False, note="Triton interpreter / test backends"),
    )
}
GPU_TARGETS = tuple(name for name in TARGETS if name != "cpu")


class TargetError(RuntimeError):
    """A target that cannot be used as asked; the message says what to do."""


def local_gpu() -> tuple[str, str] | None:
    """(target name, device name) of the visible GPU, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}", torch.cuda.get_device_name(0)


def resolve_target(name: str, *, compile_only: bool) -> Target:
    """The target to tune for, refusing what cannot be done on this machine."""
    local = local_gpu()
    if name == "auto":
        if local is None:
            raise TargetError(
                "--target auto: no CUDA GPU is visible here, so nothing can be timed. Pass "
                f"--target {{{','.join(GPU_TARGETS)}}} --compile-only to compile every config and record "
                "registers, shared memory and spills offline (or --target cpu to run the pipeline "
                "under the Triton interpreter).")
        name = local[0]
    if name not in TARGETS:
        raise TargetError(f"target {name} is unknown to the tuner; known: {', '.join(TARGETS)}")
    if name == "cpu" or compile_only:
        return TARGETS[name]
    if local is None:
        raise TargetError(
            f"--target {name} cannot be timed: no CUDA GPU is visible here. Add --compile-only to "
            f"compile for {name} without a GPU, or run on a {name} GPU.")
    if local[0] != name:
        raise TargetError(
            f"--target {name} cannot be timed here: the local GPU is {local[1]} ({local[0]}). "
            f"Run with --target {local[0]} (or auto) to tune for it, or add --compile-only to "
            f"compile for {name} without timing.")
    return TARGETS[name]
