"""One whole training step (gather, step, loss record), eager or as one CUDA graph.

The step writes its loss into a per-epoch device tensor at the step's slot
instead of returning it, so the host reads losses once per evaluation, not
once per step, and a captured graph carries the record along. After the
capture (kernels_core.timing.capture), what its warm-up steps did to the weights
and the batch counter is undone, so the run starts from the seed's initial state.
"""
from __future__ import annotations

import time

import torch

from kernels_core import timing
from kernels_core.dependent_launch import dependent_launch
from trainer.data import DeviceBatches

GRAPH_WARMUP = 3


class Stepper:
    def __init__(self, backend, batches: DeviceBatches, losses: torch.Tensor, pdl: str | None = None):
        self.backend, self.batches, self.losses, self.pdl = backend, batches, losses, pdl
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ops_per_step: int | None = None  # counted by prepare() on a GPU

    def eager(self) -> None:
        if hasattr(self.backend, "run"):  # the persistent kernel reads the position and writes the loss itself
            self.backend.run(1)
            return
        with dependent_launch(self.pdl):  # a capture keeps the launches' dependencies as they were made
            if getattr(self.backend, "gathers_batch", False):  # its kernels read the batch's rows themselves
                rows, slot = self.batches.next_rows()
                loss = self.backend.step(self.batches.x, self.batches.y, rows)
            else:
                x, y, slot = self.batches.next()
                loss = self.backend.step(x, y)
            self.losses.index_copy_(0, slot.view(1), loss.view(1).float())

    def prepare(self, capture: bool) -> None:
        """Compile (and capture) before the clock starts; leaves the state as it was.

        On a GPU it also counts the device operations (kernels, memsets, copies) of one eager
        step, `ops_per_step`: what a step costs in launches, the quantity the fused step cuts.
        """
        saved = self.backend.snapshot()
        if capture:
            self.graph = timing.capture(self.eager, warmup=GRAPH_WARMUP)
        else:
            # A backend whose first steps are not yet its steady state says how many there are.
            for _ in range(getattr(self.backend, "warmup_steps", 1)):
                self.eager()
        if self.losses.device.type == "cuda":
            self.ops_per_step = timing.device_ops(self.eager)
        self.backend.restore(saved)
        self.batches.pos.zero_()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.eager()


class StepTimer:
    """Step times without per-step syncs or per-step events: one pair of CUDA events (the host
    clock on a CPU) around each group of up to GROUP consecutive steps, each step's time its
    group's mean.

    Why groups: on the H200's host, replaying a step's graph costs about 19 µs and recording an
    event pair 18-30 µs, so a pair per step made the loop host-bound at the ~40 µs steps of the
    small nets, and the times measured the timer (experiments/NOTES.md, section 22).
    """

    GROUP = 16

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: dict[int, int] = {}  # first slot of a group -> its step count
        if self.cuda:
            self._events = {}
        else:
            self._host: dict[int, float] = {}
            self._t0 = 0.0

    def start(self, first: int) -> None:
        """Before the group of steps whose first slot is `first`."""
        if self.cuda:
            pair = self._events.setdefault(first, (torch.cuda.Event(enable_timing=True),
                                                   torch.cuda.Event(enable_timing=True)))
            pair[0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self, first: int, steps: int) -> None:
        """After the group's `steps` steps."""
        self._spans[first] = steps
        if self.cuda:
            self._events[first][1].record()
        else:
            self._host[first] = (time.perf_counter() - self._t0) * 1e6

    def read_us(self, begin: int, end: int) -> list[float]:
        """Step times of slots [begin, end), each its group's mean, in µs; after a device sync.
        Groups start at `begin` (the loop starts one there) and end by `end`."""
        times: list[float] = []
        first = begin
        while first < end:
            steps = self._spans.pop(first)
            if self.cuda:
                start, stop = self._events[first]
                total = start.elapsed_time(stop) * 1e3
            else:
                total = self._host.pop(first)
            times += [total / steps] * steps
            first += steps
        assert first == end, f"timed groups of slots {begin}..{first} do not end at {end}"
        return times
