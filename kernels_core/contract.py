"""The contract both kernel twins implement.

`kernels_cuda` and `kernels_triton` expose the same functions with the same
signatures; this module holds what they share so it is written once: the ops,
the dtypes and the argument checks (the search-space type is `space.Space`).
It imports neither CuPy nor Triton, so the tuner and the trainer can read it
on any machine.

The functions each twin exports (tensors are torch tensors on one device;
`config` is a dict of tunables, None for the op's default; every op allocates
its result unless `out` is given, and never synchronizes the device, so a
whole training step can be captured in a CUDA graph):

    matmul(a, b, *, bias=None, activation=None, trans_a=False, trans_b=False,
           out=None, config=None, accumulate="fp32", a_rows=None,
           relu_grad_of=None) -> c
        c = act(op(a) @ op(b) + bias), op transposes when its flag is set;
        split-K configs (SPLIT_K > 1) share one scratch buffer per device, so
        their calls must be ordered (one stream, as a training step runs);
        fp32/fp16/bf16 inputs of one dtype, c in that dtype, bias [N] in that
        dtype; accumulate="fp16" (fp16 inputs only) accumulates in fp16.
        a_rows (int64 [R]): a is read as a[a_rows] (rows of the stored
        tensor, before any transpose), so a batch drawn by index costs no
        gather kernel; an index outside [0, a.shape[0]) reads a row of
        zeros (it cannot raise without a sync).
        relu_grad_of (y [M, N], a's dtype): c = 0 where y <= 0, else
        op(a) @ op(b), i.e. relu_backward(op(a) @ op(b), y) in one kernel
        (the input gradient through the ReLU that produced y; a NaN y passes
        the gradient on); takes neither bias nor activation.
    linear_cross_entropy(x, w, labels, *, bias=None, label_rows=None,
                         out_grad=None, config=None) -> (loss, dlogits)
        softmax_cross_entropy(matmul(x, w, bias=bias), labels[label_rows])
        in one kernel: the logits (x [M, K] @ w [K, N], rounded to x's dtype
        as matmul would store them) never reach memory, so one tile must hold
        a whole row (config BLOCK_N >= N). loss is deterministic: the same
        bits on every run. Labels outside [0, N) as in softmax_cross_entropy;
        a label_rows entry outside [0, len(labels)) reads label 0 (as a_rows
        reads a row of zeros). It always uses the split-K scratch (its loss
        slots live there), so its calls must be ordered as split-K matmul
        calls are, and a call needing more scratch than earlier ones (the
        first on a device, or a new shape) comes before any graph capture.
    linear_sgd(x, dy, w, bias, w_buf, b_buf, *, lr, momentum=0.0,
               weight_decay=0.0, x_rows=None, w_low=None, b_low=None,
               config=None) -> None
        One linear layer's SGD step from its batch, in one kernel: the
        gradients gw = x[x_rows]^T @ dy (x [B, K_in], or [R, K_in] with
        x_rows of length B; dy [B, N_out]; fp32
        accumulation, never stored) and gb = column sums of dy (fp32), then
        sgd_update's rule on w [K_in, N_out] and bias [N_out] (float32, in
        place) with buffers w_buf, b_buf (float32, None when momentum == 0).
        w_low and b_low (x's dtype, optional) receive the updated w and bias
        rounded, the copies the next step's matmuls read. config: the "tn"
        matmul's tunables, SPLIT_K = 1.
    relu(x, *, out=None, config=None) -> y                  NaN stays NaN
    relu_backward(grad, y, *, out=None, config=None) -> dx  0 where y <= 0, else grad
        (torch's threshold_backward: a NaN y passes grad on)
    bias_add(x, bias, *, activation=None, out=None, config=None) -> y
        y = act(x + bias[None, :]) for x [M, N]
    bias_grad(grad, *, out=None, config=None) -> db         column sums [N], float32
    softmax_cross_entropy(logits, labels, *, out_grad=None, config=None)
        -> (loss, dlogits): loss is the mean over rows (0-dim float32 tensor),
        dlogits = (softmax(logits) - onehot(labels)) / M in logits' dtype;
        labels int64 [M] in [0, N). The op cannot raise on a label outside
        that range without a sync (torch's cross_entropy does raise), so
        instead: that row's loss is NaN (so the mean is NaN), its dlogits
        row is softmax / M, and the kernel records the label in the
        device's `label_flag`; `check_labels(device)` raises LabelError at
        a sync the caller chooses (the trainer: once per segment of steps).
    sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0,
               weight_decay=0.0, config=None) -> None
        torch.optim.SGD's rule (dampening 0, no Nesterov), in place, over
        lists of float32 params, grads (float32/fp16/bf16) and float32 buffers
        (None when momentum == 0)

and `space(op, dtype) -> Space` (dtype "fp32", "fp16" or "bf16").

`label_flag` and `check_labels` below are the one flag both twins'
softmax_cross_entropy kernels write.
"""
from __future__ import annotations

import functools
import numbers

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOATS = tuple(DTYPES.values())
# The largest dimension a caller may ask for (the tuner's shapes, the trainer's widths and
# batches): where the matmul kernels' 32-bit offsets end.
MAX_DIM = 2**31 - 1

OPS = (
    "matmul",
    "relu",
    "relu_backward",
    "bias_add",
    "bias_grad",
    "softmax_cross_entropy",
    "sgd_update",
    "linear_cross_entropy",
    "linear_sgd",
)
# The ops that fold a step's small kernels into a GEMM's epilogue (the fused training step).
FUSED_OPS = ("linear_cross_entropy", "linear_sgd")
# What the tuner and a config store know: the ops, and the persistent training kernel
# (kernels_core/persistent.py), a whole segment of training steps in one launch, whose config the
# tuner searches on the time of a step and the trainer reads from the store like an op's.
TUNED_OPS = OPS + ("persistent",)

ACTIVATIONS = (None, "relu")


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def device_arch(device: torch.device) -> int:
    """The arch configs are checked against on `device`; CPU tensors run in
    the Triton interpreter, which plays sm_90."""
    if device.type != "cuda":
        return 90
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def check_op(op: str, dtype: str) -> None:
    """Raises ValueError naming the argument unless `op` (an op or the persistent kernel) and
    `dtype` are the contract's."""
    if op not in TUNED_OPS:
        raise ValueError(f"op: {op!r} is not one of {TUNED_OPS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {tuple(DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} not supported (allowed: {allowed})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (all tensors must share a device)")


def check_same_dtype(**tensors) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {first_name}'s {first.dtype}")


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not one of {ACTIVATIONS}")


def output(name: str, out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *,
           contiguous: bool = True) -> torch.Tensor:
    """`out` checked against what the op writes, or a new tensor when it is None."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, out, ndim=len(shape), dtypes=(dtype,), device=device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(out.shape)}, expected {tuple(shape)}")
    if contiguous and not out.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (the kernel writes it as flat memory), "
                         f"got strides {out.stride()}")
    return out


def output_like(out, like: torch.Tensor) -> torch.Tensor:
    """`out` of an elementwise op: contiguous, with `like`'s shape, dtype and device."""
    return output("out", out, tuple(like.shape), like.dtype, like.device)


def check_rows(name: str, rows, device: torch.device) -> int:
    """Length of an index vector that gathers rows (a_rows, x_rows, label_rows)."""
    check_tensor(name, rows, ndim=1, dtypes=(torch.int64,), device=device)
    if rows.stride(0) != 1 and rows.shape[0] > 1:
        raise ValueError(f"{name}: must be contiguous, got stride {rows.stride(0)}")
    return rows.shape[0]


def matmul_args(a, b, bias, activation, trans_a: bool, trans_b: bool, accumulate: str,
                a_rows=None, relu_grad_of=None) -> tuple[int, int, int]:
    """M, N, K of op(a) @ op(b), where op transposes when its flag is set; every argument checked."""
    check_tensor("a", a, ndim=2, dtypes=FLOATS)
    check_tensor("b", b, ndim=2, dtypes=FLOATS, device=a.device)
    check_same_dtype(a=a, b=b)
    check_activation(activation)
    stored = (check_rows("a_rows", a_rows, a.device), a.shape[1]) if a_rows is not None else tuple(a.shape)
    m, k = (stored[1], stored[0]) if trans_a else stored
    kb, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != kb:
        raise ValueError(
            f"b: inner dimensions differ: op(a) is {m}x{k}, op(b) is {kb}x{n} "
            f"(trans_a={trans_a}, trans_b={trans_b})"
        )
    if accumulate not in ("fp32", "fp16"):
        raise ValueError(f"accumulate: {accumulate!r} is not 'fp32' or 'fp16'")
    if accumulate == "fp16" and a.dtype != torch.float16:
        raise ValueError(f"accumulate: 'fp16' needs fp16 inputs, got {dtype_name(a.dtype)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(a.dtype,), device=a.device)
        if bias.shape[0] != n:
            raise ValueError(f"bias: shape {tuple(bias.shape)}, expected ({n},)")
    if relu_grad_of is not None:
        check_tensor("relu_grad_of", relu_grad_of, ndim=2, dtypes=(a.dtype,), device=a.device)
        if tuple(relu_grad_of.shape) != (m, n):
            raise ValueError(f"relu_grad_of: shape {tuple(relu_grad_of.shape)}, expected ({m}, {n})")
        if bias is not None or activation is not None:
            raise ValueError("relu_grad_of: takes neither bias nor activation (it masks a gradient)")
    return m, n, k


def linear_cross_entropy_args(x, w, labels, bias, label_rows) -> tuple[int, int, int]:
    """M, N, K of the logits x @ w; every argument checked."""
    check_tensor("x", x, ndim=2, dtypes=FLOATS)
    check_tensor("w", w, ndim=2, dtypes=FLOATS, device=x.device)
    check_same_dtype(x=x, w=w)
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"w: {w.shape[0]} rows, expected {x.shape[1]} to match x {tuple(x.shape)}")
    m, n, k = matmul_args(x, w, bias, None, False, False, "fp32")
    check_tensor("labels", labels, ndim=1, dtypes=(torch.int64,), device=x.device)
    rows = check_rows("label_rows", label_rows, x.device) if label_rows is not None else labels.shape[0]
    if rows != m:
        what = "label_rows" if label_rows is not None else "labels"
        raise ValueError(f"{what}: {rows} rows, expected {m} to match x {tuple(x.shape)}")
    if n == 0 and m > 0:
        raise ValueError("w: has no classes (shape [K, 0])")
    return m, n, k


def check_block_holds_row(config: dict, n: int) -> None:
    """linear_cross_entropy's softmax needs every logit of a row in one tile."""
    if config["BLOCK_N"] < n:
        raise ValueError(f"config: linear_cross_entropy needs BLOCK_N >= N = {n} (one tile holds a whole "
                         f"row of logits), got BLOCK_N={config['BLOCK_N']}")


def linear_sgd_args(x, dy, w, bias, w_buf, b_buf, lr, momentum, weight_decay, x_rows, w_low, b_low):
    """(B, K_in, N_out, lr, momentum, weight_decay) of one layer's SGD step; every argument checked
    before anything is written."""
    lr, momentum, weight_decay = _real("lr", lr), _real("momentum", momentum), _real("weight_decay", weight_decay)
    check_tensor("x", x, ndim=2, dtypes=FLOATS)
    check_tensor("dy", dy, ndim=2, dtypes=(x.dtype,), device=x.device)
    b = check_rows("x_rows", x_rows, x.device) if x_rows is not None else x.shape[0]
    k_in, n_out = x.shape[1], dy.shape[1]
    if dy.shape[0] != b:
        raise ValueError(f"dy: {dy.shape[0]} rows, expected {b} (the batch of x{'[x_rows]' if x_rows is not None else ''})")
    for name, t, shape in (("w", w, (k_in, n_out)), ("bias", bias, (n_out,)),
                           ("w_buf", w_buf, (k_in, n_out)), ("b_buf", b_buf, (n_out,))):
        if t is None and name.endswith("_buf") and not momentum:
            continue
        if t is None:
            raise ValueError(f"{name}: required" + (" when momentum != 0" if name.endswith("_buf") else ""))
        check_tensor(name, t, dtypes=(torch.float32,), device=x.device)
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous float32 tensor of shape {shape}, got "
                             f"{tuple(t.shape)}" + ("" if t.is_contiguous() else " (not contiguous)"))
    for name, t, shape in (("w_low", w_low, (k_in, n_out)), ("b_low", b_low, (n_out,))):
        if t is not None:
            check_tensor(name, t, dtypes=(x.dtype,), device=x.device)
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor of shape {shape} in x's dtype")
    return b, k_in, n_out, lr, momentum, weight_decay


def relu_backward_args(grad, y) -> None:
    check_tensor("grad", grad, dtypes=FLOATS)
    check_tensor("y", y, dtypes=(grad.dtype,), device=grad.device)
    if y.shape != grad.shape:
        raise ValueError(f"y: shape {tuple(y.shape)} differs from grad's {tuple(grad.shape)}")


def bias_add_args(x, bias, activation) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOATS)
    check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_activation(activation)
    if bias.shape[0] != x.shape[1]:
        raise ValueError(f"bias: shape {tuple(bias.shape)}, expected ({x.shape[1]},) to match x {tuple(x.shape)}")


def softmax_cross_entropy_args(logits, labels) -> tuple[int, int]:
    """(rows, classes) of the logits."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOATS)
    check_tensor("labels", labels, ndim=1, dtypes=(torch.int64,), device=logits.device)
    rows, classes = logits.shape
    if labels.shape[0] != rows:
        raise ValueError(f"labels: shape {tuple(labels.shape)}, expected ({rows},) to match logits {tuple(logits.shape)}")
    if classes == 0 and rows > 0:
        raise ValueError("logits: has no classes (shape [M, 0])")
    return rows, classes


class LabelError(ValueError):
    """softmax_cross_entropy met a label outside [0, N); raised by check_labels."""


_label_flags: dict[tuple[str, int | None], torch.Tensor] = {}


def device_key(device: torch.device) -> tuple[str, int | None]:
    """One key per device for per-device buffers: "cuda" and "cuda:0" name the same GPU."""
    if device.type == "cuda" and device.index is None:
        return "cuda", torch.cuda.current_device()
    return device.type, device.index


def refuse_zeroed_allocation_in_capture(device: torch.device, what: str) -> None:
    """A buffer that must start zeroed cannot be made inside a CUDA graph capture: its zeroing
    would be recorded, not run, and calls before the first replay would read garbage."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: call it once on this device, with this shape, before capturing a "
                           "CUDA graph (that first call allocates zeroed scratch memory)")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# CUDA's grid: up to 2**31 - 1 blocks along x, 65535 along y and z.
GRID_LIMITS = (2**31 - 1, 65535, 65535)


def check_grid(what: str, grid: tuple[int, ...]) -> None:
    """Refuses, in one line, a launch whose grid CUDA cannot run (the driver's own error names no call)."""
    for axis, (blocks, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if blocks > limit:
            raise ValueError(f"{what}: the call needs {blocks} blocks along grid axis {'xyz'[axis]}, past CUDA's "
                             f"{limit}; it is too large for this kernel")


def label_flag(device: torch.device, what: str = "softmax_cross_entropy") -> torch.Tensor:
    """int64 [3] on `device`: zeros, or (1, a label, N) once softmax_cross_entropy
    met a label outside [0, N) there (rows racing to write it all write a bad
    label and the same N). Allocated on the first call and never freed, so a
    CUDA graph that captured a write to it keeps a valid pointer."""
    key = device_key(device)
    if key not in _label_flags:
        refuse_zeroed_allocation_in_capture(device, what)
        _label_flags[key] = torch.zeros(3, dtype=torch.int64, device=device)
    return _label_flags[key]


def check_labels(device: torch.device) -> None:
    """Raises LabelError if softmax_cross_entropy met a label outside [0, N) on
    `device` since the last check, and clears the flag. Reads the flag from
    the device: a sync, so call it where the caller waits anyway."""
    flag = _label_flags.get(device_key(device))
    if flag is None:
        return
    seen, label, classes = flag.tolist()
    if seen:
        flag.zero_()
        raise LabelError(f"labels: softmax_cross_entropy was given label {label}, outside [0, {classes}) "
                         "(its row's loss is NaN); every label must name one of the logits' columns")


def matrix_layout(t: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, bool, int]:
    """How to read op(t) (rows x cols) without a copy.

    Returns (tensor, cols_contiguous, leading_dim): `cols_contiguous` says the
    second index of op(t) is the unit-stride one. A view with no unit stride
    (e.g. every other column) is copied once: correct, and rare in practice.
    """
    s_rows, s_cols = (t.stride(1), t.stride(0)) if transposed else (t.stride(0), t.stride(1))
    rows, cols = (t.shape[1], t.shape[0]) if transposed else (t.shape[0], t.shape[1])
    if (s_rows == 0 and rows > 1) or (s_cols == 0 and cols > 1):  # expanded (broadcast) views
        return matrix_layout(t.contiguous(), transposed)
    if s_cols == 1 or cols == 1:
        return t, True, max(s_rows, 1) if rows > 1 else max(cols, 1)
    if s_rows == 1 or rows == 1:
        return t, False, max(s_cols, 1) if cols > 1 else max(rows, 1)
    t = t.contiguous()
    return matrix_layout(t, transposed)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    return float(value)


def check_sgd_args(params, grads, momentum_bufs, lr, momentum, weight_decay):
    """Checked (params, grads, bufs, lr, momentum, weight_decay) for sgd_update.

    `bufs[i]` is None when momentum is 0. Every tensor is checked before the
    caller touches any, so a bad list never half-applies a step. Params and
    buffers are updated in place, so they must be contiguous float32.
    """
    lr, momentum, weight_decay = _real("lr", lr), _real("momentum", momentum), _real("weight_decay", weight_decay)
    for name, seq in (("params", params), ("grads", grads)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{name}: expected a list of tensors, got {type(seq).__name__}")
    if len(grads) != len(params):
        raise ValueError(f"grads: {len(grads)} tensors for {len(params)} params")
    if momentum:
        if not isinstance(momentum_bufs, (list, tuple)) or len(momentum_bufs) != len(params):
            raise ValueError("momentum_bufs: momentum != 0 needs one float32 buffer per param")
        bufs = list(momentum_bufs)
    else:
        bufs = [None] * len(params)
    for i, (p, g, b) in enumerate(zip(params, grads, bufs)):
        check_tensor(f"params[{i}]", p, dtypes=(torch.float32,), device=params[0].device if i else None)
        if not p.is_contiguous():
            raise ValueError(f"params[{i}]: must be contiguous to be updated in place")
        check_tensor(f"grads[{i}]", g, dtypes=FLOATS, device=p.device)
        if g.shape != p.shape:
            raise ValueError(f"grads[{i}]: shape {tuple(g.shape)} differs from params[{i}]'s {tuple(p.shape)}")
        if b is not None:
            check_tensor(f"momentum_bufs[{i}]", b, dtypes=(torch.float32,), device=p.device)
            if b.shape != p.shape or not b.is_contiguous():
                raise ValueError(f"momentum_bufs[{i}]: expected a contiguous tensor of shape {tuple(p.shape)}")
    return list(params), list(grads), bufs, lr, momentum, weight_decay
