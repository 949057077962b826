"""Where a training step's GPU time goes: its kernels, one row each, from the profiler.

    python -m experiments.profile_step [--backends cuda,triton] [--hidden 128,1024] [--dtype fp32]
        [--protocol default|seed] [--fuse both|yes|no] [--steps 20]

For each backend x width x (fused, unfused), the step is built as the trainer
builds it (tuned configs from <out>/<target>/best.json when there), warmed up,
and `--steps` eager steps run under torch.profiler (CUPTI: kernels launched
through CuPy and Triton count as torch's do). Each GPU operation of the step
gets a row: its name, how many times a step runs it, its device µs per step.
The device time is the kernels' own; a graphed step adds a gap of about a
microsecond per kernel, which the sum of the rows leaves out, so compare the
sum with the step time of experiments.compare to see the launch overhead.

Writes experiments/results/<gpu>/step_profile.csv (provenance columns included)
and prints the table per step.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import replace

import pandas as pd
import torch

from experiments.compare import base_config
from kernels_core.provenance import AS_TEXT, provenance
from trainer.train import build
from experiments.paths import results_dir


def profile(config, steps: int) -> list[dict]:
    """Per-kernel rows of `steps` eager steps of `config`, times per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    built = build(config)
    batches, stepper = built.batches, built.stepper
    stepper.prepare(capture=False)
    batches.new_epoch()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            stepper()
        torch.cuda.synchronize()
    count, micros = defaultdict(int), defaultdict(float)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            count[e.name] += 1
            micros[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return [{"kernel": name[:120], "calls_per_step": count[name] / steps, "device_us_per_step": micros[name] / steps}
            for name in sorted(count, key=lambda n: -micros[n])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.profile_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--hidden", default="128,1024")
    ap.add_argument("--protocol", choices=("default", "seed"), default="default")
    ap.add_argument("--dtype", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--fuse", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a GPU: the profile is of device time")
    dtype = args.dtype or ("fp16" if args.protocol == "seed" else "fp32")
    base = base_config(args.protocol, dtype, None)
    fuses = {"both": (True, False), "yes": (True,), "no": (False,)}[args.fuse]
    rows = []
    for backend in args.backends.split(","):
        for h in (int(v) for v in args.hidden.split(",")):
            for fuse in fuses:
                cfg = replace(base, backend=backend, hidden=h, fuse=fuse, progress=False)
                got = profile(cfg, args.steps)
                total = sum(r["device_us_per_step"] for r in got)
                print(f"== {backend} H={h} {dtype} {'fused' if fuse else 'unfused'}: "
                      f"{sum(r['calls_per_step'] for r in got):.0f} ops, {total:.1f} µs of kernels per step")
                for r in got:
                    print(f"   {r['device_us_per_step']:8.2f} µs  x{r['calls_per_step']:<4g} {r['kernel'][:90]}")
                rows += [{"backend": backend, "hidden": h, "dtype": dtype, "protocol": args.protocol, "fused": fuse,
                          **r, **provenance()} for r in got]
    out = results_dir() / "step_profile.csv"
    df = pd.DataFrame(rows)
    if out.exists():  # keep other commits' and settings' rows
        old = pd.read_csv(out, dtype=AS_TEXT)
        keep = ~old.set_index(["backend", "hidden", "dtype", "protocol", "fused", "commit"]).index.isin(
            df.set_index(["backend", "hidden", "dtype", "protocol", "fused", "commit"]).index)
        df = pd.concat([old[keep], df], ignore_index=True)
    df.to_csv(out, index=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
