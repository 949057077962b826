"""Where a kernel's warps wait: each stall reason's share of Nsight Compute's warp-state samples
over one launch, read from the report's source page (a GPU machine with ncu).

    ncu --clock-control none -k regex:train_steps --launch-skip 5 --launch-count 1 \\
        --section SourceCounters -o cuda python -m experiments.persistent_configs --backends cuda \\
        --protocol default --configs tuned --tuned-configs STORE --reps 1
    ncu -i cuda.ncu-rep --page source --csv --print-source sass > cuda_sass.csv
    python -m experiments.ncu_stalls cuda_sass.csv --label "persistent, default protocol, tuned"

(persistent_configs launches the kernel once a step for its first CHECK_STEPS = 5 steps, then once
an epoch a rep: launch 5 is the first epoch.) The samples of every instruction are summed by
reason (`stall_barrier`: at a __syncthreads, where a grid barrier's other threads wait for the
one that spins; `stall_no_inst`: the instruction cache; `stall_long_sb`: a global load;
`stall_short_sb`: shared memory; ...).

-> experiments/results/<gpu>/ncu_stalls.csv (rows added): label, kernel, reason, samples, share
   (of the launch's samples), then provenance.
"""
from __future__ import annotations

import argparse
import csv
import sys

from experiments.paths import add_results
from kernels_core.provenance import provenance

PREFIX = "stall_"


def stall_shares(path: str) -> tuple[str, dict[str, float]]:
    """(kernel name, {reason: samples}) of ncu's `--page source --csv` export at `path`: a line
    naming the kernel, then the header and one row per SASS instruction."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"]
    if len(starts) != 1:
        raise ValueError(f"{path}: expected one kernel's source page (ncu --page source --csv), found {len(starts)}")
    kernel, header = rows[starts[0]][1], rows[starts[0] + 1]
    reasons = {i: h[len(PREFIX):] for i, h in enumerate(header) if h.startswith(PREFIX) and "Not Issued" not in h}
    if not reasons:
        raise ValueError(f"{path}: no stall columns (profile with --section SourceCounters)")
    samples = dict.fromkeys(reasons.values(), 0.0)
    for row in rows[starts[0] + 2:]:
        if len(row) == len(header):
            for i, reason in reasons.items():
                samples[reason] += float(row[i] or 0)
    return kernel, samples


def without_parameters(kernel: str) -> str:
    """`void f<(int)0, (int)2>(float *, int)` -> `void f<(int)0, (int)2>`."""
    return kernel.split(">(")[0] + ">" if ">(" in kernel else kernel.split("(")[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source_csv", help="ncu -i REPORT --page source --csv --print-source sass, saved")
    p.add_argument("--label", required=True, help="what the launch was (twin, protocol, config)")
    args = p.parse_args(argv)
    try:
        kernel, samples = stall_shares(args.source_csv)
    except (OSError, ValueError) as e:
        p.error(str(e))
    total = sum(samples.values())
    if total == 0:
        p.error(f"{args.source_csv}: no samples")
    rows = [dict(label=args.label, kernel=without_parameters(kernel), reason=r, samples=int(s), share=s / total,
                 **provenance()) for r, s in sorted(samples.items(), key=lambda x: -x[1]) if s > 0]
    for r in rows:
        print(f"{r['reason']:>18} {r['share']:6.1%}")
    add_results(rows, "ncu_stalls.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
