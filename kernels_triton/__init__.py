"""Triton twin of `kernels_cuda`: the ops of a small MLP's training step.

Same functions, signatures and search spaces-as-data as the raw-CUDA twin
(see `kernels_core.contract`): matmul (with fused bias + ReLU, row gathers
and the ReLU-gradient mask), relu, relu_backward, bias_add, bias_grad,
softmax_cross_entropy, sgd_update and the fused step's linear_cross_entropy
and linear_sgd (GEMMs whose epilogues run the loss and the update), the
persistent training kernel (persistent.plan: many steps in one launch), plus
`space(op, dtype)` and two resource probes, `compile_report` (offline,
any target) and `resource_report` (the last launch on this GPU).

Module map, the same as the CUDA twin's: matmul.py, elementwise.py (relu,
relu_backward, bias_add), reduction.py (bias_grad), loss.py
(softmax_cross_entropy), optim.py (sgd_update), fused.py
(linear_cross_entropy, linear_sgd: matmul.py's kernel), persistent.py, reports.py (resource
figures), _runtime.py (device checks, config resolution, launching).
"""
import os

import torch

# With no GPU, run the kernels in Triton's interpreter on CPU tensors, so the
# package (and its tests) work anywhere. @triton.jit reads the variable when it
# decorates a kernel, so it is set before the kernel modules are imported.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels_core.contract import DTYPES, check_op  # noqa: E402
from kernels_core.persistent import SPACE as PERSISTENT_SPACE  # noqa: E402
from kernels_core.space import Space  # noqa: E402

from . import elementwise, fused, loss, optim, reduction  # noqa: E402
from .matmul import SPACES as _MATMUL_SPACES  # noqa: E402
from .elementwise import bias_add, relu, relu_backward  # noqa: E402
from .fused import linear_cross_entropy, linear_sgd  # noqa: E402
from .loss import softmax_cross_entropy  # noqa: E402
from .matmul import matmul  # noqa: E402
from .optim import sgd_update  # noqa: E402
from .reduction import bias_grad  # noqa: E402
from .reports import compile_report, resource_report  # noqa: E402
from . import persistent  # noqa: E402  (the persistent training kernel: persistent.plan, its space below)

__all__ = [
    "matmul", "relu", "relu_backward", "bias_add", "bias_grad", "softmax_cross_entropy", "sgd_update",
    "linear_cross_entropy", "linear_sgd", "persistent", "space", "compile_report", "resource_report",
]

_SPACES = {
    "matmul": _MATMUL_SPACES,
    "relu": elementwise.SPACES,
    "relu_backward": elementwise.SPACES,
    "bias_add": elementwise.SPACES,
    "bias_grad": reduction.SPACES,
    "softmax_cross_entropy": loss.SPACES,
    "sgd_update": optim.SPACES,
    **fused.SPACES,
    "persistent": {dtype: PERSISTENT_SPACE for dtype in DTYPES},
}


def space(op: str, dtype: str) -> Space:
    """The search space of `op` for inputs of `dtype` ("fp32", "fp16", "bf16";
    for sgd_update the gradients' dtype)."""
    check_op(op, dtype)
    return _SPACES[op][dtype]
