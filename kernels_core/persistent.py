"""What both twins' persistent training kernel shares: the MLP's parameters as one flat buffer,
the kernel's scratch, the refusals of a plan's config and tensors, and the rule that refuses a
grid whose programs cannot all be resident.

The persistent kernel runs many training steps of 784 -> hidden x layers -> 10 in one launch, its
phases (each layer's forward, the loss, each layer's backward with its SGD update) separated by
barriers across the grid. A grid barrier waits for every program of the grid, so every program
must be running at once: a program that waits for a slot on a multiprocessor held by a program
spinning at the barrier never starts, and the launch never ends. `check_coresident` is the rule;
each twin asks the driver how many of its compiled kernel's blocks fit a multiprocessor.

The parameters, in the order the trainer keeps them (trainer/model.py: W0, b0, W1, b1, ...; each
W stored (in, out) row-major), lie end to end in one fp32 buffer, and the momentum buffers in a
second of the same layout, so the kernel reaches layer l's weights at a fixed offset.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kernels_core import contract
from kernels_core.mlp import MNIST_CLASSES, MNIST_IN
from kernels_core.space import Space


@dataclass(frozen=True)
class Layout:
    """784 -> hidden x layers -> 10 as the kernel sees it; `inputs` and `classes` vary only in tests."""

    hidden: int
    layers: int
    batch: int
    inputs: int = MNIST_IN
    classes: int = MNIST_CLASSES

    @property
    def dims(self) -> list[int]:
        return [self.inputs] + [self.hidden] * self.layers + [self.classes]

    def offsets(self) -> list[tuple[int, int]]:
        """(offset of W_l, offset of b_l) in the flat buffer, for each layer l."""
        out, at = [], 0
        for fan_in, fan_out in zip(self.dims[:-1], self.dims[1:]):
            out.append((at, at + fan_in * fan_out))
            at += fan_in * fan_out + fan_out
        return out

    @property
    def numel(self) -> int:
        return sum(a * b + b for a, b in zip(self.dims[:-1], self.dims[1:]))

    def views(self, flat):
        """[W0, b0, W1, b1, ...] as views of `flat`, each W (in, out)."""
        out = []
        for (w, b), fan_in, fan_out in zip(self.offsets(), self.dims[:-1], self.dims[1:]):
            out += [flat[w:w + fan_in * fan_out].view(fan_in, fan_out), flat[b:b + fan_out]]
        return out

    @property
    def activation_elems(self) -> int:
        """The hidden layers' outputs of one step: layers x batch x hidden."""
        return self.layers * self.batch * self.hidden

    @property
    def gradient_elems(self) -> int:
        """Each layer's output gradient of one step: the hidden layers' and the logits'."""
        return self.layers * self.batch * self.hidden + self.batch * self.classes


def state_bytes(layout: Layout, elt: int, momentum: bool) -> int:
    """What the kernel keeps coming back to across steps: the fp32 weights (and momentum buffers),
    and the activations and gradients of one step in the compute dtype (`elt` bytes)."""
    return 4 * layout.numel * (2 if momentum else 1) + elt * (layout.activation_elems + layout.gradient_elems)


def fits_on_chip(layout: Layout, elt: int, momentum: bool, l2_bytes: int | None) -> bool:
    """Whether that state fits the GPU's L2 cache, where it stays between phases and steps (None:
    no cache to fit, Triton's interpreter)."""
    return l2_bytes is None or state_bytes(layout, elt, momentum) <= l2_bytes


# Both twins' tunables, so a config means the same in either: tile sides (each at least 16, Triton's
# tl.dot's smallest), warps, programs (0: one a multiprocessor), and the first layer's split of its
# K = 784 into SPLIT_K slices. BM x BN: a tile of a layer's output and of a layer's input gradient,
# BK the k-step of their products and the batch's step in a weight gradient; BR x BC: a tile of
# weights a program updates, BR0 x BC one of W_0 (its IN = 784 rows make the most update tiles, and
# they share the step's last phase with W_1's); BL: the loss's rows a tile (with BN columns of the
# last layer's input gradient). Every phase hands its tiles out over the whole grid, so a tile's
# size trades the number of tiles (at most one a program is best) against each tile's chain of
# k-steps.
DEFAULT = dict(BM=32, BN=32, BK=32, BR=32, BR0=32, BC=32, BL=16, num_warps=8, PROGRAMS=0, SPLIT_K=1)
# What the tuner searches (op "persistent", both twins, every dtype): tile sides up to 64 (at
# H = 128 a layer's output is 16 tiles of 32 x 32 for 132 programs: larger tiles only lengthen
# each one's chain), SPLIT_K up to 8 (the first layer's 784 in slices of whole k-steps, as even as they go), one
# program a multiprocessor (fewer programs measured slower: 45.9 µs at 64 against 43.0 at 132,
# H100, h100/persistent_configs.csv). Every config fits a block's shared memory in the CUDA twin
# (70 KB at the largest tiles and a batch of 128: kernels_cuda/persistent.py's smem_bytes).
SPACE = Space(
    params=dict(BM=(16, 32, 64), BN=(16, 32, 64), BK=(16, 32, 64), BR=(16, 32, 64), BR0=(16, 32, 64), BC=(16, 32, 64),
                BL=(16, 32), num_warps=(2, 4, 8), PROGRAMS=(0,), SPLIT_K=(1, 2, 4, 8)),
    default=DEFAULT,
    notes="the persistent training kernel: tiles of each phase, the loss's rows, warps, the first layer's K split",
    inherits={"BR0": "BR"},  # W_0's tiles were the other weights' before they had a tunable of their own
)


def resolve_config(config: dict | None) -> dict:
    """DEFAULT with `config`'s entries (SPACE.with_defaults: a config without BR0 updates W_0 in its
    BR x BC tiles), refused in one line where a twin's kernel has no such tunable or cannot build
    it: tile sides powers of two of at least 16 (Triton's tl.dot's smallest; the CUDA twin's
    threads then divide every tile), 1 to 8 warps a program."""
    cfg = SPACE.with_defaults(config or {})
    unknown = set(cfg) - set(DEFAULT)
    if unknown:
        raise ValueError(f"config: unknown tunables {sorted(unknown)}; the persistent kernel's are {sorted(DEFAULT)}")
    for name in ("BM", "BN", "BK", "BR", "BR0", "BC", "BL"):
        v = cfg[name]
        if v < 16 or v & (v - 1):
            raise ValueError(f"config: {name}={v}, a tile side must be a power of two of at least 16")
    if cfg["num_warps"] not in (1, 2, 4, 8):
        raise ValueError(f"config: num_warps={cfg['num_warps']}, not 1, 2, 4 or 8")
    if cfg["PROGRAMS"] < 0:
        raise ValueError(f"config: PROGRAMS={cfg['PROGRAMS']}, 0 (one a multiprocessor) or a count")
    if cfg["SPLIT_K"] < 1:
        raise ValueError(f"config: SPLIT_K={cfg['SPLIT_K']}, the first layer's slices: at least 1")
    return cfg


def slice_counts(layout: Layout, cfg: dict) -> int:
    """Counters the first layer's split forward needs, one a BM x BN tile of its output: its
    slices arrive there, and the last to arrive sums them (each twin's kernel). Zeroed once; every
    launch leaves them at zero."""
    return contract.cdiv(layout.batch, cfg["BM"]) * contract.cdiv(layout.hidden, cfg["BN"])


def check_inputs(x: torch.Tensor, batches: torch.Tensor, pos: torch.Tensor, params: torch.Tensor,
                 bufs: torch.Tensor | None, losses: torch.Tensor, layout: Layout, momentum: float) -> str:
    """Refuses, in one line, tensors a twin's `plan` cannot train on (its docstring says what each
    holds); returns x's dtype name."""
    if x.dim() != 2 or x.shape[1] != layout.inputs or not x.is_contiguous():
        raise ValueError(f"x: {tuple(x.shape)}, expected a contiguous (images, {layout.inputs})")
    dtype = contract.dtype_name(x.dtype)
    if batches.dtype != torch.int64 or batches.dim() != 2 or batches.shape[1] != layout.batch:
        raise ValueError(f"batches: {batches.dtype} {tuple(batches.shape)}, expected int64 (steps, {layout.batch})")
    if params.dtype != torch.float32 or params.numel() != layout.numel or not params.is_contiguous():
        raise ValueError(f"params: {params.dtype} with {params.numel()} elements, expected {layout.numel} fp32")
    if momentum and (bufs is None or bufs.shape != params.shape or bufs.dtype != torch.float32):
        raise ValueError("bufs: momentum needs an fp32 buffer shaped like params")
    if pos.dtype != torch.int64 or pos.numel() != 1:
        raise ValueError(f"pos: {pos.dtype} ({pos.numel()} elements), expected one int64")
    if losses.dtype != torch.float32 or losses.numel() < batches.shape[0]:
        raise ValueError(f"losses: {losses.dtype} ({losses.numel()},), expected fp32 with one entry a step")
    return dtype


def check_coresident(what: str, programs: int, per_sm: int, sms: int) -> None:
    """Refuses, in one line, a grid that a grid barrier would deadlock: more programs than the
    GPU's `sms` multiprocessors hold at once, `per_sm` each (the compiled kernel's occupancy)."""
    if programs < 1:
        raise ValueError(f"config: {what}: a grid of {programs} programs")
    if programs > per_sm * sms:
        raise ValueError(f"config: {what}: {programs} programs cannot all be resident at once (this kernel fits "
                         f"{per_sm} a multiprocessor, {per_sm * sms} on this GPU), and its grid barriers would wait "
                         "forever; ask for fewer programs")


def step_outputs(losses: torch.Tensor, pos: torch.Tensor, first: int, steps: int, epoch: int, layout: Layout,
                 params: torch.Tensor, params_before: torch.Tensor, bufs: torch.Tensor | None = None,
                 bufs_before: torch.Tensor | None = None) -> list[torch.Tensor]:
    """What a segment of `steps` steps from slot `first` of an epoch of `epoch` steps is judged by:
    its losses, how far it moved the position, then each tensor's update (W0, b0, W1, ...: params
    less params_before) and, with momentum, each buffer's. Updates, not weights: a weight's error
    next to its size would hide an update gone wrong (a bias never updated moves by far less than
    its rounding)."""
    slots = (torch.arange(steps, device=losses.device) + first) % epoch
    moved = [layout.views(params - params_before)] + ([layout.views(bufs - bufs_before)] if bufs is not None else [])
    return [losses.index_select(0, slots), (pos.double() - first).view(1)] + [t for views in moved for t in views]


def barriers_per_step(layers: int) -> int:
    """Grid barriers of one step, one after each phase: each layer's forward (the first layer's
    split slices summed by each tile's last slice to arrive, with no phase of their own), the loss
    with the last layer's input gradient, each hidden layer's input gradient beside the next
    layer's update, the first two layers' updates."""
    return 2 * layers + 1


def check_barrier_count(steps: int, barriers: int, programs: int) -> None:
    """Refuses, in one line, a launch whose barriers would count past a 32-bit counter: each of its
    steps' `barriers` adds one arrival a program, and a count that wrapped would open a barrier
    early (a training segment, at most an epoch, stays far below)."""
    arrivals = steps * barriers * programs
    if steps < 0 or arrivals >= 2**31:
        raise ValueError(f"steps: {steps} in one launch ({arrivals} arrivals at its barriers, past the counter's "
                         f"2**31); launch fewer steps at a time")


def check_stamps(stamps: torch.Tensor, steps: int, barriers: int) -> None:
    """Refuses, in one line, a clock buffer a launch of `steps` steps would overrun: int64, its start
    and one entry a barrier."""
    need = 1 + steps * barriers
    if stamps.dtype != torch.int64 or stamps.numel() < need:
        raise ValueError(f"stamps: {stamps.dtype} ({stamps.numel()},), expected int64 with {need} entries for "
                         f"{steps} steps: the launch's start and one a barrier")


def check_segment(layers: int, steps: int, programs: int, stamps: torch.Tensor | None) -> None:
    """A twin's launch of `steps` steps, refused in one line where its barrier counter would wrap
    or its clock buffer (if any) would overrun."""
    barriers = barriers_per_step(layers)
    check_barrier_count(steps, barriers, programs)
    if stamps is not None:
        check_stamps(stamps, steps, barriers)


def phase_names(layers: int) -> list[str]:
    """What each phase of a step does, in order (barriers_per_step's phases)."""
    names = [f"forward {l}" for l in range(layers)] + [f"loss, input grad {layers}"]
    names += [f"input grad {l}, update {l + 1}" for l in range(layers - 1, 0, -1)] + ["update 1, update 0"]
    return names


@functools.cache
def _occupancy_fn():
    fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def blocks_per_sm(function: int, threads: int, smem: int) -> int:
    """How many blocks of a loaded kernel (its CUfunction handle) one multiprocessor holds at once,
    `threads` threads and `smem` bytes of dynamic shared memory each: the driver's answer, from the
    kernel's registers and shared memory."""
    n = ctypes.c_int()
    rc = _occupancy_fn()(ctypes.byref(n), ctypes.c_void_p(function), threads, smem)
    if rc:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUresult {rc}")
    return n.value
