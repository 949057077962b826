"""Is the trainer's timed loop host-bound? For the seed protocol's step at H = 128, per backend:
host µs per graph replay (A), the step times of an event pair per step as the trainer took them
before it timed groups of steps (B), the host µs of an event pair alone (C), the
GPU-bound step time, one event pair around 2000 replays (D), one replay's host µs on an idle GPU (E).

    PYTHONPATH=. python experiments/host_probe.py STORE BACKEND[,BACKEND...] [after-compile]

B times the per-step pair it was; trainer.stepper.StepTimer now times groups of steps.
"""
import statistics
import sys
import time
from dataclasses import replace

import torch

from experiments.compare import base_config
from trainer.train import build

N = 2000


def main(argv):
    store, names = argv[0], argv[1].split(",")
    base = base_config("seed", "fp16", None)
    if len(argv) > 2:  # a compiled torch step built first in this process, as compare's runs do
        cfg = replace(base, backend="torch", hidden=128, compile="default", torch_graph=True, progress=False)
        compiled = build(cfg).stepper
        compiled.prepare(capture=True)
        for _ in range(100):
            compiled()
        torch.cuda.synchronize()
        print("built a torch-compile-graph step first", flush=True)

    for name in names:
        cfg = replace(base, backend=name, hidden=128, tuned_configs=store, progress=False)
        built = build(cfg)
        batches, stepper = built.batches, built.stepper
        stepper.prepare(capture=True)
        batches.new_epoch()
        for _ in range(200):
            stepper()
        torch.cuda.synchronize()
        # A: enqueue N replays, host time, then the drain
        t0 = time.perf_counter()
        for _ in range(N):
            stepper()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        # B: an event pair per step, as the trainer timed steps before section 22
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(N)]
        t3 = time.perf_counter()
        for start, stop in pairs:
            start.record()
            stepper()
            stop.record()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        per = [start.elapsed_time(stop) * 1e3 for start, stop in pairs]
        # C: the event pairs alone
        t5 = time.perf_counter()
        for start, stop in pairs:
            start.record()
            stop.record()
        torch.cuda.synchronize()
        t6 = time.perf_counter()
        # D: GPU throughput, one event pair around N replays
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(N):
            stepper()
        b.record()
        torch.cuda.synchronize()
        # E: one replay on an idle GPU: host µs of the call
        idle = []
        for _ in range(200):
            torch.cuda.synchronize()
            t = time.perf_counter()
            stepper()
            idle.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        q = statistics.quantiles(per, n=10)
        print(f"{name}: A host enqueue {1e6 * (t1 - t0) / N:.1f} µs/replay, wall {1e6 * (t2 - t0) / N:.1f} | "
              f"B events median {statistics.median(per):.1f} (p10 {q[0]:.1f} p90 {q[-1]:.1f}), "
              f"wall {1e6 * (t4 - t3) / N:.1f} | "
              f"C events only host {1e6 * (t6 - t5) / N:.1f} | D GPU-bound {1e3 * a.elapsed_time(b) / N:.1f} | "
              f"E idle replay host {statistics.median(idle):.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
