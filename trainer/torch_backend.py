"""The PyTorch baseline: nn.Linear layers, autograd, torch.optim.SGD.

This is what a user would write instead of the lab's kernels, so it is made
as fast as plain PyTorch honestly gets: the fused SGD kernel on a GPU (one
launch for all parameters), autocast for fp16/bf16 (fp32 master weights, as
the kernel backends keep), optional torch.compile, and optional capture of
the whole step (forward, backward, optimizer) in one CUDA graph, following
the "whole network capture" recipe of the PyTorch CUDA graphs docs.

The same module also draws the initial weights for every backend: nn.Linear's
default init on the CPU from the seed, so all backends start identical.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kernels_core.contract import DTYPES
from trainer.config import Config

IN_FEATURES, CLASSES = 784, 10


class MLP(nn.Module):
    """784 -> hidden (x layers, ReLU) -> 10."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        dims = [IN_FEATURES] + [hidden] * layers + [CLASSES]
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears[:-1]:
            x = F.relu(linear(x))
        return self.linears[-1](x)


def initial_mlp(hidden: int, layers: int, seed: int) -> MLP:
    """The initial weights of every backend, drawn on the CPU so devices don't matter."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        return MLP(hidden, layers)


class TorchBackend:
    """One training step of the nn.Module; `step` is capturable when asked to be."""

    def __init__(self, config: Config, device: torch.device):
        self.device = device
        self.model = initial_mlp(config.hidden, config.layers, config.seed).to(device)
        fused = device.type == "cuda"
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=config.lr, momentum=config.momentum,
            weight_decay=config.weight_decay, fused=fused or None, foreach=None if fused else True,
        )
        dtype = DTYPES[config.dtype]
        # Autocast's weight-cast cache must be off: a captured graph cannot reuse casts across replays.
        self._autocast = (
            torch.autocast(device.type, dtype=dtype, cache_enabled=False)
            if dtype != torch.float32 else contextlib.nullcontext()
        )
        self._loss = torch.compile(self._forward_loss, mode=config.compile) if config.compile else self._forward_loss

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # set_to_none: during capture, backward then allocates the grads from the graph's pool.
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast:
            loss = self._loss(x, y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Undo warm-up steps: weights back, momentum to zero (which SGD's first step equals)."""
        with torch.no_grad():
            for p, s in zip(self.model.parameters(), saved):
                p.copy_(s)
        for state in self.optimizer.state.values():
            if state.get("momentum_buffer") is not None:
                state["momentum_buffer"].zero_()

    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(W [in, out], b) per layer, fp32, views of the live parameters."""
        return [(l.weight.detach().t(), l.bias.detach()) for l in self.model.linears]
