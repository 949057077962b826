"""Where a small GEMM's microseconds go: both twins at one config, K swept, cuBLAS alongside.

    python -m experiments.ksweep [--mn 32x1024] [--layouts nn,nt] [--ks 64,128,256,512,1024,2048]
        [--configs '[{"BLOCK_M": 16, ...}, ...]'] [--twins cuda,triton] [--dtype fp16] [--rounds 3] [--out CSV]

Every case is timed as the benchmark times the trainer's GEMMs (kernels_core.timing.bench_in_graph:
ten calls replayed as one CUDA graph), once per round, all cases in turn within a round, after a
check against float64 (experiments.bench_kernels.check). A twin's time over K is about
fixed + steps * per_step, steps = ceil(K / BLOCK_K): the least-squares line through a config's
points (medians over the rounds) splits what a launch costs whatever K (launch, prologue, epilogue)
from what one k step costs. At the same config in both twins the two lines say which part of the
CUDA twin's kernel is the slower one. Each twin's `relu` of 1024 elements is timed too: the floor
of one launch of that twin inside a graph.

-> results/<device>/ksweep.csv, a row per case and round with provenance; the fits printed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments.bench_kernels import Case, check, make_call
from kernels_core import backends as kernel_packages
from kernels_core.provenance import provenance
from kernels_core.reference import native
from kernels_core.timing import bench_in_graph
from experiments.paths import results_dir

# Triton's winners at 32 x 1024 (seed protocol, H = 1024) and the tile the CUDA twin's take there, in
# configs both spaces hold (Triton's has no one-warp blocks).
CONFIGS = (
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "num_stages": 4},
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2, "num_stages": 3},
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2, "num_stages": 4},
)
TWINS = ("cuda", "triton")


def label(cfg: dict) -> str:
    threads = f"w{cfg['num_warps']}" if "num_warps" in cfg else f"t{cfg['THREAD_M']}x{cfg['THREAD_N']}"
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} {threads} s{cfg['num_stages']}"


def fit(times: pd.DataFrame) -> pd.DataFrame:
    """Per (layout, backend, config): the least-squares line us = fixed_us + steps * step_us
    through the median of each K's rounds, and its largest residual."""
    med = times.groupby(["layout", "backend", "config", "K", "steps"], as_index=False)["us"].median()
    out = []
    for (layout, backend, config), g in med.groupby(["layout", "backend", "config"]):
        step_us, fixed_us = np.polyfit(g["steps"], g["us"], 1)
        resid = g["us"] - (fixed_us + step_us * g["steps"])
        out.append(dict(layout=layout, backend=backend, config=config, fixed_us=fixed_us, step_us=step_us,
                        worst_resid_us=float(resid.abs().max()), points=len(g)))
    return pd.DataFrame(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.ksweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mn", default="32x1024", help="M x N of the output")
    ap.add_argument("--layouts", default="nn,nt")
    ap.add_argument("--ks", default="64,128,256,512,1024,2048")
    ap.add_argument("--configs", default=None, help="JSON list of configs (tunables both twins share)")
    ap.add_argument("--twins", default=",".join(TWINS), help="which twins run the configs (cuBLAS always does)")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"),
                    help="fp32 runs the CUDA twin's SIMT kernel (configs with THREAD_M, THREAD_N)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ksweep needs a CUDA GPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    m, n = (int(v) for v in args.mn.split("x"))
    ks = [int(k) for k in args.ks.split(",")]
    configs = json.loads(args.configs) if args.configs else list(CONFIGS)
    twins = {t: kernel_packages.load(t) for t in args.twins.split(",")}
    gen = torch.Generator(device=device).manual_seed(0)
    calls = []  # (row fields, function of no arguments)
    for t, mod in twins.items():
        x = torch.randn(1024, device=device, generator=gen)
        calls.append((dict(layout="", K=0, steps=0, backend=t, config="relu 1024"), lambda mod=mod, x=x: mod.relu(x)))
    for layout in args.layouts.split(","):
        for k in ks:
            case = Case("ksweep", "matmul", args.dtype, (m, n, k), layout)
            (a, b), kw, _, _ = make_call(case, gen, device)
            takes = [("torch", native.matmul, {}, "cuBLAS", 1)]
            for cfg in configs:
                common = {"GROUP_M": 1, "SPLIT_K": 1, **cfg}
                for t, mod in twins.items():
                    run = {**common, "WGMMA": 0} if t == "cuda" and args.dtype != "fp32" else common
                    takes.append((t, mod.matmul, {"config": run}, label(cfg), cfg["BLOCK_K"]))
            for backend, fn, extra, name, bk in takes:
                _, problem = check(case, fn(a, b, **kw, **extra), (a, b), kw)
                if problem:
                    raise SystemExit(f"ksweep: {backend} {name} {m}x{n}x{k}:{layout}: {problem}")
                calls.append((dict(layout=layout, K=k, steps=math.ceil(k / bk), backend=backend, config=name),
                              lambda fn=fn, a=a, b=b, kw=kw, extra=extra: fn(a, b, **kw, **extra)))
    prov = provenance()
    rows = []
    for r in range(args.rounds):
        for fields, call in calls:
            rows.append({**fields, "M": m, "N": n, "dtype": args.dtype, "round": r, "us": bench_in_graph(call).median_ms * 1e3, **prov})
        print(f"round {r + 1}/{args.rounds}: {len(calls)} cases", file=sys.stderr, flush=True)
    times = pd.DataFrame(rows)
    out = args.out or results_dir() / "ksweep.csv"
    times.to_csv(out, index=False)
    pd.set_option("display.width", 200)
    print(times[times["config"] == "relu 1024"].groupby("backend")["us"].median().rename("launch floor, us"))
    print(fit(times[times["steps"] > 0]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
