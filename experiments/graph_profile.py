"""Where a graphed step's time goes over a whole run: each op's duration and the gap before it,
inside CUDA-graph replays of the trainer's step, from the profiler, 500 replays at a time.

    PYTHONPATH=. python experiments/graph_profile.py BACKEND PROTOCOL HIDDEN STEPS STORE OUT.csv.gz

experiments.profile_step profiles eager steps; this one the replays the trainer times, so a
step's kernels, their gaps and the gap between replays can be set against compare's step time
(experiments/NOTES.md, section 22). Prints per-op medians and their drift per 500 steps; OUT
gets one row per op and step.
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
from trainer.train import _build


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


def main(argv):
    backend, protocol, hidden, steps, store, out = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    dtype = "fp16" if protocol == "seed" else "fp32"
    cfg = replace(base_config(protocol, dtype, None), backend=backend, hidden=hidden, tuned_configs=store,
                  progress=False)
    _, _, _, _, batches, stepper = _build(cfg)
    stepper.prepare(capture=True)
    batches.new_epoch()
    torch.cuda.synchronize()
    chunks = []
    spe = batches.steps_per_epoch
    done = 0
    while done < steps:
        n = min(500, steps - done)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for k in range(n):
                if (done + k) and (done + k) % spe == 0:
                    batches.new_epoch()
                stepper()
            torch.cuda.synchronize()
        ev = sorted(((e.name[:80], e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA), key=lambda t: t[1])
        chunks += align(ev, n, done)
        done += n
    d = pd.DataFrame(chunks)
    d["dur"] = d.end - d.start
    d["gap"] = d.start - d.end.shift(1)
    d.loc[d.pos == 0, "gap"] = np.nan
    d.to_csv(out, index=False)
    g = d.groupby("pos")
    summary = pd.DataFrame({"name": g.name.first(), "dur_med": g.dur.median(), "dur_p20": g.dur.quantile(.2),
                            "dur_p80": g.dur.quantile(.8), "dur_p95": g.dur.quantile(.95),
                            "gap_med": g.gap.median(), "gap_p95": g.gap.quantile(.95)})
    print(f"== {backend} {protocol} H={hidden}: {len(d)} events, {d.pos.max() + 1} per step")
    print(summary.round(2).to_string())
    span = d.groupby("step").apply(lambda s: s.end.max() - s.start.min())
    print("step span median/p20/p80/p95:", np.percentile(span, [50, 20, 80, 95]).round(2))
    print("span by 500:", [round(float(np.median(span.values[i:i + 500])), 1) for i in range(0, len(span), 500)])
    bysum = d.groupby("step").dur.sum()
    print("kernel sum by 500:", [round(float(np.median(bysum.values[i:i + 500])), 1)
                                 for i in range(0, len(bysum), 500)])
    first, last = d[d.pos == 0].set_index("step").start, d[d.pos == d.pos.max()].set_index("step").end
    print("replay period median:", round(float(first.diff().median()), 2),
          " gap between replays median:", round(float((first.shift(-1) - last).median()), 2))
    by_chunk = d.assign(chunk=d.step // 500)
    print("dur by 500 steps, per op:")
    print(by_chunk.pivot_table(index="pos", columns="chunk", values="dur", aggfunc="median").round(2).to_string())
    print("gap by 500 steps, per op:")
    print(by_chunk.pivot_table(index="pos", columns="chunk", values="gap", aggfunc="median").round(2).to_string())


if __name__ == "__main__":
    main(sys.argv[1:])
