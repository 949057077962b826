"""Torch references for every op of the contract.

Two flavours with the twins' signatures (minus `out` and `config`):
- `exact`: computed in float64 from the same inputs, the yardstick of the
  tests and of the tuner's correctness gate;
- `native`: what a PyTorch user would call in the working dtype, the baseline
  every benchmark and tuning study reports its speed against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _op(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.t() if transposed else t


def _act(y: torch.Tensor, activation) -> torch.Tensor:
    return torch.relu(y) if activation == "relu" else y


class exact:
    """float64 references; results are float64 (loss and sums included)."""

    @staticmethod
    def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, accumulate="fp32"):
        y = _op(a, trans_a).double() @ _op(b, trans_b).double()
        if bias is not None:
            y = y + bias.double()
        return _act(y, activation)

    @staticmethod
    def relu(x):
        return torch.relu(x.double())

    @staticmethod
    def relu_backward(grad, y):
        return torch.where(y.double() <= 0, torch.zeros((), dtype=torch.float64, device=grad.device), grad.double())

    @staticmethod
    def bias_add(x, bias, *, activation=None):
        return _act(x.double() + bias.double(), activation)

    @staticmethod
    def bias_grad(grad):
        return grad.double().sum(0)

    @staticmethod
    def softmax_cross_entropy(logits, labels):
        z = logits.double()
        loss = F.cross_entropy(z, labels)
        grad = (torch.softmax(z, dim=1) - F.one_hot(labels, z.shape[1]).double()) / z.shape[0]
        return loss, grad

    @staticmethod
    def sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0, weight_decay=0.0):
        """New (params, bufs) in float64; the inputs are left as they are."""
        new_params, new_bufs = [], []
        for i, (p, g) in enumerate(zip(params, grads)):
            p, g = p.double(), g.double()
            d = g + weight_decay * p
            if momentum:
                d = momentum * momentum_bufs[i].double() + d
                new_bufs.append(d)
            new_params.append(p - lr * d)
        return new_params, new_bufs


class native:
    """What PyTorch itself runs in the working dtype: the speed baseline."""

    @staticmethod
    def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, accumulate="fp32"):
        a, b = _op(a, trans_a), _op(b, trans_b)
        y = torch.addmm(bias, a, b) if bias is not None else a @ b
        return _act(y, activation)

    @staticmethod
    def relu(x):
        return torch.relu(x)

    @staticmethod
    def relu_backward(grad, y):
        return torch.ops.aten.threshold_backward(grad, y, 0)

    @staticmethod
    def bias_add(x, bias, *, activation=None):
        return _act(x + bias, activation)

    @staticmethod
    def bias_grad(grad):
        return grad.sum(0, dtype=torch.float32)

    @staticmethod
    def softmax_cross_entropy(logits, labels):
        z = logits.float()
        loss = F.cross_entropy(z, labels)
        grad = (torch.softmax(z, dim=1) - F.one_hot(labels, z.shape[1])) / z.shape[0]
        return loss, grad.to(logits.dtype)

    @staticmethod
    def sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0, weight_decay=0.0):
        if weight_decay:
            grads = torch._foreach_add([g.float() for g in grads], params, alpha=weight_decay)
        if momentum:
            torch._foreach_mul_(momentum_bufs, momentum)
            torch._foreach_add_(momentum_bufs, grads)
            torch._foreach_add_(params, momentum_bufs, alpha=-lr)
        else:
            torch._foreach_add_(params, grads, alpha=-lr)
