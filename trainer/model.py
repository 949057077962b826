"""The MLP's training step written once over the ops interface.

`ops` is any module exposing the contract's ops (kernels_cuda or
kernels_triton; tests pass a shim or a spy). Weights are stored (in, out)
row-major, so every call below is one of the tuned shapes of the tuner's
mnist-mlp workload:

    forward   h = matmul(x, W, bias=b, activation="relu")        (B, out, in)  "nn"
              logits = matmul(h, W_last, bias=b_last)
    loss      loss, d = softmax_cross_entropy(logits, y)          (B, 10)
    backward  dW = matmul(h_prev, d, trans_a=True)                (in, out, B)  "tn"
              db = bias_grad(d)                                   (B, out)
              dX = matmul(d, W, trans_b=True)                     (B, in, out)  "nt"
              d  = relu_backward(dX, h_prev)                      (B, in)
              (no dX for the input layer)
    update    sgd_update(params, grads, bufs, ...)                (total params,)

In fp16/bf16 the parameters and momentum stay fp32 (master weights); each
step refreshes low-precision copies of them for the matmuls with one
multi-tensor copy. bias_grad returns fp32, dW comes in the compute dtype, and
sgd_update takes both.
"""
from __future__ import annotations

import torch

from autotune.workload import shape_key
from kernels_core.contract import DTYPES
from trainer.config import Config
from trainer.tuned_configs import CallConfigs
from trainer.torch_backend import MLP


class OpsMLP:
    """Parameters and one capturable training step of the MLP, over `ops`."""

    def __init__(self, ops, initial: MLP, config: Config, device: torch.device, configs: CallConfigs):
        self.ops, self.configs = ops, configs
        self.lr, self.momentum, self.weight_decay = config.lr, config.momentum, config.weight_decay
        self.params: list[torch.Tensor] = []  # W0, b0, W1, b1, ... fp32
        for linear in initial.linears:
            self.params += [linear.weight.detach().t().contiguous().to(device), linear.bias.detach().clone().to(device)]
        dtype = DTYPES[config.dtype]
        self.low = self.params if dtype == torch.float32 else [torch.empty_like(p, dtype=dtype) for p in self.params]
        self.bufs = [torch.zeros_like(p) for p in self.params] if config.momentum else None
        self._numel = sum(p.numel() for p in self.params)

    def _matmul(self, a, b, *, trans_a=False, trans_b=False, **kw):
        m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
        n = b.shape[0] if trans_b else b.shape[1]
        layout = ("t" if trans_a else "n") + ("t" if trans_b else "n")
        cfg = self.configs.get("matmul", shape_key((m, n, k), layout))
        return self.ops.matmul(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg, **kw)

    def _call(self, op: str, shape: tuple[int, ...], *args, **kw):
        return getattr(self.ops, op)(*args, config=self.configs.get(op, shape_key(shape)), **kw)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.low is not self.params:
            torch._foreach_copy_(self.low, self.params)
        weights, biases = self.low[0::2], self.low[1::2]

        acts = [x]  # the input of each layer, kept for the backward
        for w, b in zip(weights[:-1], biases[:-1]):
            acts.append(self._matmul(acts[-1], w, bias=b, activation="relu"))
        logits = self._matmul(acts[-1], weights[-1], bias=biases[-1])
        loss, d = self._call("softmax_cross_entropy", tuple(logits.shape), logits, y)

        grads: list[torch.Tensor] = [None] * len(self.params)
        for i in reversed(range(len(weights))):
            grads[2 * i] = self._matmul(acts[i], d, trans_a=True)
            grads[2 * i + 1] = self._call("bias_grad", tuple(d.shape), d)
            if i > 0:
                dx = self._matmul(d, weights[i], trans_b=True)
                d = self._call("relu_backward", tuple(dx.shape), dx, acts[i])

        self._call("sgd_update", (self._numel,), self.params, grads, self.bufs,
                   lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return loss

    def snapshot(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.params]

    def restore(self, saved: list[torch.Tensor]) -> None:
        torch._foreach_copy_(self.params, saved)
        if self.bufs is not None:
            torch._foreach_zero_(self.bufs)

    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.params[0::2], self.params[1::2]))
