"""The MLP trained by the persistent training kernel (`--persistent`): kernels_triton/persistent.py
or kernels_cuda/persistent.py, the run's backend's.

Where the fused step (trainer/model.py) launches its kernels once a step, this backend launches
one kernel a segment of steps: it reads the batches' rows and the position in the epoch from the
trainer's DeviceBatches, writes each step's loss into the run's loss slots, and advances the
position, as that many fused steps would. The parameters (W0, b0, W1, b1, ...; each W (in, out),
as OpsMLP keeps them) and the momentum buffers each live in one flat fp32 buffer, the layout the
kernel reads (kernels_core/persistent.py).
"""
from __future__ import annotations

import importlib
import sys

import torch

from kernels_core.contract import DTYPES
from kernels_core.persistent import Layout, fits_on_chip, state_bytes
from trainer.config import Config
from trainer.data import DeviceBatches
from trainer.torch_backend import MLP
from trainer.train import RunError  # trainer.train imports this module only once it is loaded


def runs_persistent(config: Config, device: torch.device) -> bool:
    """Whether the persistent kernel trains this run: always with --persistent (refused where the
    model does not fit on chip), where it fits with --persistent auto, which says what it picked."""
    layout = Layout(config.hidden, config.layers, config.batch_size)
    need = state_bytes(layout, DTYPES[config.dtype].itemsize, bool(config.momentum))
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else None
    fits = fits_on_chip(layout, DTYPES[config.dtype].itemsize, bool(config.momentum), l2)
    room = "" if l2 is None else f" of the GPU's {l2 / 2**20:.0f} MiB L2"
    if config.persistent == "on" and not fits:
        raise RunError(f"--persistent: the model's weights, momentum and one step's activations take "
                         f"{need / 2**20:.1f} MiB, more than the GPU's {l2 / 2**20:.0f} MiB L2 holds; use a smaller "
                         "--hidden or --layers, or --persistent auto to train with the fused step")
    if config.persistent == "auto":
        picked = "the persistent kernel" if fits else "the fused step"
        print(f"--persistent auto: {picked} (the model's state takes {need / 2**20:.1f} MiB{room})", file=sys.stderr)
    return fits


class PersistentMLP:
    gathers_batch = True

    def __init__(self, initial: MLP, config: Config, batches: DeviceBatches, losses: torch.Tensor,
                 kernel_config: dict | None = None, stamps: torch.Tensor | None = None):
        """The kernel planned on `initial`'s weights; stamps: the kernel's clock buffer (its plan's)."""
        device = batches.x.device
        self.layout = Layout(config.hidden, config.layers, config.batch_size)
        self.flat = torch.cat([t.detach().reshape(-1) for linear in initial.linears
                               for t in (linear.weight.t(), linear.bias)]).float().to(device)
        self.params = self.layout.views(self.flat)
        self.bufs = torch.zeros_like(self.flat) if config.momentum else None
        kernel = importlib.import_module(f"kernels_{config.backend}.persistent")
        self.plan = kernel.plan(batches.x, batches.y, batches.epoch_batches, batches.pos, self.flat, self.bufs,
                                losses, self.layout, lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay, config=kernel_config, stamps=stamps)

    def describe(self) -> str:
        return f"persistent kernel: {self.plan.programs} programs, config {self.plan.config}"

    def run(self, steps: int) -> None:
        """`steps` steps from the batches' position on, in one launch."""
        self.plan.run(steps)

    def snapshot(self) -> torch.Tensor:
        return self.flat.clone()

    def restore(self, saved: torch.Tensor) -> None:
        self.flat.copy_(saved)
        if self.bufs is not None:
            self.bufs.zero_()

    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.params[0::2], self.params[1::2]))
