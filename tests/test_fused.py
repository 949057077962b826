"""The fused training step's paths in both twins: matmul's row gathers (a_rows)
and ReLU-gradient mask (relu_grad_of), linear_cross_entropy and linear_sgd.

Inputs are fresh random draws (conftest.py says how to replay a seed) with
ragged shapes, indices outside the gathered tensor among them, outputs poisoned
with NaN; results are compared with `reference.exact` within bounds derived in
tests/test_ops.py (assert_linear_ce_close, assert_linear_sgd_close; matmuls
within test_splitk.py's `tolerance`). Configs come from each twin's own spaces,
small tiles first, so that a problem of a few dozen rows spans several tiles.
Under Triton's interpreter programs run one after another: racing arrivals and
CUDA-graph replay are what the `gpu` tests add on a device.
"""
import pytest
import torch

from kernels_core import contract
from kernels_core.reference import exact
from tests.test_ops import (SGD_HYPERS, assert_exact, assert_linear_ce_close, assert_linear_sgd_close,
                            assert_rel, check_linear_ce, check_linear_sgd, picked_labels, poisoned, randn,
                            sgd_layer)
from tests.test_splitk import K_CASES, counters_are_zero, tolerance

DTYPES = list(contract.DTYPES)


def pick(ops, op, dtype, device, rng, *, split_k=1, min_block_n=16, max_block_n=256, tf32=None, gathers=False):
    """A config of the twin's `op` space with this SPLIT_K and min_block_n <= BLOCK_N <= max_block_n,
    drawn from the smallest such tiles: at its dtype's precision, or with TF32 = `tf32` (fp32);
    with `gathers`, one whose kernel reads gathered rows (a_rows: not the operands split ahead)."""
    sp = ops.space(op, dtype)
    arch = contract.device_arch(torch.device(device))
    precision = (lambda c: sp.precision_of(c) is None) if tf32 is None else (lambda c: c["TF32"] == tf32)
    configs = [c for c in sp.configs(contract.DTYPES[dtype].itemsize, arch)
               if c["SPLIT_K"] == split_k and min_block_n <= c["BLOCK_N"] <= max_block_n and precision(c)
               and not (gathers and (c.get("SPLIT_AHEAD") or c.get("WGMMA")))]
    assert configs, f"{op}/{dtype}: no config with SPLIT_K={split_k}, BLOCK_N in [{min_block_n}, {max_block_n}]"
    smallest = min(c["BLOCK_M"] * c["BLOCK_N"] for c in configs)
    small = [c for c in configs if c["BLOCK_M"] * c["BLOCK_N"] <= max(smallest, 32 * 32)]
    return small[torch.randint(len(small), (1,), generator=rng).item()]


def with_outside(rng, n, limit, device):
    """n int64 indices into [0, limit), the first three replaced by indices outside it."""
    rows = torch.randint(0, max(limit, 1), (n,), generator=rng)
    rows[:3] = torch.tensor([-1, limit, 2**40])[:n]
    return rows[torch.randperm(n, generator=rng)].to(device)


# ----------------------------------------------------------------------------- matmul: a_rows, relu_grad_of

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("view", ["contiguous", "column_major"])
def test_matmul_a_rows_along_m(ops, device, rng, view, split_k, dtype):
    """The trainer's first forward: rows of the dataset by index, bias and ReLU; an index outside
    the dataset reads a row of zeros, so its row of C is relu(bias) exactly."""
    m, n, k, stored = 19, 13, 29, 23
    a = randn(rng, (stored, k), dtype, device) if view == "contiguous" else randn(rng, (k, stored), dtype, device).t()
    b, bias = randn(rng, (k, n), dtype, device), randn(rng, (n,), dtype, device)
    a_rows = with_outside(rng, m, stored, device)
    config = pick(ops, "matmul", dtype, device, rng, split_k=split_k, gathers=True)
    out = poisoned((m, n), dtype, device)
    assert ops.matmul(a, b, bias=bias, activation="relu", a_rows=a_rows, out=out, config=config) is out
    ref = exact.matmul(a, b, bias=bias, activation="relu", a_rows=a_rows)
    assert_rel(out, ref, tolerance(dtype, k, device), f"config={config}")
    outside = ((a_rows < 0) | (a_rows >= stored)).cpu()
    assert_exact(out.cpu()[outside], exact.bias_add(torch.zeros(int(outside.sum()), n), bias.cpu(),
                                                    activation="relu"), "rows of outside indices")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_a_rows_along_k(ops, device, rng, trans_b, split_k, dtype):
    """trans_a with a_rows gathers along K (linear_sgd's x_rows): op(a)[:, j] = a[a_rows[j]]^T,
    zeros for an index outside a; split-K slices start their gather at their own offset."""
    m, n, stored = 17, 12, 31
    config = pick(ops, "matmul", dtype, device, rng, split_k=split_k, gathers=True)
    k = 45 if split_k == 1 else K_CASES["ragged"](split_k, config["BLOCK_K"])
    a = randn(rng, (stored, m), dtype, device)
    b = randn(rng, (n, k) if trans_b else (k, n), dtype, device)
    a_rows = with_outside(rng, k, stored, device)
    out = poisoned((m, n), dtype, device)
    ops.matmul(a, b, trans_a=True, trans_b=trans_b, a_rows=a_rows, out=out, config=config)
    ref = exact.matmul(a, b, trans_a=True, trans_b=trans_b, a_rows=a_rows)
    assert_rel(out, ref, tolerance(dtype, k, device), f"config={config}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 4])
def test_matmul_relu_grad_of(ops, device, rng, split_k, dtype):
    """The hidden layer's backward, dlogits @ w^T masked by the ReLU's output y: exactly 0 where
    y <= 0 (-0.0 and -inf included), the product where y > 0 and where y is NaN (torch's
    threshold_backward passes it on)."""
    m, n, k = 33, 21, 29
    g, w = randn(rng, (m, k), dtype, device), randn(rng, (n, k), dtype, device)
    y = randn(rng, (m, n), dtype, device)
    flat = y.view(-1)
    for start, step, value in [(0, 5, 0.0), (1, 7, -0.0), (2, 11, float("nan")), (3, 13, float("-inf")),
                               (4, 17, float("inf"))]:
        flat[start::step] = value
    config = pick(ops, "matmul", dtype, device, rng, split_k=split_k)
    out = poisoned((m, n), dtype, device)
    ops.matmul(g, w, trans_b=True, relu_grad_of=y, out=out, config=config)
    ref = exact.matmul(g, w, trans_b=True, relu_grad_of=y)
    assert_rel(out, ref, tolerance(dtype, k, device), f"config={config}")
    masked = (y <= 0).cpu()
    assert masked.any() and (out.cpu()[masked] == 0).all(), "y <= 0 must give exactly 0"
    passed = y.isnan().cpu()
    assert passed.any() and not (out.cpu()[passed] == 0).all(), "a NaN y must pass the gradient on"


# ----------------------------------------------------------------------------- linear_cross_entropy

def ce_problem(rng, m, n, k, dtype, device, *, bias=True):
    """x, w (logits of a few units: softmax neither flat nor one-hot), bias, labels in [0, n)."""
    x = randn(rng, (m, k), dtype, device)
    w = randn(rng, (k, n), dtype, device, scale=2 / max(k, 1) ** 0.5)
    b = randn(rng, (n,), dtype, device) if bias else None
    labels = torch.randint(0, n, (m,), generator=rng).to(device)
    return x, w, b, labels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 10, 37])
def test_linear_ce(ops, device, rng, n, dtype):
    x, w, bias, labels = ce_problem(rng, 37, n, 29, dtype, device)
    config = pick(ops, "linear_cross_entropy", dtype, device, rng, min_block_n=n)
    check_linear_ce(ops, x, w, labels, bias=bias, config=config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [2, 4, 16, 64])
@pytest.mark.parametrize("k_case", ["short", "ragged"])
def test_linear_ce_split_k(ops, device, rng, k_case, split_k, dtype):
    """The last slice of a row tile runs the loss epilogue, once; K < SPLIT_K * BLOCK_K (slices
    left empty) and K not divisible by it."""
    config = pick(ops, "linear_cross_entropy", dtype, device, rng, split_k=split_k)
    k = K_CASES[k_case](split_k, config["BLOCK_K"])
    x, w, bias, labels = ce_problem(rng, 23, 10, k, dtype, device, bias=k_case == "ragged")
    check_linear_ce(ops, x, w, labels, bias=bias, config=config)
    assert counters_are_zero(x.device), f"counters left non-zero (config={config})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_ce_label_rows(ops, device, rng, dtype):
    """The batch's labels by index into the dataset's; an index outside them reads label 0."""
    x, w, bias, _ = ce_problem(rng, 29, 10, 21, dtype, device)
    labels = torch.randint(0, 10, (50,), generator=rng).to(device)
    label_rows = with_outside(rng, 29, 50, device)
    config = pick(ops, "linear_cross_entropy", dtype, device, rng, split_k=2)
    check_linear_ce(ops, x, w, labels, bias=bias, label_rows=label_rows, config=config)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_ce_labels_outside(ops, device, rng, dtype):
    """A label outside [0, N): NaN loss, that row's dlogits softmax / M, the flag (1, label, N)
    that check_labels raises on, once."""
    dev = torch.device(device)
    contract.label_flag(dev).zero_()
    x, w, bias, labels = ce_problem(rng, 25, 10, 19, dtype, device)
    bad = torch.tensor([10, -1, 2**40], device=device)
    labels[torch.randperm(25, generator=rng)[:3].to(device)] = bad
    config = pick(ops, "linear_cross_entropy", dtype, device, rng)
    check_linear_ce(ops, x, w, labels, bias=bias, config=config)
    seen, label, classes = contract.label_flag(dev).tolist()
    assert seen == 1 and label in bad.tolist() and classes == 10, f"flag {(seen, label, classes)}"
    with pytest.raises(contract.LabelError, match="outside"):
        contract.check_labels(dev)
    contract.check_labels(dev)  # cleared by the raise


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_ce_loss_deterministic(ops, device, rng, dtype):
    """The same bits on every call: slots summed in slot order whichever row tile arrives last,
    and the counters zero again after each call (else no tile of the next would be last)."""
    config = pick(ops, "linear_cross_entropy", dtype, device, rng, split_k=4)
    x, w, bias, labels = ce_problem(rng, 70, 10, K_CASES["ragged"](4, config["BLOCK_K"]), dtype, device)
    first_loss, first_grad = check_linear_ce(ops, x, w, labels, bias=bias, config=config)
    for _ in range(1 if device == "cpu" else 20):
        loss, grad = ops.linear_cross_entropy(x, w, labels, bias=bias, config=config)
        assert torch.equal(loss, first_loss) and torch.equal(grad, first_grad), f"two calls differ (config={config})"
        assert counters_are_zero(x.device)


def test_linear_ce_block_n_below_n_refused(ops, device, rng):
    """One tile must hold a whole row of logits: a config with BLOCK_N < N is refused before launch."""
    x, w, _, labels = ce_problem(rng, 8, 40, 16, "fp32", device, bias=False)
    config = pick(ops, "linear_cross_entropy", "fp32", device, rng, max_block_n=32)
    out_grad = poisoned((8, 40), "fp32", device)
    with pytest.raises(ValueError, match="config: .*BLOCK_N >= N = 40"):
        ops.linear_cross_entropy(x, w, labels, out_grad=out_grad, config=config)
    assert out_grad.isnan().all(), "wrote before refusing"


def test_linear_ce_empty(ops, device):
    """No rows: the loss is torch's mean of nothing (NaN), dlogits empty."""
    x, w = torch.empty(0, 5, device=device), torch.ones(5, 10, device=device)
    loss, grad = ops.linear_cross_entropy(x, w, torch.empty(0, dtype=torch.int64, device=device))
    assert loss.isnan() and loss.dim() == 0 and grad.shape == (0, 10)


def _ce_wrong(x, w, bias, labels, how):
    """(loss, dlogits) computed exactly but for one mistake."""
    m, n = x.shape[0], w.shape[1]
    if how == "bias dropped":
        return exact.linear_cross_entropy(x, w, labels)
    if how == "label off by one":
        return exact.linear_cross_entropy(x, w, (labels + 1) % n, bias=bias)
    loss, grad = exact.linear_cross_entropy(x, w, labels, bias=bias)
    if how == "mean over N":
        return loss * m / n, grad
    if how == "dlogits without 1/M":
        return loss, grad * m
    assert how == "a row tile dropped"
    rows = exact.linear_cross_entropy(x[16:], w, labels[16:], bias=bias)[0] * (m - 16)
    return rows / m, grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["bias dropped", "label off by one", "mean over N", "dlogits without 1/M",
                                 "a row tile dropped"])
def test_linear_ce_check_fails_a_wrong_result(rng, how, dtype):
    """The bound of assert_linear_ce_close is tight enough to reject each of these mistakes."""
    x, w, bias, labels = ce_problem(rng, 37, 10, 29, dtype, "cpu")
    loss, grad = _ce_wrong(x, w, bias, labels, how)
    with pytest.raises(AssertionError, match="loss|dlogits"):
        assert_linear_ce_close(loss.float(), grad.to(x.dtype), x, w, labels, bias=bias)


# ----------------------------------------------------------------------------- linear_sgd

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum,weight_decay", SGD_HYPERS)
def test_linear_sgd(ops, device, rng, momentum, weight_decay, dtype):
    """A layer's step from a batch gathered by index (some outside the dataset: rows of zeros),
    odd K_in and N_out, a batch of several BLOCK_K chunks for the bias sums, the low copies."""
    layer = sgd_layer(rng, device, dtype, 70, 37, 19, momentum=momentum, rows=90, low=True)
    config = pick(ops, "linear_sgd", dtype, device, rng)
    check_linear_sgd(ops, layer, lr=0.1, momentum=momentum, weight_decay=weight_decay, config=config)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_sgd_batch_of_one(ops, device, rng, dtype):
    """B = 1, no gather, no low copies, the default config."""
    layer = sgd_layer(rng, device, dtype, 1, 23, 7, momentum=0.9)
    check_linear_sgd(ops, layer, lr=0.05, momentum=0.9, weight_decay=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_sgd_deterministic(ops, device, rng, dtype):
    """The same step from the same state gives the same bits: gw per element and gb in a fixed order."""
    layer = sgd_layer(rng, device, dtype, 45, 20, 33, momentum=0.9, rows=60, low=True)
    config = pick(ops, "linear_sgd", dtype, device, rng)
    x, dy, w, bias, w_buf, b_buf, x_rows, w_low, b_low = layer
    start = [t.clone() for t in (w, bias, w_buf, b_buf)]
    results = []
    for _ in range(2 if device == "cpu" else 20):
        for t, t0 in zip((w, bias, w_buf, b_buf), start):
            t.copy_(t0)
        ops.linear_sgd(x, dy, w, bias, w_buf, b_buf, lr=0.1, momentum=0.9, x_rows=x_rows, w_low=w_low,
                       b_low=b_low, config=config)
        results.append([t.clone() for t in (w, bias, w_buf, b_buf, w_low, b_low)])
    for again in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(again, results[0])), f"two steps differ (config={config})"


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 1e-2), (0.0, 0.0)])
def test_linear_sgd_empty_batch(ops, device, rng, momentum, weight_decay):
    """B = 0: the gradients are 0, but weight decay and momentum still move w and bias."""
    layer = sgd_layer(rng, device, "fp32", 0, 9, 6, momentum=momentum, rows=5, low=True)
    check_linear_sgd(ops, layer, lr=0.1, momentum=momentum, weight_decay=weight_decay)


def test_linear_sgd_no_inputs(ops, device, rng):
    """K_in = 0: no w to update, the bias's step still taken."""
    layer = sgd_layer(rng, device, "fp16", 6, 0, 5, momentum=0.9, low=True)
    check_linear_sgd(ops, layer, lr=0.1, momentum=0.9, weight_decay=1e-2)


def _sgd_wrong(layer, how, lr, momentum, weight_decay):
    """(w, bias, w_buf, b_buf) of one step computed exactly but for one mistake."""
    x, dy, w, bias, w_buf, b_buf, x_rows, _, _ = layer
    kw = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, x_rows=x_rows)
    if how == "x_rows ignored":
        kw.pop("x_rows")
        x = x[:dy.shape[0]]
    elif how == "weight decay dropped":
        kw["weight_decay"] = 0.0
    elif how == "lr applied twice":
        kw["lr"] = 2 * lr
    if how == "gradient rounded to bf16":
        inside = (x_rows >= 0) & (x_rows < x.shape[0])
        gx = x.double()[torch.where(inside, x_rows, 0)] * inside.double()[:, None]  # x[x_rows], zeros outside
        grads = [(gx.t() @ dy.double()).bfloat16().double(), dy.double().sum(0).bfloat16().double()]
        (w1, b1), bufs = exact.sgd_update([w, bias], grads, [w_buf, b_buf], lr=lr, momentum=momentum,
                                          weight_decay=weight_decay)
    else:
        (w1, b1), bufs = exact.linear_sgd(x, dy, w, bias, w_buf, b_buf, **kw)
    if how == "bias step dropped":
        b1, bufs = bias.double(), [bufs[0], b_buf.double()]
    return w1, b1, bufs[0], bufs[1]


@pytest.mark.parametrize("how", ["x_rows ignored", "weight decay dropped", "lr applied twice",
                                 "gradient rounded to bf16", "bias step dropped"])
def test_linear_sgd_check_fails_a_wrong_update(rng, how):
    """The bound of assert_linear_sgd_close is tight enough to reject each of these mistakes."""
    layer = sgd_layer(rng, "cpu", "fp32", 70, 37, 19, momentum=0.9, rows=90)
    x, dy, w, bias, w_buf, b_buf, x_rows, _, _ = layer
    got = [t.float() for t in _sgd_wrong(layer, how, 0.1, 0.9, 1e-2)]
    with pytest.raises(AssertionError, match="magnitude"):
        assert_linear_sgd_close(*got, (w, bias, w_buf, b_buf), x, dy, lr=0.1, momentum=0.9, weight_decay=1e-2,
                                x_rows=x_rows)


# ----------------------------------------------------------------------------- CUDA graph

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_paths_replay_in_a_cuda_graph(ops, rng, dtype):
    """A gathered forward, a masked backward, the fused loss (split-K) and the fused update,
    captured once and replayed twice with new batches: the gathers read the new indices, the
    loss's counters are zero again after each replay, the update applies to the state it finds."""
    dev = "cuda"
    data, labels = randn(rng, (300, 40), dtype, dev), torch.randint(0, 10, (300,), generator=rng).to(dev)
    rows = torch.randint(0, 300, (32,), generator=rng).to(dev)
    w1 = randn(rng, (40, 24), dtype, dev, scale=0.2)
    h, y, dh = poisoned((32, 24), dtype, dev), randn(rng, (32, 24), dtype, dev), poisoned((32, 24), dtype, dev)
    w2 = randn(rng, (24, 10), dtype, dev, scale=0.4)
    dlogits = poisoned((32, 10), dtype, dev)
    _, dy, w, bias, w_buf, b_buf, _, w_low, b_low = sgd_layer(rng, dev, dtype, 32, 40, 24, momentum=0.9, low=True)
    ce_config = pick(ops, "linear_cross_entropy", dtype, dev, rng, split_k=4)

    def step():
        ops.matmul(data, w1, a_rows=rows, out=h)
        loss = ops.linear_cross_entropy(y, w2, labels, label_rows=rows, out_grad=dlogits, config=ce_config)[0]
        ops.matmul(dlogits, w2, trans_b=True, relu_grad_of=y, out=dh)
        ops.linear_sgd(data, dy, w, bias, w_buf, b_buf, lr=0.1, momentum=0.9, weight_decay=1e-2, x_rows=rows,
                       w_low=w_low, b_low=b_low)
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compiles, sizes the workspace, makes the flag
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    for _ in range(2):
        rows.copy_(torch.randint(0, 300, (32,), generator=rng).to(dev))
        y.copy_(randn(rng, (32, 24), dtype, dev))
        dy.copy_(randn(rng, (32, 24), dtype, dev))
        start = tuple(t.clone() for t in (w, bias, w_buf, b_buf))
        for t in (h, dh, dlogits, loss):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel(h, exact.matmul(data, w1, a_rows=rows), tolerance(dtype, 40, dev), "gathered forward")
        assert_linear_ce_close(loss, dlogits, y, w2, picked_labels(labels, rows), what="replayed loss: ")
        assert_rel(dh, exact.matmul(dlogits, w2, trans_b=True, relu_grad_of=y), tolerance(dtype, 10, dev),
                   "masked backward")
        assert_linear_sgd_close(w, bias, w_buf, b_buf, start, data, dy, lr=0.1, momentum=0.9, weight_decay=1e-2,
                                x_rows=rows, what="replayed update: ")
        assert_exact(w_low, w, "w_low")
        assert_exact(b_low, bias, "b_low")
        assert counters_are_zero(data.device)
