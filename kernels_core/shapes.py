"""Shape keys: how a call's shape is written in a config store, a study name and on a command line.

matmul (M, N, K) plus a layout ("nn", "tn", "nt", "tt": t = that operand is
transposed), elementwise and row ops (M, N), softmax_cross_entropy (M, C),
sgd_update (total parameter elements,), and the fused ops by their GEMM:
linear_cross_entropy (M, N, K):nn (the logits), linear_sgd (K_in, N_out, B):tn
(the weight gradient); the persistent kernel by its net, (hidden, layers, batch):mlp.
"""
from __future__ import annotations

from kernels_core.contract import MAX_DIM

OP_RANK = {"matmul": 3, "relu": 2, "relu_backward": 2, "bias_add": 2, "bias_grad": 2,
           "softmax_cross_entropy": 2, "sgd_update": 1, "linear_cross_entropy": 3, "linear_sgd": 3,
           "persistent": 3}
# The layout each fused op's GEMM has: the only one it takes; the persistent kernel's shape is a
# net's, "mlp", which no --shapes flag spells (it is tuned on the trainer's net only).
FUSED_LAYOUT = {"linear_cross_entropy": "nn", "linear_sgd": "tn", "persistent": "mlp"}
LAYOUTS = ("nn", "tn", "nt", "tt")


def shape_key(shape, layout: str = "") -> str:
    """(128, 1024, 784), "nn" -> "128x1024x784:nn"."""
    return "x".join(str(int(d)) for d in shape) + (f":{layout}" if layout else "")


def parse_shape_key(key: str) -> tuple[tuple[int, ...], str]:
    """A store's key back to (shape, layout); only the canonical form `shape_key` writes."""
    dims, _, layout = key.partition(":")
    try:
        shape = tuple(int(d) for d in dims.split("x"))
    except ValueError:
        raise ValueError(f"shape {key!r} is not like 128x1024x784:nn or 128x1024") from None
    if min(shape) < 1 or shape_key(shape, layout) != key:
        raise ValueError(f"shape {key!r} is not in canonical form (positive integers joined by 'x')")
    return shape, layout


def parse_shapes(text: str) -> list[tuple[tuple[int, ...], str]]:
    """A --shapes flag, "4096x4096x4096,128x1024x784:tn,128x1024" -> [(shape, layout), ...]; a
    matmul shape without a layout is "nn"."""
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
