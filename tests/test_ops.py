"""Correctness of every op of both twins against the float64 references.

Each test draws fresh random inputs (see conftest.py for replaying a seed),
writes into outputs poisoned with NaN (so an element the kernel skipped
fails), and compares with `reference.exact` by relative error
||out - ref|| / ||ref||, or exactly where the op rounds only once.

Without a GPU only the Triton twin runs, in Triton's interpreter, on modest
shapes; with one, the `gpu`-marked tests add the CUDA twin and large shapes.
"""
import itertools
import math
import os
import random

import pytest
import torch

from kernels_core import contract
from kernels_core.space import Space
from kernels_core.reference import exact, native

DTYPES = list(contract.DTYPES)
TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2}
TRANSPOSES = list(itertools.product([False, True], repeat=2))
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------- helpers

def randn(rng, shape, dtype, device, scale=1.0):
    t = torch.randn(shape, generator=rng, dtype=torch.float64) * scale
    return t.to(device=device, dtype=contract.DTYPES[dtype] if isinstance(dtype, str) else dtype)


def poisoned(shape, dtype, device):
    dtype = contract.DTYPES[dtype] if isinstance(dtype, str) else dtype
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def laid_out(t, layout):
    """The same values as `t`, stored as `layout` asks."""
    if layout == "contiguous":
        return t
    if layout == "offset1":  # contiguous, but one element into its allocation
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view
    if layout == "strided":  # every other element of a wider buffer
        buf = torch.empty(t.shape + (2,), dtype=t.dtype, device=t.device)
        view = buf[..., 0]
        view.copy_(t)
        assert not view.is_contiguous() or t.numel() <= 1
        return view
    raise AssertionError(layout)


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_rel(out, ref, tol, what="out"):
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not out.isnan().any(), f"{what}: NaN in output (unwritten element?)"
    if ref.numel():
        err = rel_err(out, ref)
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def assert_column_sums(out, grad, what="out"):
    """Column sums of `grad` as an fp32 accumulation gets them: each column's
    error against float64 within 1e-6 of the sum of its terms' magnitudes (a
    column of cancelling terms has a tiny sum, so error relative to the sum
    itself measures the data, not the kernel; one dropped row breaks this)."""
    ref = exact.bias_grad(grad)
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == torch.float32 and not out.isnan().any(), f"{what}: {out.dtype}, NaN where unwritten?"
    scale = grad.double().abs().sum(0).cpu().clamp_min(1e-300)
    err = ((out.double().cpu() - ref.cpu()).abs() / scale).max().item() if ref.numel() else 0.0
    assert err <= 1e-6, f"{what}: column error {err:.3g} of the terms' magnitude > 1e-06"


def assert_sgd_close(params, bufs, start, grads_by_step, *, lr_by_step, momentum, weight_decay, what=""):
    """params (and momentum bufs) after the steps, element by element, against float64.

    Each step rounds at most six times per element in fp32 (g + wd*p, momentum*buf + d,
    p - lr*d: a product and a sum each; fewer with fused multiply-adds), and an error
    carried into the next step is scaled by momentum, lr or wd, all <= 1. So after s steps
    an element is off by at most 6*s*u times the magnitude of every term that reached it,
    u = 2**-24: the same recurrence run on absolute values with the update's sign flipped
    (p + lr*d) bounds those magnitudes. Relative to the result itself no fixed bound holds:
    a buffer whose terms cancel (0.81*g1 + 0.9*g2 + g3 near 0) has a tiny value and an
    ordinary rounding error. A wrong rule (a dropped term, lr applied twice, a bf16
    rounding of d) is off by far more than 6*s*u of the magnitude, and fails.
    """
    p0, b0 = start
    ref_p, ref_b = [p.double() for p in p0], [b.double() for b in b0] if momentum else None
    mag_p, mag_b = [p.double().abs() for p in p0], [b.double().abs() for b in b0] if momentum else None
    for grads, lr in zip(grads_by_step, lr_by_step):
        ref_p, new_b = exact.sgd_update(ref_p, grads, ref_b, lr=lr, momentum=momentum, weight_decay=weight_decay)
        mag_p, new_mag_b = exact.sgd_update(mag_p, [g.abs() for g in grads], mag_b, lr=-lr, momentum=momentum,
                                            weight_decay=weight_decay)
        ref_b, mag_b = (new_b, new_mag_b) if momentum else (None, None)
    bound = 6 * len(grads_by_step) * 2.0**-24
    pairs = [(f"params[{i}]", p, r, m) for i, (p, r, m) in enumerate(zip(params, ref_p, mag_p))]
    if momentum:
        pairs += [(f"momentum_bufs[{i}]", b, r, m) for i, (b, r, m) in enumerate(zip(bufs, ref_b, mag_b))]
    for name, out, ref, mag in pairs:
        assert not out.isnan().any(), f"{what}{name}: NaN (unwritten element?)"
        err = ((out.double().cpu() - ref.cpu()).abs() / mag.cpu().clamp_min(1e-300)).max().item() if out.numel() else 0
        assert err <= bound, f"{what}{name}: error {err:.3g} of the terms' magnitude > {bound:.3g}"


def assert_exact(out, ref, what="out"):
    """Equal to the float64 result rounded once to out's dtype (NaN where it is NaN).

    Triton's interpreter converts fp32 to bf16 by truncation, not rounding to
    nearest as the GPU does: there, bf16 results may be 1 ulp (2**-7 relative) off.
    """
    rtol = 2.0**-7 if INTERPRETED and out.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.cpu(), ref.to(out.dtype).cpu(), rtol=rtol, atol=0, equal_nan=True, msg=what)


def matmul_tol(dtype, k, accumulate="fp32"):
    if accumulate == "fp16":  # every partial sum rounds to fp16
        return 2e-3 + 1e-3 * math.sqrt(k)
    return TOL[dtype] * max(1.0, math.sqrt(k) / 16)


def matmul_operands(rng, m, n, k, dtype, device, trans_a, trans_b):
    a = randn(rng, (k, m) if trans_a else (m, k), dtype, device)
    b = randn(rng, (n, k) if trans_b else (k, n), dtype, device)
    return a, b


def check_matmul(ops, a, b, *, trans_a=False, trans_b=False, bias=None, activation=None, config=None,
                 accumulate="fp32"):
    m, n, k = contract.matmul_args(a, b, None, None, trans_a, trans_b, "fp32")
    out = poisoned((m, n), a.dtype, a.device)
    got = ops.matmul(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b, out=out,
                     config=config, accumulate=accumulate)
    assert got is out
    ref = exact.matmul(a, b, bias=bias, activation=activation, trans_a=trans_a, trans_b=trans_b)
    assert_rel(out, ref, matmul_tol(contract.dtype_name(a.dtype), k, accumulate))


def other_device(device):
    """A device the op must refuse to mix with `device`."""
    return "meta" if device == "cpu" else "cpu"


# ----------------------------------------------------------------------------- matmul

MATMUL_SHAPES = [(1, 1, 1), (7, 33, 127), (129, 64, 33), (200, 129, 200)]
MATMUL_GPU_SHAPES = [(1000, 1000, 1000), (1823, 781, 1000), (127, 1823, 784), (4096, 512, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
@pytest.mark.parametrize("m,n,k", MATMUL_SHAPES)
def test_matmul(ops, device, rng, m, n, k, trans_a, trans_b, dtype):
    a, b = matmul_operands(rng, m, n, k, dtype, device, trans_a, trans_b)
    check_matmul(ops, a, b, trans_a=trans_a, trans_b=trans_b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, True)])
def test_matmul_wide_ragged(ops, device, rng, trans_a, trans_b, dtype):
    a, b = matmul_operands(rng, 1823, 781, 9, dtype, device, trans_a, trans_b)
    check_matmul(ops, a, b, trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (781,), dtype, device),
                 activation="relu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
@pytest.mark.parametrize("m,n,k", MATMUL_GPU_SHAPES)
def test_matmul_large(ops, device, rng, m, n, k, trans_a, trans_b, dtype):
    a, b = matmul_operands(rng, m, n, k, dtype, device, trans_a, trans_b)
    check_matmul(ops, a, b, trans_a=trans_a, trans_b=trans_b, bias=randn(rng, (n,), dtype, device),
                 activation="relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("bias_kind", [None, "contiguous", "strided"])
def test_matmul_bias_activation(ops, device, rng, bias_kind, activation, dtype):
    m, n, k = 65, 47, 70
    a, b = matmul_operands(rng, m, n, k, dtype, device, False, False)
    bias = None if bias_kind is None else laid_out(randn(rng, (n,), dtype, device, scale=3.0), bias_kind)
    check_matmul(ops, a, b, bias=bias, activation=activation)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", ["column_slice", "offset1", "transposed", "no_unit_stride"])
def test_matmul_views(ops, device, rng, view, dtype):
    m, n, k = 37, 45, 29
    if view == "column_slice":  # rows longer than the view: leading dim > cols, storage offset 2
        a = randn(rng, (m, k + 5), dtype, device)[:, 2:2 + k]
        b = randn(rng, (k, n + 3), dtype, device)[:, 1:1 + n]
    elif view == "offset1":
        a = laid_out(randn(rng, (m, k), dtype, device), "offset1")
        b = laid_out(randn(rng, (k, n), dtype, device), "offset1")
    elif view == "transposed":  # column-major operands, no transpose flags
        a = randn(rng, (k, m), dtype, device).t()
        b = randn(rng, (n, k), dtype, device).t()
    else:
        a = randn(rng, (2 * m, 2 * k), dtype, device)[::2, ::2]
        b = randn(rng, (2 * k, 3 * n), dtype, device)[::2, ::3]
    check_matmul(ops, a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_out_view(ops, device, rng, dtype):
    """`out` may be a strided view; elements outside it stay untouched."""
    m, n, k = 33, 20, 17
    a, b = matmul_operands(rng, m, n, k, dtype, device, False, False)
    big = poisoned((m, n + 4), dtype, device)
    out = big[:, 2:2 + n]
    assert ops.matmul(a, b, out=out) is out
    assert_rel(out, exact.matmul(a, b), matmul_tol(dtype, k))
    assert big[:, :2].isnan().all() and big[:, 2 + n:].isnan().all(), "wrote outside out"


@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_only_runs_no_kernel_and_the_next_call_computes(ops, device, rng, dtype):
    """What the tuner's compile pool relies on (kernels_core.compile_only): inside it a call compiles
    its kernels and runs none, so what it would write stays as it was; the same call outside computes."""
    compile_only_then_compute(ops, device, rng, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_compile_only_on_the_gpu_compiles_through_warmup(device, rng, dtype):
    """The Triton twin's compiled path (JITFunction.warmup), which the interpreter does not take."""
    import kernels_triton

    compile_only_then_compute(kernels_triton, device, rng, dtype)


def compile_only_then_compute(ops, device, rng, dtype):
    from kernels_core.compile_only import compile_only

    m, n, k = 37, 45, 70
    a, b = matmul_operands(rng, m, n, k, dtype, device, False, True)
    x = randn(rng, (m, n), dtype, device)
    out, y = poisoned((m, n), dtype, device), poisoned((m, n), dtype, device)
    with compile_only():
        ops.matmul(a, b, trans_b=True, out=out)
        ops.relu(x, out=y)
    assert out.isnan().all() and y.isnan().all(), "a kernel ran"
    ops.matmul(a, b, trans_b=True, out=out)
    assert_rel(out, exact.matmul(a, b, trans_b=True), matmul_tol(dtype, k))
    assert torch.equal(ops.relu(x, out=y), native.relu(x))


@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (33, 129, 200)])
def test_matmul_accumulate_fp16(ops, device, rng, m, n, k):
    a, b = matmul_operands(rng, m, n, k, "fp16", device, False, False)
    check_matmul(ops, a, b, accumulate="fp16")
    check_matmul(ops, a, b, bias=randn(rng, (n,), "fp16", device), activation="relu", accumulate="fp16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_allocates(ops, device, rng, dtype):
    a, b = matmul_operands(rng, 9, 10, 11, dtype, device, False, True)
    c = ops.matmul(a, b, trans_b=True)
    assert c.dtype == a.dtype and c.device == a.device and tuple(c.shape) == (9, 10)
    assert_rel(c, exact.matmul(a, b, trans_b=True), matmul_tol(dtype, 11))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu"])
def test_matmul_nan_inf(ops, device, rng, activation, dtype):
    m, n, k = 20, 24, 16
    a = randn(rng, (m, k), dtype, device)
    b = randn(rng, (k, n), dtype, device).abs()
    a[3, 5] = float("nan")
    a[7] = a[7].abs()
    a[7, 2] = float("inf")  # row 7 of C: +inf everywhere (all terms >= 0)
    out = poisoned((m, n), dtype, device)
    ops.matmul(a, b, activation=activation, out=out)
    ref = exact.matmul(a, b, activation=activation)
    assert out[3].isnan().all(), "NaN in a row of A must give a NaN row (relu keeps NaN)"
    assert torch.equal(out.isinf().cpu(), ref.isinf().cpu())
    finite = ref.isfinite()
    assert not out[finite].isnan().any()
    assert rel_err(out[finite], ref[finite]) <= matmul_tol(dtype, k)


@pytest.mark.parametrize("m,n,k", [(0, 5, 3), (5, 0, 3), (0, 0, 0), (4, 6, 0)])
def test_matmul_empty(ops, device, rng, m, n, k):
    a, b = matmul_operands(rng, m, n, k, "fp32", device, False, False)
    bias = randn(rng, (n,), "fp32", device)
    out = poisoned((m, n), "fp32", device)
    ops.matmul(a, b, bias=bias, out=out)
    assert_rel(out, exact.matmul(a, b, bias=bias), 1e-6)  # K = 0: the bias alone


# ----------------------------------------------------------------------------- elementwise

SIZES = [1, 7, 33, 127, 129, 784, 1000, 4099]
LAYOUTS = ["contiguous", "offset1", "strided"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_relu(ops, device, rng, n, dtype, layout):
    x = laid_out(randn(rng, (n,), dtype, device), layout)
    out = laid_out(poisoned((n,), dtype, device), "offset1" if layout == "offset1" else "contiguous")
    assert ops.relu(x, out=out) is out
    assert_exact(out, exact.relu(x))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_relu_backward(ops, device, rng, n, dtype, layout):
    grad = laid_out(randn(rng, (n,), dtype, device), layout)
    y = torch.relu(randn(rng, (n,), dtype, device))  # exact zeros where the forward clipped
    y = laid_out(y, "offset1" if layout == "contiguous" else layout)
    out = poisoned((n,), dtype, device)
    assert ops.relu_backward(grad, y, out=out) is out
    assert_exact(out, exact.relu_backward(grad, y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_2d_and_allocates(ops, device, rng, dtype):
    x = randn(rng, (33, 65), dtype, device)
    y = ops.relu(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_exact(y, exact.relu(x))
    g = randn(rng, (33, 65), dtype, device)
    assert_exact(ops.relu_backward(g, y), exact.relu_backward(g, y))


@pytest.mark.parametrize("layout", ["contiguous", "offset1", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("m,n", [(1, 1), (7, 33), (129, 784), (33, 1000), (5, 4099)])
def test_bias_add(ops, device, rng, m, n, activation, dtype, layout):
    if layout == "transposed":
        x = randn(rng, (n, m), dtype, device).t()
    else:
        x = laid_out(randn(rng, (m, n), dtype, device), layout)
    bias = laid_out(randn(rng, (n,), dtype, device), "offset1" if layout == "offset1" else "contiguous")
    out = poisoned((m, n), dtype, device)
    assert ops.bias_add(x, bias, activation=activation, out=out) is out
    assert_exact(out, exact.bias_add(x, bias, activation=activation))


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_nan_inf(ops, device, dtype):
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, -1.0, 2.0],
                           dtype=contract.DTYPES[dtype], device=device)
    assert_exact(ops.relu(special), exact.relu(special), "relu")
    y = torch.tensor([1.0, 1.0, 1.0, 0.0, float("nan"), -1.0, float("inf")],
                     dtype=contract.DTYPES[dtype], device=device)
    assert_exact(ops.relu_backward(special, y), exact.relu_backward(special, y), "relu_backward")
    assert_exact(ops.relu_backward(special, y), native.relu_backward(special, y), "relu_backward vs torch")
    x = special.view(1, -1).repeat(3, 1)
    bias = torch.tensor([1.0, -float("inf"), 1.0, 0.0, float("nan"), 1.0, -2.0],
                        dtype=contract.DTYPES[dtype], device=device)
    for activation in (None, "relu"):
        assert_exact(ops.bias_add(x, bias, activation=activation), exact.bias_add(x, bias, activation=activation),
                     f"bias_add {activation}")


def test_elementwise_empty(ops, device):
    x = torch.empty(0, device=device)
    assert ops.relu(x).shape == (0,)
    assert ops.relu_backward(x, x).shape == (0,)
    for shape in [(0, 5), (5, 0)]:
        assert ops.bias_add(torch.empty(shape, device=device), torch.zeros(shape[1], device=device)).shape == shape


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_large(ops, device, rng, dtype):
    n = (1 << 24) + 3
    x = randn(rng, (n,), dtype, device)
    assert_exact(ops.relu(x), exact.relu(x))
    x2 = randn(rng, (4097, 4099), dtype, device)
    b = randn(rng, (4099,), dtype, device)
    assert_exact(ops.bias_add(x2, b, activation="relu"), exact.bias_add(x2, b, activation="relu"))


# ----------------------------------------------------------------------------- bias_grad

@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(1, 1), (7, 33), (1000, 10), (129, 784), (4099, 3), (0, 5), (5, 0)])
def test_bias_grad(ops, device, rng, m, n, dtype, layout):
    if layout == "transposed":
        grad = randn(rng, (n, m), dtype, device).t()
    else:
        grad = randn(rng, (m, n), dtype, device)
    out = poisoned((n,), torch.float32, device)
    assert ops.bias_grad(grad, out=out) is out
    assert_column_sums(out, grad)


@pytest.mark.slow  # 100,000 rows through the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_grad_tall(ops, device, rng, dtype):
    m = 100_000 if device == "cpu" else 1_000_000
    for n in (1, 3) if device == "cpu" else (1, 10, 4096):
        grad = randn(rng, (m if n < 4096 else 1 << 17, n), dtype, device)
        assert_column_sums(ops.bias_grad(grad), grad, f"n={n}")


# ----------------------------------------------------------------------------- softmax_cross_entropy

def check_softmax_ce(ops, logits, labels, config=None, grad_tol=None):
    m, c = logits.shape
    out_grad = poisoned((m, c), logits.dtype, logits.device)
    loss, grad = ops.softmax_cross_entropy(logits, labels, out_grad=out_grad, config=config)
    assert grad is out_grad
    assert loss.dtype == torch.float32 and loss.dim() == 0
    ref_loss, ref_grad = exact.softmax_cross_entropy(logits, labels)
    assert math.isfinite(loss.item())
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item())), \
        f"loss {loss.item()} != {ref_loss.item()}"
    assert_rel(grad, ref_grad, grad_tol or TOL[contract.dtype_name(logits.dtype)], "dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,c", [(1, 1), (7, 10), (33, 127), (64, 1000), (5, 3000)])
def test_softmax_cross_entropy(ops, device, rng, m, c, dtype):
    logits = randn(rng, (m, c), dtype, device, scale=3.0)
    labels = torch.randint(0, c, (m,), generator=rng).to(device)
    check_softmax_ce(ops, logits, labels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_cross_entropy_views(ops, device, rng, dtype):
    m, c = 9, 130
    logits = randn(rng, (c, m), dtype, device, scale=3.0).t()  # column-major
    labels = torch.randint(0, c, (m, 2), generator=rng).to(device)[:, 1]  # strided labels
    check_softmax_ce(ops, logits, labels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_cross_entropy_large_logits(ops, device, rng, dtype):
    m, c = 16, 50
    logits = randn(rng, (m, c), dtype, device, scale=1e4)
    labels = torch.randint(0, c, (m,), generator=rng).to(device)
    loss, grad = ops.softmax_cross_entropy(logits, labels)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    ref_loss, ref_grad = exact.softmax_cross_entropy(logits, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()) + 1e-3
    assert (grad.double().cpu() - ref_grad.cpu()).abs().max() <= 1e-2 / m


def test_softmax_cross_entropy_nan(ops, device, rng):
    logits = randn(rng, (4, 10), "fp32", device)
    logits[2, 3] = float("nan")
    labels = torch.tensor([0, 1, 2, 3], device=device)
    loss, grad = ops.softmax_cross_entropy(logits, labels)
    assert loss.isnan(), "a NaN logit must make the mean loss NaN"
    assert grad[2].isnan().all() and not grad[[0, 1, 3]].isnan().any()


def test_softmax_cross_entropy_empty(ops, device):
    loss, grad = ops.softmax_cross_entropy(torch.empty(0, 10, device=device),
                                           torch.empty(0, dtype=torch.int64, device=device))
    assert loss.isnan() and grad.shape == (0, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_cross_entropy_large(ops, device, rng, dtype):
    for m, c in [(4096, 10), (512, 32000)]:
        logits = randn(rng, (m, c), dtype, device, scale=3.0)
        labels = torch.randint(0, c, (m,), generator=rng).to(device)
        check_softmax_ce(ops, logits, labels)


# ----------------------------------------------------------------------------- sgd_update

SGD_HYPERS = [(0.0, 0.0), (0.9, 0.0), (0.0, 1e-2), (0.9, 1e-2)]


def sgd_problem(rng, device, grad_dtype, momentum, steps=3):
    """Params of awkward sizes and layouts (one element, misaligned, strided grads), their
    buffers and `steps` steps of fresh grads under an lr schedule."""
    shapes = [(7,), (33, 5), (1000,), (4099,), (1,)]
    params = [randn(rng, s, "fp32", device) for s in shapes]
    params[1] = laid_out(params[1], "offset1")  # contiguous, misaligned
    bufs = [randn(rng, s, "fp32", device) for s in shapes] if momentum else None
    grads_by_step = []
    for _ in range(steps):
        grads = [randn(rng, s, grad_dtype, device) for s in shapes]
        grads[2] = laid_out(grads[2], "offset1")
        grads[3] = laid_out(grads[3], "strided")
        grads_by_step.append(grads)
    lrs = [0.1 / (step + 1) for step in range(steps)]  # a schedule: lr changes between steps
    return params, bufs, grads_by_step, lrs


@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("momentum,weight_decay", SGD_HYPERS)
def test_sgd_update(ops, device, rng, momentum, weight_decay, grad_dtype):
    params, bufs, grads_by_step, lrs = sgd_problem(rng, device, grad_dtype, momentum)
    start = ([p.clone() for p in params], [b.clone() for b in bufs] if momentum else None)
    for grads, lr in zip(grads_by_step, lrs):
        ops.sgd_update(params, grads, bufs, lr=lr, momentum=momentum, weight_decay=weight_decay)
    assert_sgd_close(params, bufs, start, grads_by_step, lr_by_step=lrs, momentum=momentum,
                     weight_decay=weight_decay)


WRONG_SGD = {
    "lr applied twice": lambda p, b, g, lr, m, wd: (p - 2 * lr * (m * b + g + wd * p), m * b + g + wd * p),
    "weight decay dropped": lambda p, b, g, lr, m, wd: (p - lr * (m * b + g), m * b + g),
    "buffer not kept": lambda p, b, g, lr, m, wd: (p - lr * (m * b + g + wd * p), b),
    "d rounded to bf16": lambda p, b, g, lr, m, wd: (
        p - lr * (m * b + g + wd * p).bfloat16().float(), (m * b + g + wd * p).bfloat16().float()),
}


@pytest.mark.parametrize("wrong", WRONG_SGD)
def test_sgd_check_fails_a_wrong_update(rng, wrong):
    """The bound of assert_sgd_close is tight enough to reject each of these rules."""
    params, bufs, grads_by_step, lrs = sgd_problem(rng, "cpu", "fp32", 0.9)
    start = ([p.clone() for p in params], [b.clone() for b in bufs])
    for grads, lr in zip(grads_by_step, lrs):
        for i, g in enumerate(grads):
            params[i], bufs[i] = WRONG_SGD[wrong](params[i], bufs[i], g.float(), lr, 0.9, 1e-2)
    with pytest.raises(AssertionError, match="magnitude"):
        assert_sgd_close(params, bufs, start, grads_by_step, lr_by_step=lrs, momentum=0.9, weight_decay=1e-2)


def test_sgd_update_special(ops, device):
    """weight_decay = 0 skips the term (inf params stay inf); NaN grads propagate; empty params pass."""
    p = torch.tensor([float("inf"), 1.0, 2.0], device=device)
    g = torch.tensor([0.0, float("nan"), 1.0], device=device)
    empty = torch.empty(0, device=device)
    ops.sgd_update([p, empty], [g, empty.clone()], None, lr=0.5)
    assert p[0].item() == float("inf") and p[1].isnan() and p[2].item() == 1.5


# ----------------------------------------------------------------------------- fused ops' checkers (test_fused.py)

# Unit roundoff of each dtype. Triton's interpreter converts fp32 to bf16 by
# truncation: an error up to a whole ulp, 2**-7 relative.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
U32 = UNIT_ROUNDOFF["fp32"]


def unit_roundoff(dtype: torch.dtype) -> float:
    name = contract.dtype_name(dtype)
    return 2.0**-7 if INTERPRETED and name == "bf16" else UNIT_ROUNDOFF[name]


def picked_labels(labels, label_rows):
    """labels[label_rows] as the contract reads it: an index outside labels reads 0 (a row of zeros)."""
    if label_rows is None:
        return labels
    inside = (label_rows >= 0) & (label_rows < labels.shape[0])
    return torch.where(inside, labels[torch.where(inside, label_rows, 0)], 0)


def assert_linear_ce_close(loss, grad, x, w, labels, *, bias=None, what=""):
    """linear_cross_entropy's (loss, dlogits) against exact.linear_cross_entropy, within a bound
    derived from the arithmetic; `labels` are the rows' labels (after label_rows). A label outside
    [0, N) must give a NaN loss and the row softmax / M.

    The kernel's logits differ from the reference's (the float64 product rounded once to x's
    dtype) in two ways. Its fp32 sum of the K products and the bias: any order and any split
    rounds each term through at most K additions (plus the product's own rounding in fp32), so
    it is off by at most (K + 1) * u32 of S = |x| @ |w| + |bias|, twice that for an accumulator
    that truncates (tensor cores); 2 * (K + 2) * u32 * S absorbs the second-order terms too, and
    12 * u32 * S more the products of an fp32 config in 3xTF32 (TF32 = 3: each off by at most
    3 * 2^-22 of its magnitude, kernels_triton/matmul.py). Its
    rounding to x's dtype may then land on the other neighbour: per logit the two differ by at
    most E = 2 * u * |z| + 2 * 2 * (K + 2) * u32 * S (u of x's dtype). Moving each logit of a row by
    at most E_j moves logsumexp by at most L = exp(2 max E) * sum_j p_j E_j (the softmax between
    the two points is within exp(2 max E) of p), so a row's loss by L + E_label, and
    p_j by p_j * (exp(E_j + L) - 1). On top: fp32 exp, log and sums, within 1e-5 relative (as
    check_softmax_ce allows), and dlogits' rounding to x's dtype: u relative, or one subnormal
    step where fp16's range ends (a p of 1e-3 over M = 37 is below its smallest normal). A wrong
    result (a dropped bias, a wrong label, the mean over N, a missing 1/M) is off by far more;
    see test_fused.py::test_linear_ce_check_fails_a_wrong_result.
    """
    m, n = x.shape[0], w.shape[1]
    assert loss.dtype == torch.float32 and loss.dim() == 0, f"{what}loss: {loss.dtype}, shape {tuple(loss.shape)}"
    assert tuple(grad.shape) == (m, n) and grad.dtype == x.dtype, f"{what}dlogits: {grad.dtype} {tuple(grad.shape)}"
    labels = labels.cpu()
    bad = (labels < 0) | (labels >= n)
    safe = torch.where(bad, 0, labels)
    ref_loss, ref_grad = exact.linear_cross_entropy(x.cpu(), w.cpu(), safe, bias=None if bias is None else bias.cpu())
    onehot = torch.nn.functional.one_hot(safe, n).double() * (~bad).double()[:, None]
    ref_grad = ref_grad.cpu() + (torch.nn.functional.one_hot(safe, n).double() - onehot) / m  # bad rows: softmax / M
    p = ref_grad * m + onehot
    u = unit_roundoff(x.dtype)
    z = exact.matmul(x.cpu(), w.cpu(), bias=None if bias is None else bias.cpu())
    s = exact.matmul(x.cpu().abs(), w.cpu().abs(), bias=None if bias is None else bias.cpu().abs())
    e = 2 * u * z.abs() + (4 * (x.shape[1] + 2) + 12) * U32 * s
    lse_err = torch.exp(2 * e.max(1).values) * (p * e).sum(1)
    if bad.any():
        assert loss.isnan(), f"{what}loss: {loss.item()}, expected NaN (labels outside [0, {n}))"
    else:
        loss_tol = (lse_err + (onehot * e).sum(1)).mean().item() + 1e-5 * max(1.0, abs(ref_loss.item()))
        assert abs(loss.item() - ref_loss.item()) <= loss_tol, \
            f"{what}loss {loss.item()} != {ref_loss.item()} (bound {loss_tol:.3g})"
    prob_err = p * torch.expm1(e + lse_err[:, None]) + 1e-5 * (p + onehot)
    subnormal_step = torch.finfo(x.dtype).tiny * torch.finfo(x.dtype).eps  # fp16 dlogits of small p are subnormal
    grad_tol = (1 + u) * prob_err / m + u * ref_grad.abs() + subnormal_step
    assert not grad.isnan().any(), f"{what}dlogits: NaN (unwritten element?)"
    if grad.numel():
        ratio = ((grad.double().cpu() - ref_grad).abs() / grad_tol.clamp_min(1e-300)).max().item()
        assert ratio <= 1, f"{what}dlogits: error {ratio:.3g} times its bound"


def check_linear_ce(ops, x, w, labels, *, bias=None, label_rows=None, config=None, what=""):
    m, n = x.shape[0], w.shape[1]
    out_grad = poisoned((m, n), x.dtype, x.device)
    loss, grad = ops.linear_cross_entropy(x, w, labels, bias=bias, label_rows=label_rows, out_grad=out_grad,
                                          config=config)
    assert grad is out_grad
    assert_linear_ce_close(loss, grad, x, w, picked_labels(labels, label_rows), bias=bias,
                           what=f"{what}config={config}: ")
    return loss, grad


def assert_linear_sgd_close(w, bias, w_buf, b_buf, start, x, dy, *, lr, momentum, weight_decay, x_rows=None,
                            what=""):
    """linear_sgd's w, bias (and buffers) against exact.linear_sgd from `start` (w, bias, w_buf,
    b_buf before the call), element by element.

    assert_sgd_close's bound for one step, 6 * u32 of the magnitude of every term that reached
    the element, plus the gradients the kernel computes itself: gw = x[x_rows]^T @ dy and gb =
    sum of dy over the batch of B rows, fp32 sums that are off by at most (B + 1) * u32 of the
    sum of their terms' magnitudes (|x|^T @ |dy|, sum |dy|; any order, products rounded in fp32),
    twice that for an accumulator that truncates, and 12 * u32 more in 3xTF32 (as in
    assert_linear_ce_close). That error reaches w scaled by lr and the buffer unscaled, and the
    magnitudes (the same reference run on absolute values with the update's sign flipped, as in
    assert_sgd_close) hold lr and 1 times those term sums: so every element is within
    (6 + 2 * (B + 1) + 12) * u32 of its magnitude. A wrong rule, a gradient from the
    wrong rows or rounded to x's dtype is off by far more (test_linear_sgd_check_fails_a_wrong_update).
    """
    w0, b0, wb0, bb0 = (None if t is None else t.cpu() for t in start)
    x, dy = x.cpu(), dy.cpu()
    rows = None if x_rows is None else x_rows.cpu()
    kw = dict(momentum=momentum, weight_decay=weight_decay, x_rows=rows)
    (ref_w, ref_b), ref_bufs = exact.linear_sgd(x, dy, w0, b0, wb0, bb0, lr=lr, **kw)
    (mag_w, mag_b), mag_bufs = exact.linear_sgd(
        x.abs(), dy.abs(), w0.abs(), b0.abs(), None if wb0 is None else wb0.abs(), None if bb0 is None else bb0.abs(),
        lr=-lr, **kw)
    batch = dy.shape[0]
    bound = (6 + 2 * (batch + 1) + 12) * U32
    pairs = [("w", w, ref_w, mag_w), ("bias", bias, ref_b, mag_b)]
    if momentum:
        pairs += [("w_buf", w_buf, ref_bufs[0], mag_bufs[0]), ("b_buf", b_buf, ref_bufs[1], mag_bufs[1])]
    for name, out, ref, mag in pairs:
        assert not out.isnan().any(), f"{what}{name}: NaN"
        err = ((out.double().cpu() - ref).abs() / mag.clamp_min(1e-300)).max().item() if out.numel() else 0.0
        assert err <= bound, f"{what}{name}: error {err:.3g} of the terms' magnitude > {bound:.3g}"


def sgd_layer(rng, device, dtype, batch, k_in, n_out, *, momentum, rows=None, low=False):
    """x (the dataset when `rows` is given), dy, w, bias, w_buf, b_buf, x_rows, w_low, b_low of one
    layer's step; x_rows has indices outside x (rows of zeros) among its draws."""
    x = randn(rng, (rows or batch, k_in), dtype, device)
    x_rows = None
    if rows is not None:
        x_rows = torch.randint(-2, rows + 2, (batch,), generator=rng).to(device)
    dy = randn(rng, (batch, n_out), dtype, device)
    w, bias = randn(rng, (k_in, n_out), "fp32", device), randn(rng, (n_out,), "fp32", device)
    w_buf = randn(rng, (k_in, n_out), "fp32", device) if momentum else None
    b_buf = randn(rng, (n_out,), "fp32", device) if momentum else None
    w_low = poisoned((k_in, n_out), dtype, device) if low else None
    b_low = poisoned((n_out,), dtype, device) if low else None
    return x, dy, w, bias, w_buf, b_buf, x_rows, w_low, b_low


def check_linear_sgd(ops, layer, *, lr=0.1, momentum=0.0, weight_decay=0.0, config=None, what=""):
    x, dy, w, bias, w_buf, b_buf, x_rows, w_low, b_low = layer
    start = tuple(None if t is None else t.clone() for t in (w, bias, w_buf, b_buf))
    assert ops.linear_sgd(x, dy, w, bias, w_buf, b_buf, lr=lr, momentum=momentum, weight_decay=weight_decay,
                          x_rows=x_rows, w_low=w_low, b_low=b_low, config=config) is None
    assert_linear_sgd_close(w, bias, w_buf, b_buf, start, x, dy, lr=lr, momentum=momentum,
                            weight_decay=weight_decay, x_rows=x_rows, what=f"{what}config={config}: ")
    for name, low, p in (("w_low", w_low, w), ("b_low", b_low, bias)):
        if low is not None:  # the updated fp32 values, rounded once
            assert_exact(low, p, name)


# ----------------------------------------------------------------------------- argument errors

def bad_calls(ops, device):
    """(argument that must be named, call) pairs; each call is invalid in one way."""
    f32 = dict(dtype=torch.float32, device=device)
    x = torch.ones(4, 6, **f32)
    b = torch.ones(6, 5, **f32)
    h = torch.ones(6, 5, dtype=torch.float16, device=device)
    odd = torch.ones(6, 5, device=other_device(device))
    labels = torch.zeros(4, dtype=torch.int64, device=device)
    p, g = torch.ones(3, **f32), torch.ones(3, **f32)
    dy, w, wb = torch.ones(4, 5, **f32), torch.ones(6, 5, **f32), torch.ones(5, **f32)  # a layer's step on x
    return [
        ("a", lambda: ops.matmul("not a tensor", b)),
        ("a", lambda: ops.matmul(torch.ones(6, **f32), b)),
        ("b", lambda: ops.matmul(x, h)),
        ("b", lambda: ops.matmul(x, torch.ones(5, 5, **f32))),
        ("b", lambda: ops.matmul(x, odd)),
        ("b", lambda: ops.matmul(x, b, trans_b=True)),
        ("bias", lambda: ops.matmul(x, b, bias=torch.ones(6, **f32))),
        ("bias", lambda: ops.matmul(x, b, bias=torch.ones(5, dtype=torch.float16, device=device))),
        ("out", lambda: ops.matmul(x, b, out=torch.empty(4, 6, **f32))),
        ("out", lambda: ops.matmul(x, b, out=torch.empty(4, 5, dtype=torch.float16, device=device))),
        ("activation", lambda: ops.matmul(x, b, activation="gelu")),
        ("accumulate", lambda: ops.matmul(x, b, accumulate="fp16")),
        ("accumulate", lambda: ops.matmul(x, b, accumulate="int8")),
        ("x", lambda: ops.relu(torch.ones(3, dtype=torch.int32, device=device))),
        ("out", lambda: ops.relu(x, out=torch.empty(4, 5, **f32))),
        ("out", lambda: ops.relu(x, out=torch.empty(4, 6, dtype=torch.float16, device=device))),
        ("y", lambda: ops.relu_backward(x, torch.ones(4, 5, **f32))),
        ("y", lambda: ops.relu_backward(x, x.half())),
        ("x", lambda: ops.bias_add(torch.ones(6, **f32), torch.ones(6, **f32))),
        ("bias", lambda: ops.bias_add(x, torch.ones(5, **f32))),
        ("bias", lambda: ops.bias_add(x, torch.ones(6, dtype=torch.float16, device=device))),
        ("activation", lambda: ops.bias_add(x, torch.ones(6, **f32), activation="tanh")),
        ("grad", lambda: ops.bias_grad(torch.ones(6, **f32))),
        ("out", lambda: ops.bias_grad(x, out=torch.empty(6, dtype=torch.float16, device=device))),
        ("out", lambda: ops.bias_grad(x, out=torch.empty(5, **f32))),
        ("logits", lambda: ops.softmax_cross_entropy(torch.ones(4, **f32), labels)),
        ("labels", lambda: ops.softmax_cross_entropy(x, labels.int())),
        ("labels", lambda: ops.softmax_cross_entropy(x, labels[:3])),
        ("labels", lambda: ops.softmax_cross_entropy(x, torch.zeros(4, dtype=torch.int64,
                                                                     device=other_device(device)))),
        ("out_grad", lambda: ops.softmax_cross_entropy(x, labels, out_grad=torch.empty(4, 5, **f32))),
        ("params[0]", lambda: ops.sgd_update([p.half()], [g], None, lr=0.1)),
        ("grads", lambda: ops.sgd_update([p], [g, g], None, lr=0.1)),
        ("grads[0]", lambda: ops.sgd_update([p], [torch.ones(4, **f32)], None, lr=0.1)),
        ("momentum_bufs", lambda: ops.sgd_update([p], [g], None, lr=0.1, momentum=0.9)),
        ("lr", lambda: ops.sgd_update([p], [g], None, lr="0.1")),
        ("a_rows", lambda: ops.matmul(x, b, a_rows=labels.int())),
        ("a_rows", lambda: ops.matmul(x, b, a_rows=labels.view(2, 2))),
        ("a_rows", lambda: ops.matmul(x, b, a_rows=torch.zeros(8, dtype=torch.int64, device=device)[::2])),
        ("b", lambda: ops.matmul(x, b, trans_a=True, a_rows=labels)),  # op(a) is 6x4: K = 4 rows of b, not 6
        ("relu_grad_of", lambda: ops.matmul(x, b, relu_grad_of=torch.ones(5, 4, **f32))),
        ("relu_grad_of", lambda: ops.matmul(x, b, relu_grad_of=h[:4])),
        ("relu_grad_of", lambda: ops.matmul(x, b, relu_grad_of=x[:, :5], bias=torch.ones(5, **f32))),
        ("relu_grad_of", lambda: ops.matmul(x, b, relu_grad_of=x[:, :5], activation="relu")),
        ("x", lambda: ops.linear_cross_entropy(torch.ones(4, **f32), b, labels)),
        ("w", lambda: ops.linear_cross_entropy(x, b.half(), labels)),
        ("w", lambda: ops.linear_cross_entropy(x, b[:5], labels)),
        ("labels", lambda: ops.linear_cross_entropy(x, b, labels[:3])),
        ("labels", lambda: ops.linear_cross_entropy(x, b, labels.int())),
        ("label_rows", lambda: ops.linear_cross_entropy(x, b, labels, label_rows=labels[:3])),
        ("label_rows", lambda: ops.linear_cross_entropy(x, b, labels, label_rows=labels.int())),
        ("bias", lambda: ops.linear_cross_entropy(x, b, labels, bias=torch.ones(6, **f32))),
        ("out_grad", lambda: ops.linear_cross_entropy(x, b, labels, out_grad=torch.empty(4, 6, **f32))),
        ("out_grad", lambda: ops.linear_cross_entropy(x, b, labels, out_grad=h[:4])),
        ("dy", lambda: ops.linear_sgd(x, torch.ones(3, 5, **f32), w, wb, None, None, lr=0.1)),
        ("dy", lambda: ops.linear_sgd(x, h[:4], w, wb, None, None, lr=0.1)),
        ("w", lambda: ops.linear_sgd(x, dy, w.t(), wb, None, None, lr=0.1)),
        ("w", lambda: ops.linear_sgd(x, dy, w.half(), wb, None, None, lr=0.1)),
        ("bias", lambda: ops.linear_sgd(x, dy, w, torch.ones(6, **f32), None, None, lr=0.1)),
        ("w_buf", lambda: ops.linear_sgd(x, dy, w, wb, None, None, lr=0.1, momentum=0.9)),
        ("b_buf", lambda: ops.linear_sgd(x, dy, w, wb, w.clone(), torch.ones(4, **f32), lr=0.1, momentum=0.9)),
        ("x_rows", lambda: ops.linear_sgd(x, dy, w, wb, None, None, lr=0.1, x_rows=labels.int())),
        ("dy", lambda: ops.linear_sgd(x, dy, w, wb, None, None, lr=0.1, x_rows=labels[:3])),
        ("w_low", lambda: ops.linear_sgd(x, dy, w, wb, None, None, lr=0.1, w_low=h)),
        ("b_low", lambda: ops.linear_sgd(x, dy, w, wb, None, None, lr=0.1, b_low=torch.ones(4, **f32))),
        ("lr", lambda: ops.linear_sgd(x, dy, w, wb, None, None, lr=None)),
        ("momentum", lambda: ops.linear_sgd(x, dy, w, wb, None, None, lr=0.1, momentum="0.9")),
    ]


def misnamed_errors(ops, device) -> list[str]:
    """The bad calls that raise no error, or one that does not name the bad argument."""
    failures = []
    for i, (name, call) in enumerate(bad_calls(ops, device)):
        try:
            call()
        except (ValueError, TypeError) as e:
            if name not in str(e):
                failures.append(f"case {i}: error does not name {name!r}: {e}")
        else:
            failures.append(f"case {i}: no error (expected one naming {name!r})")
    return failures


def test_bad_arguments_name_the_argument(ops, device):
    failures = misnamed_errors(ops, device)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- configs

def small_problem(op, dtype, device, rng):
    """A call of `op` on a small random problem, and a check of its result."""
    dt = contract.DTYPES[dtype]
    if op == "matmul":  # K a multiple of 8, so the TMA of the wgmma kernel (sampled on sm_90) reads a and b
        a, b = matmul_operands(rng, 70, 50, 96, dtype, device, False, True)
        bias = randn(rng, (50,), dtype, device)
        return lambda ops, cfg: check_matmul(ops, a, b, trans_b=True, bias=bias, activation="relu", config=cfg)
    if op in ("relu", "relu_backward"):
        x, y = randn(rng, (3001,), dtype, device), randn(rng, (3001,), dtype, device)
        if op == "relu":
            return lambda ops, cfg: assert_exact(ops.relu(x, out=poisoned((3001,), dt, device), config=cfg),
                                                 exact.relu(x))
        return lambda ops, cfg: assert_exact(ops.relu_backward(x, y, out=poisoned((3001,), dt, device), config=cfg),
                                             exact.relu_backward(x, y))
    if op == "bias_add":
        x, b = randn(rng, (37, 300), dtype, device), randn(rng, (300,), dtype, device)
        return lambda ops, cfg: assert_exact(
            ops.bias_add(x, b, activation="relu", out=poisoned((37, 300), dt, device), config=cfg),
            exact.bias_add(x, b, activation="relu"))
    if op == "bias_grad":
        g = randn(rng, (3000, 70), dtype, device)
        return lambda ops, cfg: assert_column_sums(ops.bias_grad(g, config=cfg), g)
    if op == "softmax_cross_entropy":
        z = randn(rng, (6, 1500), dtype, device, scale=3.0)
        labels = torch.randint(0, 1500, (6,), generator=rng).to(device)
        return lambda ops, cfg: check_softmax_ce(ops, z, labels, config=cfg)
    if op == "linear_cross_entropy":  # N = 10 fits every BLOCK_N of a space
        x, w = randn(rng, (37, 45), dtype, device), randn(rng, (45, 10), dtype, device, scale=2 / math.sqrt(45))
        bias = randn(rng, (10,), dtype, device)
        labels = torch.randint(0, 10, (60,), generator=rng).to(device)
        label_rows = torch.randint(0, 60, (37,), generator=rng).to(device)
        return lambda ops, cfg: check_linear_ce(ops, x, w, labels, bias=bias, label_rows=label_rows, config=cfg)
    if op == "linear_sgd":
        return lambda ops, cfg: check_linear_sgd(
            ops, sgd_layer(rng, device, dtype, 40, 37, 20, momentum=0.9, rows=50, low=True),
            momentum=0.9, weight_decay=0.01, config=cfg)

    def run_sgd(ops, cfg):
        p = randn(rng, (3001,), "fp32", device)
        g = randn(rng, (3001,), dtype, device)
        buf = randn(rng, (3001,), "fp32", device)
        start = ([p.clone()], [buf.clone()])
        ops.sgd_update([p], [g], [buf], lr=0.1, momentum=0.9, weight_decay=0.01, config=cfg)
        assert_sgd_close([p], [buf], start, [[g]], lr_by_step=[0.1], momentum=0.9, weight_decay=0.01)
    return run_sgd


def fits_here(sp, cfg, elt, device):
    if device != "cuda":
        return True
    props = torch.cuda.get_device_properties(0)
    limit = getattr(props, "shared_memory_per_block_optin", 48 * 1024)
    return sp.cost(cfg, elt, props.major * 10 + props.minor)["smem_bytes"] <= limit


def local_arch(device):
    if device != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", contract.OPS)
def test_sampled_configs(ops, device, rng, op, dtype):
    """The default and a deterministic sample of other configs at the dtype's precision compute the
    same op (lower precisions have tests of their own)."""
    sp = ops.space(op, dtype)
    elt = contract.DTYPES[dtype].itemsize
    arch = local_arch(device)
    configs = [c for c in sp.configs(elt, arch) if fits_here(sp, c, elt, device) and sp.precision_of(c) is None]
    assert configs, "no config of the space fits this device"
    sample = random.Random(f"{op}/{dtype}").sample(configs, min(3, len(configs)))
    check = small_problem(op, dtype, device, rng)
    check(ops, None)
    for cfg in sample:
        check(ops, cfg)


@pytest.mark.parametrize("op", contract.OPS)
def test_config_errors(ops, device, rng, op):
    """A config outside the space is refused before launch, naming `config`."""
    sp = ops.space(op, "fp32")
    assert sp.violated(sp.default_for(local_arch(device)), 4, local_arch(device)) is None, "the default breaks its own space"
    name = next(iter(sp.params))
    bad = [
        {"NOT_A_TUNABLE": 1},
        {name: max(sp.params[name]) + 1},
        {name: float(sp.default[name])},
        {name: True},
        [(name, sp.default[name])],
    ]
    names = list(sp.params)
    for values in itertools.product(*(sp.params[n] for n in names)):  # one that breaks a restriction
        cfg = dict(zip(names, values))
        if (sp.violated(cfg, 4, local_arch(device)) or "").startswith("restriction"):
            bad.append(cfg)
            break
    call = small_problem(op, "fp32", device, rng)
    for cfg in bad:
        with pytest.raises((ValueError, TypeError), match="config"):
            call(ops, cfg)


def test_space_shape(ops):
    """Every op has a space per dtype whose default is valid and whose size stays tunable."""
    for op in contract.OPS:
        for dtype in DTYPES:
            sp = ops.space(op, dtype)
            assert isinstance(sp, Space)
            configs = list(sp.configs(contract.DTYPES[dtype].itemsize, 90))
            assert sp.default in configs, f"{op}/{dtype}: default {sp.default} fails its own restrictions"
            # The default sampler proposes valid, unmeasured configs only (autotune.samplers: tpe-valid),
            # so a space may pass 1000 configs; the CUDA fp32 matmul's 10654 is the largest: 8422 on the
            # SIMT kernel (its thread tiles of 2 are valid wherever the warp rules allow, and it has four
            # pipelines: kernels_cuda/matmul.py says why) and 1116 on the tensor cores per TF32 value.
            assert 1 <= len(configs) <= 11000, f"{op}/{dtype}: {len(configs)} configs"
    with pytest.raises(ValueError, match="op"):
        ops.space("conv2d", "fp32")
    with pytest.raises(ValueError, match="dtype"):
        ops.space("relu", "fp64")
