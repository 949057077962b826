"""Regenerate the README's results section from the committed CSVs (no hand-typed numbers).

    python -m experiments.report [--gpu h200] [--check]

Rewrites what lies between the markers `<!-- results:begin -->` and
`<!-- results:end -->` in README.md. `--check` exits 1 if the README is stale.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from experiments import compare
from experiments.paths import RESULTS, results_dir
from kernels_core.provenance import AS_TEXT

EXPERIMENTS = Path(__file__).resolve().parent
README = EXPERIMENTS.parent / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def latest(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """The last row of each `by` group: a rerun at a new commit appends rows, and the
    newest measurement is the one to show, not an average across code versions."""
    return df.drop_duplicates(by, keep="last")


def _provenance(df: pd.DataFrame) -> str:
    r = df.iloc[0]
    commits = sorted(df["commit"].astype(str).unique())  # a section's rows may come from several runs
    stack = [f"{name} {r[col]}" for name, col in (("torch", "torch"), ("triton", "triton"), ("cupy", "cupy"),
                                                    ("CUDA", "cuda")) if pd.notna(r[col])]  # a CPU has no CUDA
    return ", ".join([str(r["device"]), str(r["utc"])[:10], *stack,
                      f"commit{'s' * (len(commits) > 1)} {', '.join(commits)}"])


def _table(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(df.columns) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *body])


def _gemm_table(ok: pd.DataFrame) -> pd.DataFrame:
    """The 4096^3 products of a bench_kernels CSV (its `gemm` group), one row per dtype and backend:
    the median over a --repeat run's rounds."""
    gemm = ok[ok.group == "gemm"]
    if gemm.empty:
        return pd.DataFrame()
    gemm = gemm.groupby(["dtype", "backend"], as_index=False, sort=False)[["time_ms", "tflops", "vs_torch"]].median()
    return pd.DataFrame({
        "dtype": gemm.dtype, "backend": gemm.backend, "ms": gemm.time_ms.map("{:.3f}".format),
        "TFLOP/s": gemm.tflops.map("{:.1f}".format), "vs cuBLAS": gemm.vs_torch.map("{:.2f}".format)})


def kernels_section(gpu: str) -> list[str]:
    path = results_dir(gpu) / "kernels.csv"
    if not path.exists():
        return []
    df = pd.read_csv(path, dtype=AS_TEXT)
    ok = df[df.status == "ok"]
    ew = ok[ok.group.isin(["elementwise", "ceiling"])]
    ew_t = pd.DataFrame({
        "op": ew.op, "backend": ew.backend, "config": ew.config_label.fillna(""),
        "ms": ew.time_ms.map(lambda v: f"{v:.3f}" if pd.notna(v) else ""),
        "GB/s": ew.gbps.map("{:.0f}".format), "% of copy": ew.pct_of_copy.map("{:.1f}".format)})
    gemm_t = _gemm_table(ok)
    failed = df[(df.status != "ok") & df.status.notna()]
    lines = [f"### Kernels at their default configs ({_provenance(df)})", "",
             "`python -m experiments.bench_kernels` — 256M fp32 elements; L2 flushed between repetitions.", "",
             "Config labels are as of the commit named; `default` means the default at that commit "
             "(experiments/FINDINGS.md, \"Memory-bound kernels\").", "",
             _table(ew_t), "", "Matmul 4096³ (cuBLAS through torch in the same run; fp32 with TF32 off):", "",
             _table(gemm_t), ""]
    mlp = ok[ok.group == "mlp"]
    if len(mlp):
        values = [c for c in ("vs_torch", "graph_vs_torch") if c in mlp.columns]
        piv = mlp.pivot_table(index=["dtype", "backend"], values=values, aggfunc="median").reset_index()
        for c in values:
            piv[c] = piv[c].map("{:.2f}".format)
        graphed = ("; the graph-replay column times calls replayed in a CUDA graph, the kernels' own time"
                   if "graph_vs_torch" in values else "; this run predates the graph-replay timing")
        lines += [f"MLP-shaped GEMMs ({mlp['shape'].nunique()} shapes: batch 32/128/1024 × 784/1024/4096 → "
                  "10/1024/4096, forward and both backward products): median speed vs cuBLAS. Per call, small "
                  f"shapes measure the Python wrapper's launch cost, not the kernel{graphed} "
                  "(experiments/FINDINGS.md, \"Timing method\").", "",
                  _table(piv.rename(columns={"vs_torch": "per call vs cuBLAS",
                                             "graph_vs_torch": "graph replay vs cuBLAS"})), ""]
    plot = results_dir(gpu) / "roofline.png"
    if plot.exists():
        lines += [f"![kernels vs the measured ceilings]({plot.relative_to(README.parent)})", ""]
    if len(failed):
        lines += [f"{len(failed)} case(s) failed their correctness check and were not timed; see the CSV.", ""]
    return lines


def load_compare(path: Path) -> pd.DataFrame:
    """A compare CSV with every row's speedups (re)computed by compare's own rule: CSVs written before a
    column existed get it, and rows added to a run key since are counted."""
    df = pd.read_csv(path, dtype=AS_TEXT)
    if df.empty:
        return df
    length = compare.protocol_length(df.protocol.iloc[0])
    # Rows from before `run_length` was recorded ran the whole protocol.
    df["run_length"] = df["run_length"].fillna(length) if "run_length" in df else length
    rows = df.to_dict("records")
    compare.add_speedups(rows)
    return pd.DataFrame(rows)


def _speedup(v) -> str:
    return f"{v:.2f}×" if v != "" and pd.notna(v) else ""


def _step_time_table(df: pd.DataFrame, with_accuracy: bool) -> str:
    piv = df.pivot_table(index="variant", columns="hidden", values="median_step_us")
    fastest = df[df.backend == "torch"].sort_values("median_step_us").drop_duplicates("hidden")
    cells = piv.map(lambda v: f"{v:.0f}" if pd.notna(v) else "")
    for r in fastest.itertuples():
        cells.loc[r.variant, r.hidden] = f"**{cells.loc[r.variant, r.hidden]}**"
    cells.columns = [f"H={c} µs" for c in cells.columns]
    if with_accuracy:
        acc = df.pivot_table(index="variant", values="test_accuracy", aggfunc="min")
        cells["min test acc"] = acc.test_accuracy.map("{:.4f}".format)
    if "ops_per_step" in df and df.ops_per_step.notna().any():  # counted since the fused step (section 13)
        ops = df.pivot_table(index="variant", values="ops_per_step", aggfunc="max").ops_per_step
        cells["GPU ops/step"] = ops.reindex(cells.index).map(lambda v: f"{v:.0f}" if pd.notna(v) else "")
    setup = df.pivot_table(index="variant", values="setup_seconds", aggfunc="max")
    cells["max setup s"] = setup.setup_seconds.map("{:.1f}".format)
    return _table(cells.reset_index())


def _speedup_table(df: pd.DataFrame) -> str:
    kernels = df[df.backend != "torch"].sort_values(["hidden", "variant"])
    best_us = kernels.median_step_us * pd.to_numeric(kernels.speedup_vs_best_torch, errors="coerce")
    return _table(pd.DataFrame({
        "H": kernels.hidden, "variant": kernels.variant, "µs": kernels.median_step_us.map("{:.0f}".format),
        # Eager is the fastest torch variant only of a run that timed no other.
        "best torch": [f"{v} ({us:.0f} µs{'; no other torch variant in that run' if v == 'torch-eager' else ''})"
                       if v else "" for v, us in zip(kernels.best_torch_variant, best_us)],
        "vs best torch": kernels.speedup_vs_best_torch.map(_speedup),
        "vs torch eager": kernels.speedup_vs_torch_eager.map(_speedup)}))


def compare_section(gpu: str) -> list[str]:
    lines = []
    for path in sorted(results_dir(gpu).glob("compare_*.csv")) + sorted(results_dir(gpu).glob("trainer_fp*.csv")):
        df = load_compare(path)
        if df.empty:
            continue
        proto, dtype = df.protocol.iloc[0], df.dtype.iloc[0]
        own = compare.protocol_length(proto)
        net = ("seed protocol: 784-H-H-H-10, batch 32, SGD lr 0.003" if proto == "seed"
               else "trainer defaults: 784-H-H-10, batch 128, SGD momentum 0.9")
        for length, run in df.groupby("run_length", sort=False):
            run = latest(run, ["variant", "hidden"])
            full = length == own
            steps = "" if full else f" --steps {length.split()[0]}"
            lines += [f"### Training step time, {net}, "
                      f"{length if full else f'step time only (first {length})'}, {dtype} ({_provenance(run)})", "",
                      f"`python -m experiments.compare --protocol {proto} --dtype {dtype}{steps}` — median step "
                      "time (data gather included); compilation and autotuning excluded from it, and shown as setup "
                      "seconds (the most at any width); in bold the fastest torch variant at each width.", "",
                      _step_time_table(run, with_accuracy=full), ""]
            if (run.backend != "torch").any():
                lines += ["Speedups against the best (fastest) torch variant and against torch eager of the same "
                          "run key (width, protocol, run length, commit):", "", _speedup_table(run), ""]
            for name, alt in (("step_time", "step time vs H"), ("loss_curves", "loss curves")):
                plot = results_dir(gpu) / f"{name}_{dtype}.png"
                if proto == "seed" and full and plot.exists():
                    lines += [f"![{alt}]({plot.relative_to(README.parent)})", ""]
    return lines


def gemms_section(gpu: str) -> list[str]:
    """The trainer's GEMMs, each twin at its default and tuned config, against cuBLAS in the same run
    (bench_kernels --only trainer): CUDA-graph replays, the kernels' own time."""
    path = results_dir(gpu) / "trainer_gemms.csv"
    if not path.exists():
        return []
    df = pd.read_csv(path, dtype=AS_TEXT)
    ok = df[(df.group == "trainer") & (df.status == "ok")]
    if ok.empty:
        return []
    # With --repeat N each case has N rows: their median time stands for it.
    ok = ok.groupby(["dtype", "backend", "shape", "config_label"], as_index=False).graph_ms.median()
    cublas = ok[ok.backend == "torch"].set_index(["dtype", "shape"]).graph_ms
    ok = ok[ok.backend != "torch"]
    ok["x"] = [cublas[(d, s)] / ms for d, s, ms in zip(ok.dtype, ok["shape"], ok.graph_ms)]
    dims = ok["shape"].str.split(":").str[0].str.split("x", expand=True).astype(int)
    ok["small"] = (dims[2] >= 784) & (dims[0] * dims[1] <= 131072)
    summary = []
    for (dtype, backend, label), g in ok.groupby(["dtype", "backend", "config_label"]):
        small = g[g.small]
        summary.append({"dtype": dtype, "backend": backend, "config": label, "shapes": len(g),
                        "median vs cuBLAS": f"{g.x.median():.2f}×",
                        "K ≥ 784, M·N ≤ 131072": f"{small.x.median():.2f}× ({len(small)})" if len(small) else ""})
    tuned = ok[ok.config_label == "tuned"]
    per_shape = tuned.pivot_table(index=["dtype", "shape"], columns="backend", values=["graph_ms", "x"])
    rows = []
    for (dtype, shape), r in per_shape.iterrows():
        row = {"dtype": dtype, "shape": shape, "cuBLAS µs": f"{cublas[(dtype, shape)] * 1e3:.1f}"}
        for backend in ("cuda", "triton"):
            ms, x = r.get(("graph_ms", backend)), r.get(("x", backend))
            row[f"{backend} tuned µs"] = f"{ms * 1e3:.1f} ({x:.2f}×)" if pd.notna(ms) else ""
        rows.append(row)
    lines = [f"### The trainer's GEMMs against cuBLAS ({_provenance(df)})", "",
             "`python -m experiments.bench_kernels --only trainer` (with `,gemm` also matmul 4096³) — every distinct GEMM of both trainer "
             "protocols (fp32: batch 128, 784-H-H-10, H = 128/1024/4096; fp16: batch 32, 784-H-H-H-10, "
             "H = 128...8192), each twin at its default config and, where the tuned store has the shape, its "
             "tuned one; cuBLAS in the same run; CUDA-graph replays of 10 calls (inputs warm in L2, as in a "
             "graphed training step). Medians of cuBLAS time / twin time:", "",
             _table(pd.DataFrame(summary)), ""]
    if rows:
        lines += ["Per shape, tuned (the last column of the summary counts the shapes where one program per "
                  "tile leaves the H200's 132 SMs idle):", "", _table(pd.DataFrame(rows)), ""]
    gemm = _gemm_table(df[df.status == "ok"])
    if len(gemm):
        lines += ["Matmul 4096³ in the same run, default configs (L2 flushed; fp32 with TF32 off):", "",
                  _table(gemm), ""]
    return lines


def wgmma_section(gpu: str) -> list[str]:
    """The CUDA twin's Hopper matmul, step by step against cuBLAS (experiments.bench_wgmma)."""
    path = results_dir(gpu) / "wgmma.csv"
    if not path.exists():
        return []
    df = pd.read_csv(path, dtype=AS_TEXT)
    wide = df.pivot_table(index=["step", "label"], columns=["size", "dtype"], values="vs_cublas", sort=False)
    table = pd.DataFrame({"step": [label for _, label in wide.index]})
    for size, dtype in wide.columns:
        table[f"{size}³ {dtype}"] = [f"{v:.2f}" for v in wide[(size, dtype)]]
    cublas = df[df.label == "cuBLAS"]
    return [f"### CUDA matmul on Hopper: wgmma + TMA ({_provenance(df)})", "",
            f"`python -m experiments.bench_wgmma` — speed against cuBLAS (1.00), median of {int(df.runs.max())} runs, "
            "L2 flushed; cuBLAS: " + ", ".join(f"{r.size}³ {r.dtype} {r.tflops:.0f} TFLOP/s" for r in cublas.itertuples())
            + ".", "", _table(table), ""]


def tuning_section(gpu: str, target: str) -> list[str]:
    # The committed copy of a tuning run (experiments/<target>/ itself is run output, not committed).
    path = results_dir(gpu) / "tuning" / target / "trials.csv"
    if not path.exists():
        return []
    df = pd.read_csv(path, dtype=AS_TEXT)
    if df.empty:
        return []
    counts = df.status.value_counts().to_dict()
    lines = [f"### Tuning ({target}, {_provenance(df)})", "",
             f"`python -m autotune.search --workload mnist-mlp` — {len(df)} trials in "
             f"{df.study.nunique()} studies; outcomes: "
             + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".", ""]
    plot = results_dir(gpu) / "tuned_vs_default.png"
    if plot.exists():
        lines += [f"![tuned vs default]({plot.relative_to(README.parent)})", ""]
    return lines


def _configs(median: float) -> str:
    return "never" if median == float("inf") else f"{median:g}"


def search_section(gpu: str) -> list[str]:
    """The samplers replayed on the full grids (experiments.search_quality), and the workload
    search's default budget against a long run (experiments.search_budget)."""
    lines = []
    summaries = sorted(results_dir(gpu).glob("search_quality*_full_summary.csv"))
    if summaries:
        from experiments import search_quality as sq

        rows = []
        after = (*map(str, sq.CHECKPOINTS), sq.BUDGET_COLUMN)
        for path in summaries:
            grid = pd.read_csv(path.with_name(path.name.replace("search_quality", "search_quality_grid")
                                             .replace("_summary", "")), dtype=AS_TEXT)
            # The best found from the replays' curves cut at the budget the table states: a replay
            # may have run longer (those of 2026-12-01 measured 90 configs of grids whose 10% is 86
            # and 88). The rest as the replay counted it, from times the CSVs keep to 6 digits only.
            curves = pd.read_csv(path.with_name(path.name.replace("_summary", "")), dtype=AS_TEXT)
            seeds = pd.read_csv(path.with_name(path.name.replace("_summary", "_seeds")), dtype=AS_TEXT)
            best = sq.summary_at(curves, seeds, sq.BUDGET_SHARE).set_index(["shape", "sampler"])
            for _, r in pd.read_csv(path, dtype=AS_TEXT).iterrows():
                at = best.loc[(r["shape"], r["sampler"])]
                rows.append({"grid": f"{grid.backend.iloc[0]} {grid.dtype.iloc[0]} {r['shape']} ({r['grid_configs']})",
                             "sampler": r["sampler"], "within 3% in 10%": f"{r['success_3%_in_budget']:.0%}",
                             "median configs to 3%": _configs(r["median_to_3%"]),
                             "within 1% in 10%": f"{r['success_1%_in_budget']:.0%}",
                             f"best after {' / '.join(after)}": " / ".join(f"{at[f'median_best_at_{k}']:.3f}" for k in after)})
        lines += ["### The tuner's samplers on full grids measured on the H200", "",
                  "`python -m experiments.search_quality --grid-csv experiments/results/<gpu>/search_quality_grid_<grid>.csv "
                  "--samplers ... --seeds 100 --budget 0.1`: every valid config timed 3 times on the GPU, then each "
                  "sampler replayed through the tuner's own loop, 100 seeds, a budget of 10% of the grid; a trial is a "
                  "distinct config measured; best found as a ratio to the grid's best (median seed).", "",
                  _table(pd.DataFrame(rows)), ""]
    path = results_dir(gpu) / "search_budget.csv"
    if path.exists():
        df = pd.read_csv(path, dtype=AS_TEXT)
        r = df.iloc[0]
        lines += [f"### Is the default budget enough? ({_provenance(df)})", "",
                  f"`python -m experiments.search_budget -- --workers 10`: `--workload mnist-mlp` (fp32, H = 1024, "
                  f"both twins) at the default {int(r.default_trials)} configs per study took {r.default_wall_s:.0f} s; "
                  f"resumed to {int(r.long_budget)} it took {r.long_wall_s:.0f} s more. The default's winner was within "
                  f"3% of the long run's best (the two re-timed side by side where they differ) in "
                  f"{int(df.within_3pct.sum())} of {len(df)} studies; the others: "
                  + ", ".join(f"{x.op} {x.backend} {x.shape} {x.ratio:.3f}x" for x in df[~df.within_3pct].itertuples())
                  + ".", ""]
    return lines


def accuracy_section() -> list[str]:
    """The seed spread of test accuracy (experiments.accuracy_spread), from every device's CSV."""
    from experiments import accuracy_spread

    lines = []
    for path in sorted(RESULTS.glob("*/accuracy_spread.csv")):
        df = pd.read_csv(path, dtype=AS_TEXT)
        table = accuracy_spread.summary(df).reset_index()
        for col in ("mean", "sd", "min", "max"):
            table[col] = table[col].map("{:.4f}".format)
        lines += [f"### Test accuracy over seeds ({_provenance(df)})", "",
                  "`python -m experiments.accuracy_spread --hidden H --seeds S`: the same protocol and backend, only "
                  "the seed (initial weights, data order) changed from run to run. A twin's run at one seed differs "
                  "from torch's by its roundings, at H = 128 about as much as one seed from another "
                  "(experiments/FINDINGS.md, \"Accuracy and seeds\").", "", _table(table), ""]
    return lines


def render(gpu: str, target: str) -> str:
    lines = (kernels_section(gpu) + wgmma_section(gpu) + tuning_section(gpu, target) + search_section(gpu)
             + gemms_section(gpu) + compare_section(gpu) + accuracy_section())
    if not lines:
        lines = ["No results yet: run the experiments on a GPU (see above)."]
    return "\n".join([BEGIN, "", *lines, END])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--check", action="store_true", help="exit 1 if the README section is stale")
    args = ap.parse_args(argv)
    text = README.read_text()
    if BEGIN not in text or END not in text:
        print(f"README.md lacks the markers {BEGIN} ... {END}", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + render(args.gpu, args.target) + tail
    if args.check:
        return 0 if new == text else 1
    README.write_text(new)
    print("README results section regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
