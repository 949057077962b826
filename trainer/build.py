"""From a Config to a device and a backend whose `step(x, y)` trains one batch.

Every backend offers the same small surface: `step(x, y) -> loss` (0-dim,
on the device, no host sync), `snapshot()`/`restore()` so warm-up steps can
be undone, and `weights()` as (W [in, out], b) pairs for evaluation.
"""
from __future__ import annotations

import torch

from kernels_core import backends as kernel_packages, dependent_launch
from kernels_core.contract import DTYPES, device_arch
from trainer.config import Config
from trainer.tuned_configs import CallConfigs, as_fused, open_store
from trainer.model import OpsMLP
from trainer.torch_backend import TorchBackend, initial_mlp


class NeedsGpu(RuntimeError):
    pass


def pick_device(config: Config) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif config.backend == "cuda":
        raise NeedsGpu(
            "the cuda backend runs CUDA C++ kernels through CuPy and needs an NVIDIA GPU; none was found. "
            "On a CPU use --backend torch, or --backend triton (runs under the Triton interpreter, slowly)."
        )
    else:
        device = torch.device("cpu")
    if config.pdl:
        try:
            dependent_launch.check(device)
        except ValueError as e:
            raise NeedsGpu(f"--pdl: {e}") from None
    return device


def call_configs(config: Config, device: torch.device):
    """(the run's kernel package, CallConfigs): where each kernel of the run finds its config."""
    ops = kernel_packages.load(config.backend)  # kernels_triton picks the interpreter on a CPU
    arch, elt = device_arch(device), DTYPES[config.dtype].itemsize
    store, origin = open_store(config)
    return ops, CallConfigs(store, config.backend, config.dtype, origin=origin,
                            default_of=lambda op: ops.space(op, config.dtype).default_for(arch),
                            valid_for=lambda op, key, cfg: as_fused(op, key, cfg, ops.space(op, config.dtype), elt,
                                                                    arch),
                            precision_of=lambda op, cfg: ops.space(op, config.dtype).precision_of(cfg))


def make_backend(config: Config, device: torch.device):
    """(backend, CallConfigs or None): the torch baseline, or the MLP over a kernel package."""
    if config.backend == "torch":
        return TorchBackend(config, device), None
    ops, configs = call_configs(config, device)
    initial = initial_mlp(config.hidden, config.layers, config.seed)
    return OpsMLP(ops, initial, config, device, configs), configs
