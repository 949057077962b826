"""What gets tuned: the inputs of an op call, its reference result, and its cost in FLOPs/bytes.

The calls themselves, and their shape keys, are the kernels' common ground:
kernels_core/mlp.py (the trainer's step) and kernels_core/shapes.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kernels_core.contract import DTYPE_NAMES, DTYPES, TUNED_OPS
from kernels_core.mlp import DEFAULT, SGD_OPS, Call, dedupe
from kernels_core.persistent import Layout, step_outputs
from kernels_core.reference import exact
from kernels_core.shapes import FUSED_LAYOUT, OP_RANK

# Relative error ||out - ref|| / ||ref|| allowed per working dtype: a few units
# of output rounding (fp16 2^-11, bf16 2^-8), and TF32-level error for fp32;
# and per lower precision a config may compute at (Space.lower_precision):
# TF32 products carry fp16's 10 mantissa bits.
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-3, "bf16": 3e-2, "tf32": 5e-3}
# The SGD ops' inputs: the trainer's momentum, and a weight decay so its term is exercised.
SGD_HYPER = {"lr": 0.01, "momentum": DEFAULT.momentum, "weight_decay": 1e-4}
# The persistent kernel's inputs. Its correctness gate trains 2 steps against float64, from the
# epoch's last slot, so the segment wraps. Not more: each hidden bias sits in a gap of its unit's
# pre-activations over the gate's rows (_open_half), and training moves them. Over 40 draws at
# 784-128-128-10 (fp32, momentum 0.9), the gaps taken over 5 steps' rows, the pre-activation nearest
# to zero was 7.6e-3 of its unit's spread at the first step, 1.4e-4 at the second, 6.8e-7 at the
# third, within reach of a kernel's rounding (about 1e-7 of it in fp32); over 2 steps' rows, 1.4e-2
# and 1.3e-3. A timed call is a segment of 32 steps in one launch, through an epoch of MNIST's
# 60,000 images drawn without repeats, as the trainer's: the first layer gathers rows it has not
# read lately, from memory, not from L2; on the host, the gate's steps from a few batches' worth.
# Weight decay 0, the trainer's (whether it is 0 is compiled into the kernel).
PERSISTENT = {"check_steps": 2, "segment": 32, "images": 60_000, "lr": 0.01, "weight_decay": 0.0}


def calls_for_shapes(ops, dtype: str, shapes, momentum: float = SGD_HYPER["momentum"]) -> list[Call]:
    """Each op gets the given shapes of its rank (3 dims: matmul and the fused ops in their one
    layout, 2: row ops, 1: sgd)."""
    return dedupe([Call(op, dtype, shape, layout, momentum=momentum) for op in ops for shape, layout in shapes
                   if OP_RANK[op] == len(shape) and FUSED_LAYOUT.get(op, layout) == layout])


def call_inputs(call: Call, device, generator: torch.Generator) -> "OpInputs":
    """Fresh random inputs for `call`, as the trainer would pass them."""
    return make_inputs(call.op, call.dtype, call.shape, call.layout, device, generator, bias=call.bias,
                       activation=call.activation, fused_arg=call.fused_arg, momentum=call.momentum)


@dataclass
class OpInputs:
    args: tuple
    kwargs: dict

    def clone(self) -> "OpInputs":
        def copy(v):
            if isinstance(v, torch.Tensor):
                return v.clone()
            if isinstance(v, list):
                return [copy(x) for x in v]
            return v
        return replace(self, args=tuple(copy(a) for a in self.args),
                       kwargs={k: copy(v) for k, v in self.kwargs.items()})


def make_inputs(op: str, dtype: str, shape, layout: str, device, generator: torch.Generator, *,
                bias: bool = False, activation: str | None = None, fused_arg: str | None = None,
                momentum: float = SGD_HYPER["momentum"]) -> OpInputs:
    """Fresh random inputs for one call (never zeros; labels random class ids; SGD's momentum
    buffers only with momentum, as the trainer keeps them)."""
    dt = DTYPES[dtype]
    hyper = dict(SGD_HYPER, momentum=momentum)

    def randn(*shape, dtype=dt):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    s = tuple(shape)
    if op == "matmul":
        m, n, k = s
        trans_a, trans_b = layout[0] == "t", layout[1] == "t"
        a = randn(k, m) if trans_a else randn(m, k)
        b = randn(n, k) if trans_b else randn(k, n)
        kwargs = {"trans_a": trans_a, "trans_b": trans_b, "activation": activation,
                  "bias": randn(n) if bias else None}
        if fused_arg == "a_rows":  # the batch's rows drawn, with repeats, from a stored set 3x its size
            a = randn(3 * m, k)
            kwargs["a_rows"] = torch.randint(0, 3 * m, (m,), generator=generator, device=device)
        elif fused_arg == "relu_grad_of":  # about half the mask zero, as after a ReLU
            kwargs["relu_grad_of"] = randn(m, n)
        elif fused_arg is not None:
            raise ValueError(f"fused_arg {fused_arg!r}: one of a_rows, relu_grad_of")
        return OpInputs((a, b), kwargs)
    if op == "relu":
        return OpInputs((randn(*s),), {})
    if op == "relu_backward":
        return OpInputs((randn(*s), randn(*s)), {})
    if op == "bias_add":
        return OpInputs((randn(*s), randn(s[1])), {"activation": activation})
    if op == "bias_grad":
        return OpInputs((randn(*s),), {})
    if op == "softmax_cross_entropy":
        labels = torch.randint(0, s[1], (s[0],), generator=generator, device=device)
        return OpInputs((randn(*s) * 2, labels), {})
    if op == "sgd_update":
        params = [randn(s[0], dtype=torch.float32)]
        bufs = [randn(s[0], dtype=torch.float32)] if momentum else None
        return OpInputs((params, [randn(s[0])], bufs), hyper)
    # The fused ops are timed on plain operands: the trainer's first layer also gathers rows
    # (label_rows, x_rows) and in fp16/bf16 writes the low copies, variants of the same GEMM.
    if op == "linear_cross_entropy":
        m, n, k = s
        labels = torch.randint(0, n, (m,), generator=generator, device=device)
        # Logits of about unit size, as a trained net's are: randn inputs over K terms scaled by 1/sqrt(K).
        return OpInputs((randn(m, k), randn(k, n) * k ** -0.5, labels), {"bias": randn(n) if bias else None})
    if op == "linear_sgd":
        k_in, n_out, b = s
        f32 = torch.float32
        bufs = (randn(k_in, n_out, dtype=f32), randn(n_out, dtype=f32)) if momentum else (None, None)
        return OpInputs((randn(b, k_in), randn(b, n_out), randn(k_in, n_out, dtype=f32), randn(n_out, dtype=f32),
                         *bufs), hyper)
    if op == "persistent":
        return _persistent_inputs(dtype, Layout(*s), device, randn, generator, momentum)
    raise ValueError(f"unknown op {op!r}; known: {', '.join(TUNED_OPS)}")


def _persistent_inputs(dtype: str, layout: Layout, device, randn, generator, momentum: float) -> OpInputs:
    """x, y, batches (an epoch: every image once), pos (the epoch's last slot, so the gate's
    segment wraps), params (fp32, each W scaled by its fan-in as nn.Linear's are, each
    hidden bias in a gap of its unit's pre-activations: _open_half), momentum buffers, loss slots;
    the gate's steps and the SGD settings."""
    steps = PERSISTENT["check_steps"]
    images = PERSISTENT["images"] if torch.device(device).type == "cuda" else 4 * steps * layout.batch
    x = randn(images, layout.inputs)
    y = torch.randint(0, layout.classes, (images,), generator=generator, device=device)
    epoch = images // layout.batch
    batches = torch.randperm(images, generator=generator, device=device)[:epoch * layout.batch].view(epoch, -1)
    params = torch.cat([t.flatten() for fan_in, fan_out in zip(layout.dims[:-1], layout.dims[1:])
                        for t in (randn(fan_in, fan_out, dtype=torch.float32) * fan_in ** -0.5,
                                  randn(fan_out, dtype=torch.float32) * 0.1)])
    first = epoch - 1
    gated = batches[(torch.arange(steps, device=device) + first) % epoch].flatten()
    _open_half(layout, params, x.index_select(0, gated).double())
    bufs = randn(layout.numel, dtype=torch.float32) * 0.01 if momentum else None
    pos = torch.full((), first, dtype=torch.int64, device=device)
    losses = torch.zeros(epoch, dtype=torch.float32, device=device)
    return OpInputs((x, y, batches, pos, params, bufs, losses),
                    dict(layout=layout, lr=PERSISTENT["lr"], momentum=momentum,
                         weight_decay=PERSISTENT["weight_decay"], steps=steps))


def _open_half(layout: Layout, params: torch.Tensor, a: torch.Tensor) -> None:
    """Each hidden unit's bias set so that its ReLU is open for some of the rows `a` (the gate's
    inputs) and shut for the others, none near the edge: the bias takes away the middle of the
    widest gap between the unit's pre-activations in their middle half (in float64, at the initial
    weights). Where float64 puts a pre-activation within a kernel's rounding of zero, the kernel's
    ReLU may fall the other way and pass a gradient float64 blocks (biases drawn near zero: 2 of 40
    CUDA trials in fp32 at 784-128-128-10 moved W0's update 0.3%, 6 of 80 in fp16 failed so, at
    configs that passed on other draws); a unit open or shut for every row would leave a mask read
    from the wrong row unseen."""
    views = layout.views(params)
    for w, b in zip(views[0:-2:2], views[1:-2:2]):
        pre = a @ w.double()
        z = pre.sort(0).values
        lo, hi = len(z) // 4, 3 * len(z) // 4
        widest = (z[lo + 1:hi + 1] - z[lo:hi]).argmax(0, keepdim=True) + lo
        b.copy_(-(z.gather(0, widest) + z.gather(0, widest + 1)).squeeze(0) / 2)
        a = torch.relu(pre + b.double())


def bind(fn, op: str, inputs: OpInputs, config) -> Callable[[], object]:
    """`inputs` bound to `fn` (a backend op, or a baseline taking no config): a call that runs it.
    The persistent kernel is planned here, once (its compile and the residency check), and the
    call launches its steps."""
    kwargs = dict(inputs.kwargs, **({"config": config} if config is not None else {}))
    if op == "persistent":
        steps, layout = kwargs.pop("steps"), kwargs.pop("layout")
        plan = fn.plan(*inputs.args, layout, **kwargs)
        return lambda: plan.run(steps)
    return lambda: fn(*inputs.args, **kwargs)


def timed(op: str, inputs: OpInputs) -> tuple[OpInputs, int]:
    """What a measurement times, and the units its time is divided by: the call itself, or for the
    persistent kernel a segment of steps in one launch (at most the epoch; each call going on from
    the last one's position in it), timed per step."""
    if op != "persistent":
        return inputs, 1
    steps = min(PERSISTENT["segment"], inputs.args[2].shape[0])
    return replace(inputs, kwargs=dict(inputs.kwargs, steps=steps)), steps


def run(fn: Callable, op: str, inputs: OpInputs, config) -> list[torch.Tensor]:
    """Call `fn` (a backend op, or a baseline taking no config) and list what it produced.

    The SGD ops work in place, so their outputs are the (mutated) params and buffers, if any;
    the persistent kernel's are its steps' losses, its move of the position and its updates
    (persistent.step_outputs).
    """
    if op == "persistent":
        _, _, batches, pos, params, bufs, losses = inputs.args
        first, params_before = int(pos), params.clone()
        bufs_before = bufs.clone() if bufs is not None else None
        bind(fn, op, inputs, config)()
        return step_outputs(losses, pos, first, inputs.kwargs["steps"], batches.shape[0], inputs.kwargs["layout"],
                            params, params_before, bufs, bufs_before)
    result = bind(fn, op, inputs, config)()
    if op == "sgd_update":
        return list(inputs.args[0]) + list(inputs.args[2] or ())
    if op == "linear_sgd":  # w, bias, w_buf, b_buf: updated in place
        return [t for t in inputs.args[2:6] if t is not None]
    return list(result) if isinstance(result, tuple) else [result]


def expected(op: str, inputs: OpInputs) -> list[torch.Tensor]:
    """The float64 reference outputs (inputs are left as they are)."""
    result = getattr(exact, op)(*inputs.args, **inputs.kwargs)
    if op in SGD_OPS:
        params, bufs = result
        return params + bufs
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check_result(outputs: list[torch.Tensor], refs: list[torch.Tensor],
                 precision: str | None = None) -> tuple[float, str | None]:
    """(largest norm-wise relative error, why the outputs are wrong or None).

    Each output must pass two tests, within the tolerance of its own dtype (sgd_update's fp32
    params are held to fp32 even when its grads are bf16), or of `precision` where the config
    computes below it: the norm-wise error ||o - r|| / ||r||,
    and the worst element's |o - r| / (|r| + rms(r)), since a wrong row or tile out of millions
    barely moves the first. Adding the output's rms keeps elements near zero from demanding
    more than the dtype can give. NaN, Inf or a wrong shape fail outright.
    """
    if len(outputs) != len(refs):
        return math.inf, f"{len(outputs)} outputs, expected {len(refs)}"
    worst_norm, problem = 0.0, None
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
            return math.inf, f"output {i}: shape {tuple(getattr(out, 'shape', ()))}, expected {tuple(ref.shape)}"
        o, r = out.detach().double(), ref.detach().double().to(out.device)
        if not torch.isfinite(o).all():
            return math.inf, f"output {i}: NaN or Inf"
        if r.numel() == 0:
            continue
        diff = (o - r).abs()
        norm = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(r).clamp_min(1e-30))
        element = float((diff / (r.abs() + r.pow(2).mean().sqrt()).clamp_min(1e-30)).max())
        dtype = DTYPE_NAMES.get(out.dtype, "fp32")
        if precision is not None and TOLERANCE[precision] > TOLERANCE[dtype]:
            dtype = precision
        tol = TOLERANCE[dtype]
        worst_norm = max(worst_norm, norm)
        if problem is None and norm > tol:
            problem = f"output {i}: relative error {norm:.3g} > {tol:g} allowed for {dtype}"
        elif problem is None and element > tol:
            problem = f"output {i}: worst element's relative error {element:.3g} > {tol:g} allowed for {dtype}"
    return worst_norm, problem


def gate_precision(call: Call, space, config) -> str | None:
    """The precision a trial's outputs are held to where it is not their dtype's (check_result):
    the lower one a config computes at, or the persistent kernel's working dtype, whose fp32
    losses and weight updates come of 16-bit products."""
    lower = space.precision_of(config) if config is not None and space is not None else None
    return lower or (call.dtype if call.op == "persistent" else None)


def flops_bytes(op: str, shape, dtype: str, momentum: float = SGD_HYPER["momentum"]) -> tuple[float | None, float]:
    """(FLOPs or None for memory-bound ops, bytes moved at least once); the persistent kernel's a
    step."""
    elt = DTYPES[dtype].itemsize
    fp32_state = 16 if momentum else 8  # SGD's fp32 weight, and its buffer, read and written
    if op == "persistent":  # 3 GEMMs a layer (forward, weight gradient, input gradient but the first's)
        layout = Layout(*shape)
        pairs = list(zip(layout.dims[:-1], layout.dims[1:]))
        flops = 2.0 * layout.batch * (3 * sum(a * b for a, b in pairs) - layout.inputs * layout.hidden)
        rows = layout.batch * (elt * layout.inputs + 16)  # each row's image, its index and its label (int64)
        return flops, float(rows + fp32_state * layout.numel)
    if op == "matmul":
        m, n, k = shape
        return 2.0 * m * n * k, float(elt * (m * k + k * n + m * n))
    if op == "linear_cross_entropy":  # dlogits written, the logits never
        m, n, k = shape
        return 2.0 * m * n * k, float(elt * (m * k + k * n + m * n) + m * 8 + 4)
    if op == "linear_sgd":  # x, dy read; the fp32 state, no dW
        k_in, n_out, b = shape
        return 2.0 * k_in * n_out * b, float(elt * b * (k_in + n_out) + fp32_state * (k_in * n_out + n_out))
    if op == "sgd_update":
        (n,) = shape
        return None, float(n * (fp32_state + elt))  # the fp32 state, grads read
    m, n = shape
    per_elt = {"relu": 2, "relu_backward": 3, "bias_add": 2, "bias_grad": 1, "softmax_cross_entropy": 2}[op]
    extra = {"bias_add": n * elt, "bias_grad": n * 4, "softmax_cross_entropy": m * 8 + 4}.get(op, 0)
    return None, float(per_elt * m * n * elt + extra)


def metric(op: str) -> str:
    return "tflops" if OP_RANK[op] == 3 else "gbps"


def throughput(op: str, shape, dtype: str, time_ms: float, momentum: float = SGD_HYPER["momentum"]) -> float:
    """TFLOP/s for matmul and the fused GEMMs, GB/s otherwise."""
    flops, nbytes = flops_bytes(op, shape, dtype, momentum)
    seconds = time_ms / 1e3
    return flops / seconds / 1e12 if flops is not None else nbytes / seconds / 1e9
