"""What gets tuned: op calls with shapes, their inputs, and their cost in FLOPs/bytes.

A call's shape key names its store entry, and its study (Call.study_key, marked
":no-momentum" for SGD without buffers):
matmul (M, N, K) plus a layout ("nn", "tn", "nt", "tt": t = that operand is
transposed), elementwise and row ops (M, N), softmax_cross_entropy (M, C),
sgd_update (total parameter elements,), and the fused ops by their GEMM:
linear_cross_entropy (M, N, K):nn (the logits), linear_sgd (K_in, N_out, B):tn
(the weight gradient).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kernels_core.contract import DTYPE_NAMES, DTYPES, MAX_DIM, OPS
from kernels_core.reference import exact

OP_RANK = {"matmul": 3, "relu": 2, "relu_backward": 2, "bias_add": 2, "bias_grad": 2,
           "softmax_cross_entropy": 2, "sgd_update": 1, "linear_cross_entropy": 3, "linear_sgd": 3}
# The layout each fused op's GEMM has: the only one it takes.
FUSED_LAYOUT = {"linear_cross_entropy": "nn", "linear_sgd": "tn"}
LAYOUTS = ("nn", "tn", "nt", "tt")
# Relative error ||out - ref|| / ||ref|| allowed per working dtype: a few units
# of output rounding (fp16 2^-11, bf16 2^-8), and TF32-level error for fp32.
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-3, "bf16": 3e-2}
SGD_HYPER = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
# The ops that apply SGD: with momentum 0 (the trainer's seed protocol) they keep no buffers, 8
# bytes a weight fewer to move (the fp32 buffer read and written), so they are other calls to tune.
SGD_OPS = ("sgd_update", "linear_sgd")
MNIST_IN, MNIST_CLASSES = 784, 10


def shape_key(shape, layout: str = "") -> str:
    return "x".join(str(int(d)) for d in shape) + (f":{layout}" if layout else "")


@dataclass(frozen=True)
class Call:
    """One op call as the trainer makes it: enough to build its inputs."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    layout: str = ""
    bias: bool = False
    activation: str | None = None
    # matmul's fused-step argument, "a_rows" (the batch gathered in A's loads) or "relu_grad_of"
    # (dX masked by the layer below's ReLU): the same GEMM and store entry as the plain call, so the
    # tuner measures the stricter one, and a config some kernel cannot run with it is never picked.
    fused_arg: str | None = None
    # The SGD ops' momentum (others ignore it). Whether it is 0 changes what they move; its value
    # does not, so a study is per shape and zero or not (study_key).
    momentum: float = SGD_HYPER["momentum"]

    @property
    def key(self) -> str:
        return shape_key(self.shape, self.layout)

    @property
    def study_key(self) -> str:
        """The key that names the call's study: the store's key, marked where SGD keeps no buffers.
        The store entry keeps the plain key: a store holds one protocol's winners."""
        return self.key + (":no-momentum" if self.op in SGD_OPS and not self.momentum else "")

    def inputs(self, device, generator: torch.Generator) -> "OpInputs":
        return make_inputs(self.op, self.dtype, self.shape, self.layout, device, generator,
                           bias=self.bias, activation=self.activation, fused_arg=self.fused_arg,
                           momentum=self.momentum)


def mnist_mlp_calls(hidden: int, layers: int, batch: int, dtype: str, *, fused: bool | None = None,
                    momentum: float = SGD_HYPER["momentum"]) -> list[Call]:
    """Every distinct call of one training step of 784 -> hidden x layers -> 10: the fused step's
    (fused=True), the unfused step's (False), or both (None, the tuner's workload: the trainer
    runs either, `--no-fuse` choosing), its SGD with the trainer's `momentum`.

    Weights are stored (in, out) row-major, so the forward pass is x @ W, the
    weight gradient h^T @ dY ("tn") and the input gradient dY @ W^T ("nt").
    The fused step's first matmul gathers the batch and its "nt" matmuls mask
    by the ReLU (Call.fused_arg): the same GEMMs as the unfused step's, which
    `dedupe` drops in their favour.
    """
    if hidden < 1 or layers < 1 or batch < 1:
        raise ValueError(f"mnist-mlp needs hidden, layers, batch >= 1 (got {hidden}, {layers}, {batch})")
    if fused is None:
        return dedupe(mnist_mlp_calls(hidden, layers, batch, dtype, fused=True, momentum=momentum)
                      + mnist_mlp_calls(hidden, layers, batch, dtype, fused=False, momentum=momentum))
    dims = [MNIST_IN] + [hidden] * layers + [MNIST_CLASSES]
    last = len(dims) - 2
    calls = []
    for i in range(len(dims) - 1):
        if i == last and fused:
            calls.append(Call("linear_cross_entropy", dtype, (batch, dims[i + 1], dims[i]), "nn", bias=True))
        else:
            calls.append(Call("matmul", dtype, (batch, dims[i + 1], dims[i]), "nn", bias=True,
                              activation=None if i == last else "relu",
                              fused_arg="a_rows" if i == 0 and fused else None))
    for i in range(len(dims) - 1):
        calls.append(Call("linear_sgd" if fused else "matmul", dtype, (dims[i], dims[i + 1], batch), "tn",
                          momentum=momentum))
        if i > 0:  # the input layer needs no gradient for its input
            calls.append(Call("matmul", dtype, (batch, dims[i], dims[i + 1]), "nt",
                              fused_arg="relu_grad_of" if fused else None))
    if not fused:
        calls += [
            Call("relu_backward", dtype, (batch, hidden)),
            Call("bias_grad", dtype, (batch, hidden)),
            Call("bias_grad", dtype, (batch, MNIST_CLASSES)),
            Call("softmax_cross_entropy", dtype, (batch, MNIST_CLASSES)),
            Call("sgd_update", dtype, (sum(a * b + b for a, b in zip(dims, dims[1:])),), momentum=momentum),
        ]
    return dedupe(calls)


def dedupe(calls: list[Call]) -> list[Call]:
    seen: dict[tuple[str, str], Call] = {}
    for call in calls:
        seen.setdefault((call.op, call.key), call)
    return list(seen.values())


def parse_shapes(text: str) -> list[tuple[tuple[int, ...], str]]:
    """"4096x4096x4096,128x1024x784:tn,128x1024" -> [(shape, layout), ...]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        dims, _, layout = item.partition(":")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: {item!r} is not like 4096x4096x4096 or 128x1024") from None
        if not shape or min(shape) < 1 or max(shape) > MAX_DIM or len(shape) > 3:
            raise ValueError(f"--shapes: {item!r} needs 1 to 3 dimensions, each from 1 to {MAX_DIM}")
        if layout and len(shape) != 3:
            raise ValueError(f"--shapes: layout {layout!r} in {item!r}: only matmul shapes (MxNxK) take a layout")
        if layout and layout not in LAYOUTS:
            raise ValueError(f"--shapes: layout {layout!r} in {item!r} is not one of {', '.join(LAYOUTS)} "
                             "(t: that operand transposed)")
        out.append((shape, layout or ("nn" if len(shape) == 3 else "")))
    if not out:
        raise ValueError("--shapes: no shape given")
    return out


def calls_for_shapes(ops, dtype: str, shapes, momentum: float = SGD_HYPER["momentum"]) -> list[Call]:
    """Each op gets the given shapes of its rank (3 dims: matmul and the fused ops in their one
    layout, 2: row ops, 1: sgd)."""
    return dedupe([Call(op, dtype, shape, layout, momentum=momentum) for op in ops for shape, layout in shapes
                    if OP_RANK[op] == len(shape) and FUSED_LAYOUT.get(op, layout) == layout])


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
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def run(fn: Callable, op: str, inputs: OpInputs, config) -> list[torch.Tensor]:
    """Call `fn` (a backend op, or a baseline taking no config) and list what it produced.

    The SGD ops work in place, so their outputs are the (mutated) params and buffers, if any.
    """
    kwargs = dict(inputs.kwargs)
    if config is not None:
        kwargs["config"] = config
    result = fn(*inputs.args, **kwargs)
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
    return list(result) if isinstance(result, tuple) else [result]


def check_result(outputs: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[float, str | None]:
    """(largest norm-wise relative error, why the outputs are wrong or None).

    Each output must pass two tests, within the tolerance of its own dtype (sgd_update's fp32
    params are held to fp32 even when its grads are bf16): the norm-wise error ||o - r|| / ||r||,
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
        tol = TOLERANCE[dtype]
        worst_norm = max(worst_norm, norm)
        if problem is None and norm > tol:
            problem = f"output {i}: relative error {norm:.3g} > {tol:g} allowed for {dtype}"
        elif problem is None and element > tol:
            problem = f"output {i}: worst element's relative error {element:.3g} > {tol:g} allowed for {dtype}"
    return worst_norm, problem


def flops_bytes(op: str, shape, dtype: str, momentum: float = SGD_HYPER["momentum"]) -> tuple[float | None, float]:
    """(FLOPs or None for memory-bound ops, bytes moved at least once)."""
    elt = DTYPES[dtype].itemsize
    fp32_state = 16 if momentum else 8  # SGD's fp32 weight, and its buffer, read and written
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
