"""softmax_cross_entropy given labels outside [0, N): the contract's answer (kernels_core/contract.py).

torch's cross_entropy raises on such a label; a kernel cannot without a sync.
So each twin makes that row's loss NaN (and with it the mean), gives the row
the plain softmax / M as its gradient, leaves every other row as usual, and
records the label in the device's flag, from which `check_labels` raises once,
at a sync the caller chooses.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from kernels_core import contract
from kernels_core.contract import LabelError, check_labels, label_flag

DTYPES = list(contract.DTYPES)
U = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}  # unit roundoff of the stored gradient
TINY = {"fp32": 2.0**-150, "fp16": 2.0**-25, "bf16": 2.0**-134}  # half the smallest subnormal


@pytest.fixture(autouse=True)
def _clear_flags(device):
    """A failing test must not leave its flag set for the next one."""
    yield
    try:
        check_labels(torch.device(device))
    except LabelError:
        pass


def _expected(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dlogits, bound) in float64: softmax - onehot over M for rows with a valid label, softmax / M
    for the others, and the error each element may carry.

    The kernels work in fp32 and round once to the output dtype. Each probability is
    exp(z - lse) with z - lse formed in fp32: an absolute error of about u32 (|z| + |lse|) in
    the exponent, so as much relative error in p, plus a few roundings (exp, the scale, the
    subtraction of 1); then the final rounding to the dtype: up to one ulp (2 u), as the
    interpreter's cast to bf16 truncates, and values below half the smallest subnormal
    flush to 0.
    """
    m, c = logits.shape
    z = logits.double().cpu()
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    p = torch.exp(z - lse)
    labels = labels.cpu()
    valid = (labels >= 0) & (labels < c)
    onehot = torch.zeros_like(p)
    onehot[valid.nonzero().flatten(), labels[valid]] = 1.0
    ref = (p - onehot) / m
    dtype = contract.dtype_name(logits.dtype)
    u32 = U["fp32"]
    bound = (2 * U[dtype] + 4 * u32) * ref.abs() + u32 * (2 * (z.abs() + lse.abs()) + 16) * p / m + TINY[dtype]
    return ref, bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,c", [(1, 1), (9, 10), (37, 130), (6, 2000)])
def test_labels_outside_the_classes_give_nan_loss_softmax_rows_and_a_flag(ops, device, rng, m, c, dtype):
    dev = torch.device(device)
    check_labels(dev)  # nothing left over from another test
    logits = (torch.randn(m, c, generator=rng, dtype=torch.float64) * 3).to(dev, contract.DTYPES[dtype])
    labels = torch.randint(0, c, (m,), generator=rng)
    bad = torch.tensor([-1, c, c + 7, -(2**40), 2**62])
    rows = torch.randperm(m, generator=rng)[: 1 + int(torch.randint(0, m, (), generator=rng))]
    labels[rows] = bad[torch.randint(0, len(bad), (len(rows),), generator=rng)]
    labels = labels.to(dev)
    out_grad = torch.full((m, c), float("nan"), dtype=logits.dtype, device=dev)

    loss, grad = ops.softmax_cross_entropy(logits, labels, out_grad=out_grad)

    assert loss.isnan(), f"mean loss {loss.item()} with {len(rows)} out-of-range labels"
    ref, bound = _expected(logits, labels)
    err = (grad.double().cpu() - ref).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"dlogits[{worst // c}, {worst % c}] = {grad.flatten()[worst].item()}, "
                                  f"expected {ref.flatten()[worst].item()} (label {labels[worst // c].item()})")
    with pytest.raises(LabelError) as raised:
        check_labels(dev)
    given = set(labels[rows].tolist())
    label = int(str(raised.value).split("given label ")[1].split(",")[0])
    assert label in given and f"outside [0, {c})" in str(raised.value)
    check_labels(dev)  # raised once; the flag is clear again
    assert label_flag(dev).tolist() == [0, 0, 0]


@pytest.mark.parametrize("c", [1, 2, 10, 1000])
def test_the_range_is_exactly_0_to_n(ops, device, rng, c):
    dev = torch.device(device)
    m = 7
    logits = torch.randn(m, c, generator=rng).to(dev)
    labels = torch.tensor([0, c - 1, 0, c - 1, 0, c - 1, 0]).to(dev)
    loss, grad = ops.softmax_cross_entropy(logits, labels)
    assert math.isfinite(loss.item())
    check_labels(dev)
    assert label_flag(dev).tolist() == [0, 0, 0]
    ref, bound = _expected(logits, labels)
    assert ((grad.double().cpu() - ref).abs() <= bound).all()
    row = int(torch.randint(0, m, (), generator=rng))
    for just_outside in (-1, c):
        labels[row] = just_outside
        loss, _ = ops.softmax_cross_entropy(logits, labels)
        assert loss.isnan()
        with pytest.raises(LabelError, match=rf"given label {just_outside}, outside \[0, {c}\)"):
            check_labels(dev)


def test_trainer_names_a_bad_label_instead_of_blaming_the_lr(tmp_path, monkeypatch, capsys):
    from trainer.run import main

    train_module = importlib.import_module("trainer.train")
    real_load = train_module.load_mnist

    def load_with_a_bad_label(*args):
        data = real_load(*args)
        data.train_y[5] = 10  # a copy of the cached labels: the next load is clean again
        return data

    monkeypatch.setattr(train_module, "load_mnist", load_with_a_bad_label)
    # 32 images in batches of 16: two steps see every image, the bad one included.
    code = main(["--backend", "triton", "--hidden", "16", "--layers", "1", "--batch-size", "16",
                 "--train-subset", "32", "--steps", "2", "--tuned-configs", "none", "--out", str(tmp_path),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines()[-1].startswith("error: labels: softmax_cross_entropy was given label 10, outside [0, 10)")


@pytest.mark.gpu
def test_the_flag_is_set_by_graph_replays(ops, rng):
    dev = torch.device("cuda")
    logits = torch.randn(64, 10, generator=rng).to(dev)
    labels = torch.randint(0, 10, (64,), generator=rng).to(dev)
    ops.softmax_cross_entropy(logits, labels)  # compiles and allocates the flag outside the capture
    check_labels(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.softmax_cross_entropy(logits, labels)
    graph.replay()
    torch.cuda.synchronize()
    check_labels(dev)
    labels[17] = 12
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(LabelError, match=r"given label 12, outside \[0, 10\)"):
        check_labels(dev)
    labels[17] = 3
    graph.replay()
    check_labels(dev)


@pytest.mark.gpu
def test_a_first_call_inside_a_capture_is_refused(ops, monkeypatch):
    monkeypatch.setattr(contract, "_label_flags", {})  # as in a fresh process
    logits = torch.randn(8, 10, device="cuda")
    labels = torch.zeros(8, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match="before capturing a CUDA graph"):
            ops.softmax_cross_entropy(logits, labels)
