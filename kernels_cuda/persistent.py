"""Many training steps of the MLP in one launch: the CUDA twin of kernels_triton/persistent.py
(whose docstring has the why and the phases), on persistent.cu's train_steps.

The Triton twin's plan, scratch and refusals (kernels_core/persistent.py), one block of
32 x num_warps threads a program, and two refusals of its own: labels other than int64 (the
kernel reads 8-byte labels), and a config whose tiles need more shared memory than the GPU gives a
block. The products are FMAs on the CUDA cores (persistent.cu's header: the rounding, the phases,
what each reads and writes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_core.contract import cdiv
from kernels_core.persistent import (Layout, blocks_per_sm, check_coresident, check_inputs, check_segment,
                                     resolve_config, slice_counts)

from . import _runtime as rt


def smem_bytes(cfg: dict, layout: Layout) -> int:
    """Dynamic shared memory of a block: persistent.cu's PersistentSmem<...>::FLOATS, in bytes."""
    bk, out = cfg["BK"], layout.classes

    def product(rows: int, cols: int) -> int:  # ProductSmem: two stages of k-major tiles, rows padded by 4
        return 2 * bk * (rows + 4 + (1 << (cols - 1).bit_length()) + 4)

    loss = max(product(cfg["BL"], out), cfg["BN"] * out) + 2 * cfg["BL"] * out + cfg["BL"]
    rows = 2 * 4 * cdiv(2 * layout.batch, 4)  # two steps' int64 rows, each rounded up to 16 bytes
    updates = max(product(cfg["BR"], cfg["BC"]), product(cfg["BR0"], cfg["BC"]))
    return 4 * (rows + max(product(cfg["BM"], cfg["BN"]), updates, loss))


def variant(dtype: str, cfg: dict, layout: Layout, momentum: bool, weight_decay: bool,
            stamps: bool = False) -> rt.Variant:
    return rt.Variant("persistent.cu", "train_steps", (
        rt.DT_CODE[dtype], layout.layers, layout.inputs, layout.hidden, layout.classes, layout.batch,
        cfg["BM"], cfg["BN"], cfg["BK"], cfg["BR"], cfg["BR0"], cfg["BC"], cfg["BL"], cfg["SPLIT_K"],
        32 * cfg["num_warps"], int(momentum), int(weight_decay), int(stamps)))


@dataclass
class Plan:
    """The Triton twin's Plan for train_steps: `run(steps)` launches a segment from the position
    the device holds, capturable (no allocation, no device value read on the host)."""

    layout: Layout
    config: dict
    programs: int
    variant: rt.Variant
    device: int
    smem: int
    head: tuple  # the kernel's arguments before `steps`
    tail: tuple  # and after
    counter: torch.Tensor
    tile_counts: torch.Tensor  # the first layer's split slices' (slice_counts), zero between launches
    tag: tuple
    tensors: tuple  # what the pointers point to, alive as long as the plan
    stamps: torch.Tensor | None

    def run(self, steps: int) -> None:
        check_segment(self.layout.layers, steps, self.programs, self.stamps)
        self.counter.zero_()
        rt.launch(self.variant, self.device, (self.programs, 1, 1), (32 * self.config["num_warps"], 1, 1),
                  self.head + (rt.i32(steps),) + self.tail, self.smem, for_=self.tag)


def plan(x: torch.Tensor, y: torch.Tensor, batches: torch.Tensor, pos: torch.Tensor, params: torch.Tensor,
         bufs: torch.Tensor | None, losses: torch.Tensor, layout: Layout, *, lr: float, momentum: float = 0.0,
         weight_decay: float = 0.0, config: dict | None = None, stamps: torch.Tensor | None = None) -> Plan:
    """The launch that trains `params` (flat fp32, `layout`'s order; `bufs` likewise, or None
    without momentum) on x[batches[s]], y[batches[s]] for the slots s = *pos, *pos + 1, ... (mod
    the epoch's steps) a run asks for, each step's mean loss into losses[s], and advances *pos.
    x: (images, inputs) in the compute dtype; y: int64 labels; batches: (epoch's steps, batch)
    int64, the trainer's permutation as rows; pos: an int64 device scalar (trainer.data.DeviceBatches').
    stamps (int64): each launch writes the clock (ns) at its start and after each barrier."""
    cfg = resolve_config(config)
    for name, t in (("x", x), ("y", y), ("batches", batches), ("pos", pos), ("params", params), ("losses", losses),
                    ("stamps", stamps)):
        if t is not None:
            rt.check_cuda(name, t)
    dtype = check_inputs(x, batches, pos, params, bufs, losses, layout, momentum)
    if y.dtype != torch.int64:  # the kernel reads 8-byte labels
        raise ValueError(f"y: {y.dtype}, expected int64 labels")
    dev = x.device.index
    smem = smem_bytes(cfg, layout)
    limit = rt.device_props(dev)[1]
    if smem > limit:
        raise ValueError(f"config: a block needs {smem} bytes of shared memory (tiles BM={cfg['BM']}, BN={cfg['BN']}, "
                         f"BK={cfg['BK']}, BR={cfg['BR']}, BR0={cfg['BR0']}, BC={cfg['BC']}, BL={cfg['BL']}), the GPU "
                         f"allows {limit}; ask for smaller tiles")
    threads = 32 * cfg["num_warps"]
    programs = cfg["PROGRAMS"] or rt.sm_count(dev)
    kernel = variant(dtype, cfg, layout, bool(momentum), bool(weight_decay), stamps is not None)
    fn = rt.function(kernel, dev, smem)
    with rt.cupy().cuda.Device(dev):
        per_sm = blocks_per_sm(fn.kernel.ptr, threads, smem)
    check_coresident("persistent kernel", programs, per_sm, rt.sm_count(dev))
    m = layout.batch
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    acts = torch.empty(layout.activation_elems, dtype=x.dtype, device=x.device)
    grads = torch.empty(layout.gradient_elems, dtype=x.dtype, device=x.device)
    part = torch.empty(cfg["SPLIT_K"] * m * layout.hidden if cfg["SPLIT_K"] > 1 else 1, dtype=torch.float32,
                       device=x.device)
    tile_counts = torch.zeros(slice_counts(layout, cfg), dtype=torch.int32, device=x.device)
    slots = torch.empty(cdiv(m, cfg["BL"]), dtype=torch.float32, device=x.device)
    tensors = (x, y, batches, params, bufs if momentum else params, acts, grads, part, tile_counts, slots, losses,
               counter, pos, counter if stamps is None else stamps)
    tail = (rt.i32(batches.shape[0]), rt.f32(lr), rt.f32(momentum), rt.f32(weight_decay), rt.f32(1.0 / m))
    return Plan(layout, cfg, programs, kernel, dev, smem, tuple(rt.ptr(t) for t in tensors), tail, counter,
                tile_counts, rt.tag("persistent", dtype, cfg), tensors, stamps)
