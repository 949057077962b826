"""Where a graphed step's time goes over a whole run: each op's duration and the gap before it,
inside the CUDA-graph replays the trainer times, from the profiler, 500 replays at a time.

    PYTHONPATH=. python experiments/graph_profile.py BACKEND PROTOCOL HIDDEN STEPS STORE OUT.csv.gz

experiments.profile_step profiles eager steps. This script profiles graph replays, so that a
step's kernels, the gaps between them and the gap between replays can be set against compare's
step time (experiments/FINDINGS.md, "Host side and launch overhead"). The profiler adds time of its own between replays,
so its replay period is an upper bound of the step's GPU time.

OUT gets one row per op and step. OUT with `_summary.csv` in place of `.csv.gz` gets one row per
op (`summarize`), with provenance columns. Both tables are printed as well.
"""
import sys
from collections import Counter
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from experiments.compare import base_config
from kernels_core.provenance import provenance
from trainer.train import build

CHUNK = 500  # replays per profiler session


def align(ev, n, first_step):
    """Events (name, start, end) of n replays as rows (step, pos, ...): the ops whose count is a
    multiple of n are the step's; the rest (an epoch's shuffle, launched between replays) are left out."""
    counts = Counter(name for name, _, _ in ev)
    ops = {name for name, c in counts.items() if c % n == 0}
    kept = [t for t in ev if t[0] in ops]
    per = len(kept) // n
    print(f"steps {first_step}+{n}: {len(ev)} events, {per} a step; left out: "
          f"{ {k: c for k, c in counts.items() if k not in ops} }", flush=True)
    return [dict(step=first_step + i // per, pos=i % per, name=name, start=a, end=b)
            for i, (name, a, b) in enumerate(kept)]


def summarize(d: pd.DataFrame) -> pd.DataFrame:
    """One row per op of the step (rows of `align`, µs): its duration's median, p20, p80 and its
    drift (the spread of its medians over blocks of CHUNK steps), the gap before it, and the
    step's span, kernel sum, replay period and gap between replays (medians). Differences that
    cross two profiler sessions are left out."""
    d = d.assign(dur=d.end - d.start, gap=d.start - d.end.shift(1))
    d.loc[d.pos == 0, "gap"] = np.nan
    steps = d.groupby("step").agg(first=("start", "min"), last=("end", "max"), kernels=("dur", "sum"))
    same_session = (steps.index.to_series().diff() == 1) & (steps.index % CHUNK != 0)
    period = steps["first"].diff()[same_session]
    between = (steps["first"] - steps["last"].shift(1))[same_session]
    g = d.groupby("pos")
    block_medians = d.assign(block=d.step // CHUNK).groupby(["pos", "block"]).dur.median().unstack()
    return pd.DataFrame({
        "op": g.name.first().str[:60],
        "dur_us_median": g.dur.median(), "dur_us_p20": g.dur.quantile(0.2), "dur_us_p80": g.dur.quantile(0.8),
        "dur_us_block_drift": block_medians.max(axis=1) - block_medians.min(axis=1),
        "gap_before_us_median": g.gap.median(),
        "step_span_us_median": (steps["last"] - steps["first"]).median(),
        "kernel_sum_us_median": steps["kernels"].median(),
        "replay_period_us_median": period.median(),
        "gap_between_replays_us_median": between.median(),
    }).reset_index().round(3)


def main(argv):
    backend, protocol, hidden, steps, store, out = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    dtype = "fp16" if protocol == "seed" else "fp32"
    cfg = replace(base_config(protocol, dtype, None), backend=backend, hidden=hidden, tuned_configs=store,
                  progress=False)
    built = build(cfg)
    batches, stepper = built.batches, built.stepper
    stepper.prepare(capture=True)
    batches.new_epoch()
    torch.cuda.synchronize()
    rows, done, spe = [], 0, batches.steps_per_epoch
    while done < steps:
        n = min(CHUNK, steps - done)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for k in range(n):
                if (done + k) and (done + k) % spe == 0:
                    batches.new_epoch()
                stepper()
            torch.cuda.synchronize()
        ev = sorted(((e.name[:80], e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA), key=lambda t: t[1])
        got = align(ev, n, done)
        if len(got) != n * stepper.ops_per_step:  # an op of the step shared its name with one left out
            sys.exit(f"{len(got) // n} ops a step kept, the step has {stepper.ops_per_step}")
        rows += got
        done += n
    d = pd.DataFrame(rows)
    d.to_csv(out, index=False)
    summary = summarize(d)
    summary.assign(backend=backend, protocol=protocol, hidden=hidden, dtype=dtype, steps=steps, store=store,
                   **provenance()).to_csv(out.replace(".csv.gz", "_summary.csv"), index=False)
    print(f"== {backend} {protocol} H={hidden}: {len(d)} events, {d.pos.max() + 1} per step")
    print(summary.to_string())
    print("duration per block of 500 steps, per op:")
    blocks = d.assign(dur=d.end - d.start, block=d.step // CHUNK)
    print(blocks.pivot_table(index="pos", columns="block", values="dur", aggfunc="median").round(2).to_string())


if __name__ == "__main__":
    main(sys.argv[1:])
