"""Torch references for every op of the contract, and for the persistent training kernel.

Two flavours with the twins' signatures (minus `out` and `config`):
- `exact`: computed in float64 from the same inputs, the yardstick of the
  tests and of the tuner's correctness gate;
- `native`: what a PyTorch user would call in the working dtype, the baseline
  every benchmark and tuning study reports its speed against.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kernels_core.persistent import Layout, step_outputs


def _op(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.t() if transposed else t


def _act(y: torch.Tensor, activation) -> torch.Tensor:
    return torch.relu(y) if activation == "relu" else y


def _rows(t: torch.Tensor, rows) -> torch.Tensor:
    """t[rows], where an index outside [0, len(t)) reads a row of zeros (the kernels' contract)."""
    if rows is None:
        return t
    inside = (rows >= 0) & (rows < t.shape[0])
    picked = t.index_select(0, torch.where(inside, rows, torch.zeros_like(rows)))
    return picked * inside.to(t.dtype).view(-1, *([1] * (t.dim() - 1)))


def _relu_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.where(y <= 0, torch.zeros((), dtype=g.dtype, device=g.device), g)


def mlp_steps(x, y, batches, pos, params, bufs, losses, layout, *, lr, momentum, weight_decay, steps,
               compute: torch.dtype) -> None:
    """The persistent kernel's `steps` training steps (kernels_core/persistent.py), in place: the
    batches' rows from slot *pos on (mod the epoch), each step's mean loss into losses[slot], the
    fp32 params (and bufs, with momentum) updated by torch.optim.SGD's rule, *pos advanced. The
    arithmetic is `compute`'s (the loss's and the SGD update's at least fp32's, as the kernels');
    every value the kernels store in x's dtype (the weights a GEMM reads, each activation, the
    logits, each output gradient) is rounded to it, so that in float64 only the kernels' fp32
    sums stay between the two. Capturable: nothing reads the device on the host."""
    rd = lambda t: t.to(x.dtype).to(compute)  # noqa: E731
    sgd = torch.promote_types(compute, torch.float32)  # the loss's and the update's: fp32 at least
    ps = layout.views(params)
    buf_views = layout.views(bufs) if momentum else [None] * len(ps)
    for _ in range(steps):
        slot = pos.remainder(batches.shape[0]).view(1)
        rows = batches.index_select(0, slot).view(-1)
        acts = [x.index_select(0, rows).to(compute)]
        for i in range(0, len(ps) - 2, 2):
            acts.append(rd(torch.relu(torch.addmm(ps[i + 1].to(compute), acts[-1], rd(ps[i])))))
        logits = rd(torch.addmm(ps[-1].to(compute), acts[-1], rd(ps[-2])))  # nn.Linear's: the bias in the product
        labels = y.index_select(0, rows)
        wide = logits.to(sgd)  # the loss and its gradient in fp32 at least, as autocast runs them
        losses.index_copy_(0, slot, F.cross_entropy(wide, labels).to(losses.dtype).view(1))
        d = rd((wide.softmax(1) - F.one_hot(labels, layout.classes).to(sgd)) / len(labels))
        for i in reversed(range(0, len(ps), 2)):
            a = acts[i // 2]
            grads = (a.t().to(sgd) @ d.to(sgd), d.to(sgd).sum(0))  # fp32 weight gradients, as the kernels keep
            if i:
                d = rd((d @ rd(ps[i]).t()) * (a > 0))
            for p, buf, g in zip(ps[i:i + 2], buf_views[i:i + 2], grads):
                g = g.to(sgd) + weight_decay * p.to(sgd)
                if momentum:  # the kernels keep the buffers and weights in fp32
                    buf.copy_((momentum * buf.to(sgd) + g).float())
                    g = buf.to(sgd)
                p.copy_((p.to(sgd) - lr * g).float())
        pos.add_(1)


class exact:
    """float64 references; results are float64 (loss and sums included)."""

    @staticmethod
    def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, accumulate="fp32",
               a_rows=None, relu_grad_of=None):
        y = _op(_rows(a.double(), a_rows), trans_a) @ _op(b, trans_b).double()
        if bias is not None:
            y = y + bias.double()
        y = _act(y, activation)
        return y if relu_grad_of is None else _relu_grad(y, relu_grad_of.double())

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

    @staticmethod
    def linear_cross_entropy(x, w, labels, *, bias=None, label_rows=None):
        """(loss, dlogits) from the logits as matmul stores them: rounded to x's dtype."""
        logits = exact.matmul(x, w, bias=bias).to(x.dtype)
        return exact.softmax_cross_entropy(logits, _rows(labels, label_rows))

    @staticmethod
    def linear_sgd(x, dy, w, bias, w_buf, b_buf, *, lr, momentum=0.0, weight_decay=0.0, x_rows=None,
                   w_low=None, b_low=None):
        """New ([w, bias], [w_buf, b_buf] or []) in float64 from the exact gradients; inputs untouched."""
        gw = _rows(x.double(), x_rows).t() @ dy.double()
        return exact.sgd_update([w, bias], [gw, dy.double().sum(0)], [w_buf, b_buf] if momentum else None,
                                lr=lr, momentum=momentum, weight_decay=weight_decay)

    @staticmethod
    def persistent(x, y, batches, pos, params, bufs, losses, *, layout, lr, momentum=0.0, weight_decay=0.0, steps):
        """The persistent kernel's segment of `steps` steps in float64 (mlp_steps), on copies:
        persistent.step_outputs of it."""
        first, after = int(pos), pos.clone()
        params_before, bufs_before = params.double(), bufs.double() if momentum else None
        params64, bufs64 = params_before.clone(), bufs_before.clone() if momentum else None
        losses64 = losses.double()
        mlp_steps(x, y, batches, after, params64, bufs64, losses64, layout, lr=lr, momentum=momentum,
                  weight_decay=weight_decay, steps=steps, compute=torch.float64)
        return step_outputs(losses64, after, first, steps, batches.shape[0], layout, params64, params_before,
                            bufs64, bufs_before)


@dataclass
class _TorchSteps:
    """The persistent op's torch baseline, planned as the twins' `persistent.plan` plans: `run`
    takes the steps with torch's own kernels in the working dtype (a launch an operation)."""

    inputs: tuple
    layout: Layout
    sgd: dict

    def run(self, steps: int) -> None:
        x = self.inputs[0]
        mlp_steps(*self.inputs, self.layout, **self.sgd, steps=steps, compute=x.dtype)


def _plan_torch_steps(x, y, batches, pos, params, bufs, losses, layout, *, lr, momentum=0.0, weight_decay=0.0,
                      config=None) -> _TorchSteps:
    return _TorchSteps((x, y, batches, pos, params, bufs, losses), layout,
                       dict(lr=lr, momentum=momentum, weight_decay=weight_decay))


class native:
    """What PyTorch itself runs in the working dtype: the speed baseline."""

    # The persistent op, as the twins offer it: a module whose plan(...) returns what runs the steps.
    persistent = SimpleNamespace(plan=_plan_torch_steps)

    @staticmethod
    def matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False, accumulate="fp32",
               a_rows=None, relu_grad_of=None):
        a, b = _op(_rows(a, a_rows), trans_a), _op(b, trans_b)
        y = torch.addmm(bias, a, b) if bias is not None else a @ b
        y = _act(y, activation)
        return y if relu_grad_of is None else torch.ops.aten.threshold_backward(y, relu_grad_of, 0)

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

    @staticmethod
    def linear_cross_entropy(x, w, labels, *, bias=None, label_rows=None):
        logits = native.matmul(x, w, bias=bias)
        return native.softmax_cross_entropy(logits, _rows(labels, label_rows))

    @staticmethod
    def linear_sgd(x, dy, w, bias, w_buf, b_buf, *, lr, momentum=0.0, weight_decay=0.0, x_rows=None,
                   w_low=None, b_low=None):
        gw = _rows(x, x_rows).t() @ dy
        native.sgd_update([w, bias], [gw, native.bias_grad(dy)], [w_buf, b_buf] if momentum else None,
                          lr=lr, momentum=momentum, weight_decay=weight_decay)
        for low, p in ((w_low, w), (b_low, bias)):
            if low is not None:
                low.copy_(p)
