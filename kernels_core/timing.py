"""The one timing helper of the lab: tuner, benchmarks and trainer all use it.

On a GPU every repetition is bracketed by CUDA events on the current stream,
after a write of a buffer larger than L2 (so each repetition reads its inputs
from device memory, as a kernel in a real step would after other work) unless
`flush_l2=False`. On a CPU (Triton interpreter, tests) a host clock is used.
Reported: median, p20 and p80 in milliseconds over the repetitions.

Why not `triton.testing.do_bench` / `do_bench_cudagraph`, which do the same
on a GPU: this module is the neutral core's, which imports neither Triton
nor CuPy (the CUDA twin and the trainer time through it too); the tuner needs
an early stop by measured seconds so a slow candidate cannot stall a search;
and the CPU (interpreter) path times with the host clock, where do_bench
needs a device.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

_FLUSH_BYTES = 256 * 1024 * 1024  # > 4x the 60 MB L2 of an H100/H200
_flush_buffers: dict[int, torch.Tensor] = {}


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    def as_row(self) -> dict[str, float]:
        return {"time_ms": self.median_ms, "time_p20_ms": self.p20_ms, "time_p80_ms": self.p80_ms, "reps": self.reps}

    def per(self, units: int) -> "Timing":
        """The time of one of `units` units of work a timed call did (a persistent launch's steps)."""
        return Timing(self.median_ms / units, self.p20_ms / units, self.p80_ms / units, self.reps)


def _quantiles(samples: list[float], reps: int) -> Timing:
    samples = sorted(samples)
    q = statistics.quantiles(samples, n=5, method="inclusive") if len(samples) > 1 else samples * 4
    return Timing(statistics.median(samples), q[0], q[3], reps)


def _flush_buffer(device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _flush_buffers:
        _flush_buffers[index] = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return _flush_buffers[index]


def bench(
    fn: Callable[[], object],
    *,
    device: torch.device | str | None = None,
    warmup: int = 10,
    reps: int = 100,
    max_seconds: float = 2.0,
    flush_l2: bool = True,
) -> Timing:
    """Time `fn()` (which must already be correct: check before timing).

    Repetitions stop early once `max_seconds` of measured work has run, so a
    slow candidate cannot stall a search; at least 5 repetitions always run.
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type != "cuda":
        return _bench_host(fn, warmup=min(warmup, 2), reps=reps, max_seconds=max_seconds)

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    flush = _flush_buffer(device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    samples: list[float] = []
    spent = 0.0
    done = 0
    # Time in batches so the early stop needs one sync per batch, not per rep.
    while done < reps:
        batch = range(done, min(reps, done + 10))
        for i in batch:
            if flush is not None:
                flush.fill_(i)
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        new = [starts[i].elapsed_time(ends[i]) for i in batch]
        samples.extend(new)
        spent += sum(new) / 1000.0
        done = batch.stop
        if done >= 5 and spent > max_seconds:
            break
    return _quantiles(samples, len(samples))


def _bench_host(fn, *, warmup: int, reps: int, max_seconds: float) -> Timing:
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000.0)
        if len(samples) >= 3 and time.perf_counter() > deadline:
            break
    return _quantiles(samples, len(samples))


def capture(step: Callable[[], object], *, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """`step` captured in a CUDA graph, after `warmup` eager runs on a side
    stream (PyTorch's recipe: they compile kernels and settle allocations
    outside the capture). The warm-up runs are real runs: undo their effects
    if they matter. `step` must be capturable (no syncs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def bench_graph(step: Callable[[], object], *, steps: int = 200, warmup: int = 3) -> Timing:
    """Time replays of `step` captured once in a CUDA graph (per-replay times).

    For work made of many small launches: replays remove the CPU launch gaps
    that would otherwise dominate.
    """
    graph = capture(step, warmup=warmup)
    return bench(graph.replay, warmup=warmup, reps=steps, flush_l2=False, max_seconds=10.0)


def bench_in_graph(call: Callable[[], object], *, calls: int = 10, reps: int = 100) -> Timing:
    """GPU time of one `call` of a small kernel, without the host's launch path.

    `calls` calls are captured in one CUDA graph and its replays timed, divided
    by `calls`: a 5 µs kernel then reports its own time, not the Python wrapper
    around it (which a training step replayed as a graph does not pay either).
    Inputs stay in L2 between calls, as they do inside a training step.
    """
    return bench_graph(lambda: [call() for _ in range(calls)], steps=max(5, reps // 5)).per(calls)


def device_ops(call: Callable[[], object]) -> int:
    """How many operations (kernels, memsets, copies) one eager `call` puts on the GPU, counted
    by the profiler (CUPTI), so kernels launched through CuPy or Triton count as torch's do.
    In a CUDA graph each is a node: at a few µs apiece, the count bounds small steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        # torch's note that a profiler cycle keeps only its own events: what this count wants, and
        # noise on the trainer's stderr, whose messages are one line each.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
