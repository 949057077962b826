"""The PyTorch baseline: nn.Linear layers, autograd, torch.optim.SGD.

This is what a user would write instead of the lab's kernels, so it is made
as fast as PyTorch honestly gets: the fused SGD kernel on a GPU (one launch
for all parameters), autocast for fp16/bf16 (fp32 master weights, as the
kernel backends keep), optionally torch.compile of the model with its loss
and of the SGD step, and optionally the whole step (forward, backward,
optimizer) captured in one CUDA graph, following the "whole network capture"
recipe of the PyTorch CUDA graphs docs.

The same module also draws the initial weights for every backend: nn.Linear's
default init on the CPU from the seed, so all backends start identical.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kernels_core.contract import DTYPES
from kernels_core.mlp import MNIST_CLASSES, MNIST_IN
from trainer.config import CUDAGRAPH_MODES, Config



class MLP(nn.Module):
    """784 -> hidden (x layers, ReLU) -> 10."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        dims = [MNIST_IN] + [hidden] * layers + [MNIST_CLASSES]
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
        # Dynamo does not trace fused optimizers (torch._dynamo disables `_fused_sgd`: "don't trace into fused
        # optimizer"), so compiling a fused step would run the same eager kernel; foreach SGD is the one inductor
        # compiles, into its own fused kernels. Eager, on a GPU, the fused kernel is one launch for all parameters.
        fused = device.type == "cuda" and config.compile is None
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=config.lr, momentum=config.momentum,
            weight_decay=config.weight_decay, fused=fused or None, foreach=None if fused else True,
        )
        if config.momentum:
            # A zero buffer gives SGD's first step exactly (0 * momentum + grad = grad). Made here, the state is
            # complete from the start: a compiled step is traced once, not once for step 1 and again for step 2.
            for p in self.model.parameters():
                self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        dtype = DTYPES[config.dtype]
        # Autocast's weight-cast cache must be off: a captured graph cannot reuse casts across replays.
        self._autocast = (
            torch.autocast(device.type, dtype=dtype, cache_enabled=False)
            if dtype != torch.float32 else contextlib.nullcontext()
        )
        self._own_graphs = config.compile in CUDAGRAPH_MODES
        # Inductor's CUDA graphs run each function eagerly once, record it on the next step and replay it from
        # the third: the stepper runs these steps before the clock starts, so setup_seconds holds the recording.
        self.warmup_steps = 3 if self._own_graphs else 1
        if config.compile is None:
            self._loss, self._update = self._forward_loss, self.optimizer.step
        else:
            # Each run compiles afresh: dynamo keeps its graphs per code object, so runs in one process (compare
            # trains many) would otherwise recompile the same functions until its recompile limit, then silently
            # run them eagerly.
            torch._dynamo.reset()
            self._loss = torch.compile(self._forward_loss, mode=config.compile)
            self._update = torch.compile(self.optimizer.step, mode=config.compile)

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self._own_graphs:
            # Inductor's CUDA graphs may now overwrite the last step's outputs: the stepper has read its loss.
            torch.compiler.cudagraph_mark_step_begin()
        # set_to_none: during capture, backward then allocates the grads from the graph's pool.
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast:
            loss = self._loss(x, y)
        loss.backward()
        self._update()
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
