"""What each GPU target allows, in one place, and the check that prunes a config.

Sources, cited per fact below:
  [CG]  CUDA C++ Programming Guide, "Technical Specifications per Compute
        Capability" table (threads and shared memory per block).
What an instruction needs (mma.sync types, cp.async, wgmma) is each kernel's
space's to say, as restrictions over `arch`.

The SM count is a device fact (an H200 has 132 SMs, an H100 PCIe 114), so it is
read from the device at run time, never assumed from the target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kernels_core.space import Space

KB = 1024


@dataclass(frozen=True)
class Target:
    name: str
    arch: int
    smem_per_block_optin: int  # [CG] cudaFuncAttributeMaxDynamicSharedMemorySize
    max_threads_per_block: int = 1024  # [CG] the same on every target here
    # Measured ceilings (TFLOP/s per dtype for matmul, GB/s for memory-bound
    # ops); None where nobody has measured them on a device of this target.
    matmul_tflops: Mapping[str, float] | None = None
    copy_gbps: float | None = None

    def space_problem(self, space: Space, elt: int) -> str | None:
        """Why no config of `space` can run on this target at all, or None.

        Which GPUs an op runs on is the space's to say (bf16 tensor cores start
        at sm_80: `arch >= 80` in both twins' bf16 matmul spaces), so a study
        that could only prune every suggestion is skipped instead.
        """
        if next(iter(space.configs(elt, self.arch)), None) is not None:
            return None
        return f"no config of its space runs on {self.name}: {space.violated(space.default_for(self.arch), elt, self.arch)}"

    def target_violation(self, space: Space, config: Mapping[str, int], elt: int) -> str | None:
        """The first reason `config` cannot run on this target, or None."""
        return space.violated(config, elt, self.arch) or self.cost_violation(space, config, elt)

    def cost_violation(self, space: Space, config: Mapping[str, int], elt: int) -> str | None:
        """Why a config the space's rules take asks more of a block than this target has, or None."""
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


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm_75", 75, 64 * KB),
        Target("sm_80", 80, 163 * KB),
        Target("sm_86", 86, 99 * KB),
        Target("sm_89", 89, 99 * KB),
        # Measured on H200 (cuBLAS large-square matmul, device-to-device copy).
        Target("sm_90", 90, 227 * KB, matmul_tflops={"bf16": 750.0, "fp16": 701.0, "fp32": 51.0}, copy_gbps=4245.0),
        # The Triton interpreter on the host plays sm_90 (kernels_core.contract.device_arch),
        # so configs are pruned as for sm_90; its timings are host timings.
        Target("cpu", 90, 227 * KB),
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
