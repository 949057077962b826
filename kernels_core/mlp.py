"""The MNIST MLP the lab trains and tunes for: its protocols and the calls of one training step.

The trainer's model (trainer/model.py) makes exactly the calls `mlp_calls` lists, and
looks each one's config up by it; the tuner's mnist-mlp workload tunes that list.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from kernels_core.shapes import shape_key

MNIST_IN, MNIST_CLASSES = 784, 10
# The ops that apply SGD: with momentum 0 (the seed protocol) they keep no buffers, 8 bytes a
# weight fewer to move (the fp32 buffer read and written), so they are other calls to tune; so
# does the persistent kernel, whose step applies it.
SGD_OPS = ("sgd_update", "linear_sgd")
MOMENTUM_OPS = SGD_OPS + ("persistent",)


@dataclass(frozen=True)
class Protocol:
    """One way the lab trains the MLP, 784 -> hidden x layers -> 10, and the widths it is measured at."""

    dtype: str
    batch_size: int
    layers: int
    lr: float
    momentum: float
    hidden: int  # the width a run takes when none is given
    widths: tuple[int, ...]  # the widths the benchmarks measure
    steps: int | None = None  # None: the trainer's epochs

    @property
    def net(self) -> str:
        """The layer widths, e.g. 784-H-H-10."""
        return "-".join([str(MNIST_IN), *["H"] * self.layers, str(MNIST_CLASSES)])

    def settings(self) -> dict:
        """The trainer's settings this protocol fixes (trainer.config.Config fields); the width
        stays each run's own."""
        fields = asdict(self)
        del fields["widths"], fields["hidden"]
        if self.steps is None:
            fields.pop("steps")
        return fields


PROTOCOLS = {
    # fp32 with momentum: 98.5% test accuracy in 10 epochs at H = 1024 (trainer/config.py).
    "default": Protocol(dtype="fp32", batch_size=128, layers=2, lr=0.05, momentum=0.9, hidden=1024,
                        widths=(128, 1024, 4096)),
    # The seed project's protocol: a deeper net, small batches, plain SGD in fp16.
    "seed": Protocol(dtype="fp16", batch_size=32, layers=3, lr=0.003, momentum=0.0, hidden=1024,
                     widths=(128, 256, 512, 1024, 2048, 4096, 8192), steps=5000),
}
DEFAULT = PROTOCOLS["default"]


@dataclass(frozen=True)
class Call:
    """One op call as the trainer makes it: enough to build its inputs and name its config."""

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
    momentum: float = DEFAULT.momentum

    @property
    def key(self) -> str:
        return shape_key(self.shape, self.layout)

    @property
    def study_key(self) -> str:
        """The key that names the call's study: the store's key, marked where SGD keeps no buffers.
        The store entry keeps the plain key: a store holds one protocol's winners."""
        return self.key + (":no-momentum" if self.op in MOMENTUM_OPS and not self.momentum else "")


def persistent_call(hidden: int, layers: int, batch: int, dtype: str, momentum: float = DEFAULT.momentum) -> Call:
    """The persistent kernel training 784 -> hidden x layers -> 10 at `batch`: one call, a segment
    of steps (kernels_core/persistent.py's Layout is its shape)."""
    return Call("persistent", dtype, (hidden, layers, batch), "mlp", momentum=momentum)


def mlp_calls(hidden: int, layers: int, batch: int, dtype: str, *, fused: bool | None = None,
              momentum: float = DEFAULT.momentum) -> list[Call]:
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
        return dedupe(mlp_calls(hidden, layers, batch, dtype, fused=True, momentum=momentum)
                      + mlp_calls(hidden, layers, batch, dtype, fused=False, momentum=momentum))
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
    """The first call of each (op, shape key), in order."""
    seen: dict[tuple[str, str], Call] = {}
    for call in calls:
        seen.setdefault((call.op, call.key), call)
    return list(seen.values())
