"""Where a Triton compile's time goes, stage by stage (offline: no GPU needed).

    python -m experiments.compile_stages [--dtypes fp32,fp16] [--configs 8] [--arch 90] [--out CSV]

The tuner's compile pool bounds its workload search (experiments/FINDINGS.md, "Tuner pipeline:
compile pool and timing process"), whose 60 s wants compiles about half as costly. A seeded sample
of the Triton twin's matmul configs is compiled from scratch for `arch` (kernels_triton.reports.
compile_report), each with line info and without, and Triton's own compile timer
(triton.knobs.compilation.listener) gives each stage: make_ir (the Python frontend, to TTIR), ttir,
ttgir, llir (TTGIR to LLVM IR, then LLVM's optimisation), ptx, cubin (ptxas) and store (writing the
cache). The times are this machine's CPU's; a GPU host's cores differ.

-> experiments/results/<device>/compile_stages.csv: a row per (dtype, config, line_info): the
   stages' seconds, their total, and the provenance columns.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

# Compile in this process rather than interpret: set before Triton is imported (kernels_triton turns
# the interpreter on where no GPU is, and compile_report would then compile in another process, out
# of the listener's sight). A script's module: nothing imports it.
os.environ["TRITON_INTERPRET"] = "0"

import pandas as pd  # noqa: E402
from triton import knobs  # noqa: E402

import kernels_triton  # noqa: E402
from experiments.paths import results_dir  # noqa: E402
from kernels_core.contract import DTYPES  # noqa: E402
from kernels_core.provenance import provenance  # noqa: E402
from kernels_triton.reports import compile_report  # noqa: E402


def stage_seconds(dtype: str, config: dict | None, arch: int, line_info: bool) -> dict[str, float]:
    """One compile of the matmul `config` (None: the default) from scratch: each stage's seconds, and
    their total."""
    seen = []
    with knobs.compilation.scope():
        knobs.compilation.always_compile = True
        knobs.compilation.disable_line_info = not line_info
        knobs.compilation.listener = lambda times, **_: seen.append(times)
        compile_report("matmul", dtype, config, arch)
    (times,) = seen  # one kernel a matmul of a single launch
    return {"make_ir": times.ir_initialization / 1e6, **{stage: us / 1e6 for stage, us in times.lowering_stages},
            "store": times.store_results / 1e6, "total": times.total / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.compile_stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,fp16", help="matmul dtypes (default fp32,fp16)")
    p.add_argument("--configs", type=int, default=8, help="configs sampled a dtype (default 8)")
    p.add_argument("--arch", type=int, default=90, help="compute capability compiled for (default 90)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default experiments/results/<device>/compile_stages.csv")
    args = p.parse_args(argv)
    rows, prov = [], provenance()
    stage_seconds("fp32", None, args.arch, True)  # a process's first compile pays Triton's own start: not a row
    for dtype in args.dtypes.split(","):
        space = kernels_triton.space("matmul", dtype)
        configs = list(space.configs(DTYPES[dtype].itemsize, args.arch))
        for config in random.Random(f"{args.seed}/{dtype}").sample(configs, min(args.configs, len(configs))):
            for line_info in (True, False):
                stages = stage_seconds(dtype, config, args.arch, line_info)
                rows.append({**prov, "dtype": dtype, "arch": args.arch, "config": config, "line_info": line_info,
                             **stages})
                print(f"{dtype} line_info={line_info!s:5} {stages['total']:.3f} s  "
                      + " ".join(f"{k} {v:.3f}" for k, v in stages.items() if k != "total"), flush=True)
    df = pd.DataFrame(rows)
    out = args.out or results_dir() / "compile_stages.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    stages = [c for c in df.columns if c in ("make_ir", "ttir", "ttgir", "llir", "ptx", "cubin", "store", "total")]
    print(df.groupby(["dtype", "line_info"])[stages].mean().round(3).to_string())
    print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
