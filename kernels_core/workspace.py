"""Scratch memory of split-K matmuls: fp32 partial tiles and per-tile arrival counters.

A split-K product cuts K into SPLIT_K slices, each computed by its own program.
Every program writes its fp32 partial tile to `partials[slice]` and then bumps
its tile's counter (release); the program that arrives last (acquire) sums the
slices in slice order 0, 1, ..., SPLIT_K - 1, applies bias and ReLU once,
stores C and sets the counter back to 0. The sum order never depends on who
arrives last, so the same inputs give the same bits on every run, and the
counters are zero again for the next call: they are zeroed once, here.

Both twins use this one helper. The buffers live per device and grow on
demand (doubling), so a training step's calls reuse them without allocating,
and a CUDA graph that captured calls keeps pointing at live memory: a buffer
is never freed once handed out, only outgrown. Calls on one device share the
buffers, so they must be ordered: one stream, as a training step runs (the
contract says so under matmul).
"""
from __future__ import annotations

import torch

from kernels_core.contract import cdiv, device_key, refuse_zeroed_allocation_in_capture

_live: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
_outgrown: list[torch.Tensor] = []  # kept alive: a captured graph may still point at them


def splitk_slices(K: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(k_slice, slices): K is cut into `split_k` slices of ceil(K / (split_k * block_k)) * block_k
    elements, whole BLOCK_K steps, of which the first `slices` hold any. Only those are launched,
    so a K of a few BLOCK_K neither runs nor stores empty slices (nor sizes the workspace for them)."""
    k_slice = cdiv(K, split_k * block_k) * block_k
    return k_slice, cdiv(K, k_slice) if K > 0 else 1  # K = 0: one slice, the bias alone


def _grown(current: torch.Tensor | None, need: int, make) -> torch.Tensor:
    if current is not None and current.numel() >= need:
        return current
    if current is not None:
        _outgrown.append(current)
    return make(max(need, 2 * (current.numel() if current is not None else 0)))


def splitk_workspace(device: torch.device, partial_elems: int, tiles: int, *,
                     what: str = "a split-K matmul") -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials of at least `partial_elems`, int32 counters of at least `tiles`, the counters
    zero). Growing them inside a CUDA graph capture is refused, naming `what` asked: the counters'
    zeroing would be recorded, not run."""
    key = device_key(device)
    partials, counters = _live.get(key, (None, None))
    if (partials is None or partials.numel() < partial_elems) or (counters is None or counters.numel() < tiles):
        refuse_zeroed_allocation_in_capture(device, what)
    partials = _grown(partials, partial_elems, lambda n: torch.empty(n, dtype=torch.float32, device=device))
    counters = _grown(counters, tiles, lambda n: torch.zeros(n, dtype=torch.int32, device=device))
    _live[key] = (partials, counters)
    return partials, counters
