"""sgd_update (optim.cu): torch.optim.SGD's step, one launch per tensor, on the
flat work split and search space of the elementwise kernels."""
from __future__ import annotations

from kernels_core.contract import check_sgd_args, dtype_name

from . import _runtime as rt
from .elementwise import SPACE, flat_variant, launch_flat


def _variant(dtype: str, cfg, vec: int, momentum: int) -> rt.Variant:
    return flat_variant("optim.cu", "sgd_kernel", dtype, cfg, vec, momentum)


def report_variant(op: str, dtype: str, cfg, arch: int) -> tuple[rt.Variant, int]:
    return _variant(dtype, cfg, cfg["VEC"], 1), 0


def sgd_update(params, grads, momentum_bufs, *, lr, momentum=0.0, weight_decay=0.0, config=None):
    params, grads, bufs, lr, momentum, weight_decay = check_sgd_args(
        params, grads, momentum_bufs, lr, momentum, weight_decay)
    if not params:
        return None
    dev, cfg = rt.setup("params[0]", params[0], SPACE, config)
    for p, g, buf in zip(params, grads, bufs):
        n = p.numel()
        if n == 0:
            continue
        g = g.contiguous()
        vec = rt.pick_vec(cfg["VEC"], 4, (p,) if buf is None else (p, buf))
        vec = rt.pick_vec(vec, g.element_size(), (g,))
        variant = _variant(dtype_name(g.dtype), cfg, vec, int(bool(momentum)))
        launch_flat("sgd_update", variant, cfg, dev, n,
                     (rt.ptr(p), rt.ptr(g), rt.ptr(buf), rt.f32(lr), rt.f32(momentum), rt.f32(weight_decay),
                      rt.i64(n)))
    return None
