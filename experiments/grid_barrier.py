"""What one grid-wide barrier costs on this GPU, in each twin: the price of a persistent training
kernel's phases (a GPU machine).

    python -m experiments.grid_barrier [--rounds 2000] [--reps 21]

A persistent kernel that runs whole training steps separates each step's phases (a layer's
forward, the loss, a layer's backward, the update) with barriers across its grid: about ten a
step for 784-128-128-10. Under 20 µs a step, as the fused step's 12 kernels take 45 µs, leaves a
barrier well under 1 µs. No public figure for one on Hopper was found, so it is measured here: a
kernel of nothing but barriers, at 1, 2 and 4 programs of 4 warps an SM (co-resident on any
sm_80+ GPU: 512 threads an SM of 2048, no shared memory), timed as CUDA events around launches
of R and 2R barriers, so that the launch's own cost cancels: (t(2R) - t(R)) / R.

Both twins' barrier is the same: each program's threads meet (bar.sync), one thread adds 1 to a
counter in global memory with release semantics at GPU scope, then reads it with acquire
semantics until every program of this round has arrived (round i: (i + 1) * programs); the
threads meet again. Release orders the program's earlier stores before its arrival, acquire the
later loads after everyone's: what a phase's outputs need to be read by the next phase.

-> experiments/results/<gpu>/grid_barrier.csv: backend, programs_per_sm, programs, rounds,
   us_per_barrier (the median of --reps) with its p20 and p80, and the provenance columns.
"""
from __future__ import annotations

import argparse
import functools
import sys

import pandas as pd
import torch
import triton
import triton.language as tl

from experiments.paths import write_results
from kernels_core.provenance import provenance
from kernels_cuda import _runtime as rt
from kernels_triton.persistent import grid_barrier

WARPS = 4
PROGRAMS_PER_SM = (1, 2, 4)

# The persistent training kernel's barrier itself (kernels_cuda/grid_barrier.cuh), pasted in.
CUDA_SOURCE = rt.source("grid_barrier.cuh") + r"""
extern "C" __global__ void barrier_rounds(u32* counter, int rounds) {
    for (int i = 0; i < rounds; ++i) grid_barrier(counter, (u32)(i + 1) * gridDim.x);
}
"""


@triton.jit
def barrier_rounds(counter_ptr, rounds):
    """`rounds` of the persistent training kernel's barrier across the grid, on a counter zeroed
    before the launch."""
    programs = tl.num_programs(0)
    for i in range(rounds):
        grid_barrier(counter_ptr, (i + 1) * programs)


@functools.cache  # one NVRTC compile for every grid measured
def _cuda_launcher():
    import cupy
    import numpy as np

    fn = cupy.RawModule(code=CUDA_SOURCE).get_function("barrier_rounds")

    def launch(counter: torch.Tensor, programs: int, rounds: int) -> None:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            fn((programs,), (32 * WARPS,), (np.uint64(counter.data_ptr()), np.int32(rounds)))

    return launch


def _triton_launch(counter: torch.Tensor, programs: int, rounds: int) -> None:
    barrier_rounds[(programs,)](counter, rounds, num_warps=WARPS)


def _launch_ms(launch, counter: torch.Tensor, programs: int, rounds: int, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        counter.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(counter, programs, rounds)
        end.record()
        end.synchronize()
        if counter.item() != rounds * programs:  # every program arrived at every barrier, once
            raise RuntimeError(f"counter {counter.item()} after {rounds} barriers of {programs} programs")
        times.append(start.elapsed_time(end))
    return times


def measure(backend: str, programs: int, rounds: int, reps: int) -> dict:
    launch = _triton_launch if backend == "triton" else _cuda_launcher()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    _launch_ms(launch, counter, programs, 2, 3)  # compiles, loads
    once = _launch_ms(launch, counter, programs, rounds, reps)
    twice = _launch_ms(launch, counter, programs, 2 * rounds, reps)
    per = pd.Series([1e3 * (b - a) / rounds for a, b in zip(sorted(once), sorted(twice))])
    return {"us_per_barrier": per.median(), "us_p20": per.quantile(0.2), "us_p80": per.quantile(0.8)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.grid_barrier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2000, help="barriers a launch (default 2000)")
    p.add_argument("--reps", type=int, default=21, help="launches of each length (default 21)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("no CUDA device: the barriers run on a GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, prov = [], provenance()
    for backend in ("triton", "cuda"):
        for per_sm in PROGRAMS_PER_SM:
            row = {**prov, "backend": backend, "programs_per_sm": per_sm, "programs": per_sm * sms,
                   "rounds": args.rounds, **measure(backend, per_sm * sms, args.rounds, args.reps)}
            rows.append(row)
            print(f"{backend}: {row['programs']} programs, {row['us_per_barrier']:.3f} µs a barrier "
                  f"(p20 {row['us_p20']:.3f}, p80 {row['us_p80']:.3f})", flush=True)
    write_results(rows, "grid_barrier.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
