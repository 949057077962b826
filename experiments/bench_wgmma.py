"""The CUDA twin's Hopper matmul, step by step, against cuBLAS in the same run.

Square fp16 and bf16 products (4096^3 and 8192^3 by default: 137 and 1100 GFLOP, compute-bound
by two orders of magnitude) timed for each row of the progression below and for torch.matmul
(cuBLAS), with the L2 flushed before every repetition; the whole list runs --runs times in turn
and each row keeps the median of its runs' medians (one run at 0.2 ms per product swings by
+-15% on this machine: experiments/FINDINGS.md, "Timing method"). Every result is checked against cuBLAS's before it is
timed.

The progression (one config of the one wgmma kernel per step, and the mma.sync kernel first):
  mma.sync       matmul_tc.cu's default: ldmatrix + mma.sync m16n8k16, 4-stage cp.async
  wgmma-1wg      TMA + wgmma, one consumer warpgroup of 64 x 128, 2 stages
  +stages        the same, 4 stages
  +tile          128 x 128 per consumer (two m64 slabs), 4 stages
  +2 consumers   two consumer warpgroups on 128 x 256 (setmaxnreg moves the producer's registers)
  +order         the same with GROUP_M = 8 (neighbouring blocks share B tiles in L2)

    python -m experiments.bench_wgmma                      # -> experiments/results/<gpu>/wgmma.csv
    python -m experiments.bench_wgmma --sizes 4096 --runs 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch

from kernels_core.provenance import provenance
from kernels_core.timing import bench
from experiments.paths import results_dir

_W = {"WGMMA": 1, "BLOCK_K": 64, "SPLIT_K": 1}
STEPS = [
    ("mma.sync", None),
    ("wgmma-1wg", {**_W, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "GROUP_M": 1}),
    ("+stages", {**_W, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 1}),
    ("+tile", {**_W, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 1}),
    ("+2 consumers", {**_W, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4, "GROUP_M": 1}),
    ("+order", {**_W, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4, "GROUP_M": 8}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,8192", help="square sizes, comma-separated (default 4096,8192)")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--runs", type=int, default=5, help="passes over the whole list (default 5)")
    ap.add_argument("--extra", default="", help="more rows: label=JSON config;... (e.g. a tuned winner)")
    ap.add_argument("--out", type=Path, default=None, help="CSV (default experiments/results/<gpu>/wgmma.csv)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_wgmma needs a CUDA GPU.", file=sys.stderr)
        return 2
    import json

    import kernels_cuda as kc

    steps = STEPS + [(s.split("=", 1)[0], json.loads(s.split("=", 1)[1])) for s in args.extra.split(";") if s]
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    gen = torch.Generator(device="cuda").manual_seed(0)
    times: dict[tuple, list[float]] = {}
    cases = []
    for size in (int(s) for s in args.sizes.split(",")):
        for name in args.dtypes.split(","):
            a = torch.randn(size, size, device="cuda", generator=gen).to(dtypes[name])
            b = torch.randn(size, size, device="cuda", generator=gen).to(dtypes[name])
            ref = torch.matmul(a, b)
            out = torch.empty_like(ref)
            calls = [("cuBLAS", None, lambda a=a, b=b, out=out: torch.matmul(a, b, out=out))]
            for label, cfg in steps:
                kc.matmul(a, b, out=out, config=cfg)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    raise SystemExit(f"{label} {name} {size}: relative error {err:.3g} against cuBLAS")
                calls.append((label, cfg, lambda a=a, b=b, out=out, cfg=cfg: kc.matmul(a, b, out=out, config=cfg)))
            cases.append((size, name, calls))
    for run in range(args.runs):
        for size, name, calls in cases:
            for label, cfg, fn in calls:
                t = bench(fn, reps=20 if size <= 4096 else 8, max_seconds=1.0)
                times.setdefault((size, name, label), []).append(t.median_ms)
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
    prov = provenance()
    rows = []
    for size, name, calls in cases:
        cublas = statistics.median(times[(size, name, "cuBLAS")])
        for step, (label, cfg, _) in enumerate(calls):
            runs = times[(size, name, label)]
            ms = statistics.median(runs)
            rows.append({**prov, "size": size, "dtype": name, "step": step, "label": label,
                         "config": json.dumps(cfg) if cfg else "", "time_ms": ms, "min_run_ms": min(runs),
                         "max_run_ms": max(runs), "runs": len(runs), "tflops": 2 * size**3 / ms / 1e9,
                         "vs_cublas": cublas / ms})
    table = pd.DataFrame(rows)
    out = args.out or results_dir() / "wgmma.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    print(table[["size", "dtype", "label", "time_ms", "tflops", "vs_cublas"]].to_string(index=False))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
