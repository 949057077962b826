"""The MLP's training step written once over the ops interface, fused or op by op.

`ops` is any module exposing the contract's ops (kernels_cuda or
kernels_triton; tests pass a shim or a spy). Weights are stored (in, out)
row-major. The calls below are the ones kernels_core.mlp.mlp_calls lists (the
tuner's mnist-mlp workload): the model chooses each one's config from that list
before its first step, and a call the list lacks stops the step. The step gets the whole dataset and the batch's row
indices, so that even the batch gather can sit inside a kernel.

The fused step (the default): 3 kernels per layer, the input layer 2, no
other kernel, each a GEMM with an epilogue that does a small op's work on
the tile in registers:

    forward   h = matmul(x, W0, bias=b0, activation="relu", a_rows=rows)  the gather in A's loads
              h = matmul(h, W, bias=b, activation="relu")                  (B, out, in)  "nn"
    loss      loss, d = linear_cross_entropy(h, W_last, y, bias=b_last, label_rows=rows)
    backward  dX = matmul(d, W, trans_b=True, relu_grad_of=h_prev)         (B, in, out)  "nt"
              linear_sgd(h_prev, d, W, b, bufs...)   dW, db and SGD      (in, out, B)  "tn"
              (dX first: linear_sgd overwrites W; no dX for the input layer)

The unfused step (`--no-fuse`), one kernel per op:

    gather    x, y = x[rows], y[rows]
    forward   h = matmul(x, W, bias=b, activation="relu")                  (B, out, in)  "nn"
              logits = matmul(h, W_last, bias=b_last)
    loss      loss, d = softmax_cross_entropy(logits, y)                   (B, 10)
    backward  dW = matmul(h_prev, d, trans_a=True)                         (in, out, B)  "tn"
              db = bias_grad(d)                                            (B, out)
              dX = matmul(d, W, trans_b=True)                              (B, in, out)  "nt"
              d  = relu_backward(dX, h_prev)                               (B, in)
    update    sgd_update(params, grads, bufs, ...)                         (total params,)

In fp16/bf16 the parameters and momentum stay fp32 (master weights) and the
matmuls read low-precision copies: the fused step's linear_sgd writes them
as it updates the weights; the unfused step refreshes them all at the start
of each step with one multi-tensor copy. The unfused dW is rounded to the
compute dtype before the update, the fused one never leaves fp32.
"""
from __future__ import annotations

import torch

from kernels_core.contract import DTYPES
from kernels_core.mlp import mlp_calls
from kernels_core.shapes import shape_key
from trainer.config import Config
from trainer.tuned_configs import CallConfigs
from trainer.torch_backend import MLP


class OpsMLP:
    """Parameters and one capturable training step of the MLP, over `ops`."""

    gathers_batch = True  # step() takes the dataset and the batch's rows

    def __init__(self, ops, initial: MLP, config: Config, device: torch.device, configs: CallConfigs):
        self.ops, self.configs, self.fuse = ops, configs, config.fuse  # configs: the record of each choice
        calls = mlp_calls(config.hidden, config.layers, config.batch_size, config.dtype, fused=config.fuse,
                          momentum=config.momentum)
        self._configs = {(c.op, c.key): configs.get(c.op, c.key) for c in calls}
        self.lr, self.momentum, self.weight_decay = config.lr, config.momentum, config.weight_decay
        self.params: list[torch.Tensor] = []  # W0, b0, W1, b1, ... fp32
        for linear in initial.linears:
            self.params += [linear.weight.detach().t().contiguous().to(device), linear.bias.detach().clone().to(device)]
        dtype = DTYPES[config.dtype]
        self.low = self.params if dtype == torch.float32 else [torch.empty_like(p, dtype=dtype) for p in self.params]
        self.bufs = [torch.zeros_like(p) for p in self.params] if config.momentum else None
        self._numel = sum(p.numel() for p in self.params)
        self._refresh_low()

    def _refresh_low(self) -> None:
        if self.low is not self.params:
            torch._foreach_copy_(self.low, self.params)

    def _matmul(self, a, b, *, trans_a=False, trans_b=False, a_rows=None, **kw):
        stored = (a_rows.shape[0], a.shape[1]) if a_rows is not None else tuple(a.shape)
        m, k = (stored[1], stored[0]) if trans_a else stored
        n = b.shape[0] if trans_b else b.shape[1]
        layout = ("t" if trans_a else "n") + ("t" if trans_b else "n")
        cfg = self._config("matmul", shape_key((m, n, k), layout))
        if a_rows is not None:
            kw["a_rows"] = a_rows
        return self.ops.matmul(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg, **kw)

    def _call(self, op: str, shape: tuple[int, ...], layout: str, *args, **kw):
        return getattr(self.ops, op)(*args, config=self._config(op, shape_key(shape, layout)), **kw)

    def _config(self, op: str, key: str) -> dict | None:
        try:
            return self._configs[(op, key)]
        except KeyError:
            raise RuntimeError(f"the step called {op} on {key}, which kernels_core.mlp.mlp_calls does not "
                               "list: the tuner would never tune it") from None

    def step(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One step on the batch x[rows], y[rows]; the loss as a 0-dim device tensor."""
        return self._fused_step(x, y, rows) if self.fuse else self._unfused_step(x, y, rows)

    def _fused_step(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        weights, biases = self.low[0::2], self.low[1::2]
        last = len(weights) - 1
        acts = [self._matmul(x, weights[0], bias=biases[0], activation="relu", a_rows=rows)]
        for w, b in zip(weights[1:last], biases[1:last]):
            acts.append(self._matmul(acts[-1], w, bias=b, activation="relu"))
        m, k = acts[-1].shape
        loss, d = self._call("linear_cross_entropy", (m, weights[last].shape[1], k), "nn",
                             acts[-1], weights[last], y, bias=biases[last], label_rows=rows)
        acts.insert(0, x)  # acts[i]: the input of layer i (the dataset, read through rows)
        low = self.low is not self.params
        for i in reversed(range(len(weights))):
            dx = self._matmul(d, weights[i], trans_b=True, relu_grad_of=acts[i]) if i > 0 else None
            w, b = self.params[2 * i], self.params[2 * i + 1]
            bw, bb = (self.bufs[2 * i], self.bufs[2 * i + 1]) if self.bufs is not None else (None, None)
            self._call("linear_sgd", (w.shape[0], w.shape[1], d.shape[0]), "tn", acts[i], d, w, b, bw, bb,
                       lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                       x_rows=rows if i == 0 else None,
                       w_low=weights[i] if low else None, b_low=biases[i] if low else None)
            d = dx
        return loss

    def _unfused_step(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x, y = x.index_select(0, rows), y.index_select(0, rows)
        self._refresh_low()
        weights, biases = self.low[0::2], self.low[1::2]

        acts = [x]  # the input of each layer, kept for the backward
        for w, b in zip(weights[:-1], biases[:-1]):
            acts.append(self._matmul(acts[-1], w, bias=b, activation="relu"))
        logits = self._matmul(acts[-1], weights[-1], bias=biases[-1])
        loss, d = self._call("softmax_cross_entropy", tuple(logits.shape), "", logits, y)

        grads: list[torch.Tensor] = [None] * len(self.params)
        for i in reversed(range(len(weights))):
            grads[2 * i] = self._matmul(acts[i], d, trans_a=True)
            grads[2 * i + 1] = self._call("bias_grad", tuple(d.shape), "", d)
            if i > 0:
                dx = self._matmul(d, weights[i], trans_b=True)
                d = self._call("relu_backward", tuple(dx.shape), "", dx, acts[i])

        self._call("sgd_update", (self._numel,), "", self.params, grads, self.bufs,
                   lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return loss

    def snapshot(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.params]

    def restore(self, saved: list[torch.Tensor]) -> None:
        torch._foreach_copy_(self.params, saved)
        if self.bufs is not None:
            torch._foreach_zero_(self.bufs)
        self._refresh_low()

    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.params[0::2], self.params[1::2]))
