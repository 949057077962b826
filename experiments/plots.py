"""PNG plots next to the CSVs in experiments/results/<gpu>/, for one GPU.

    python -m experiments.plots [--gpu h200]

- step_time_<protocol>.png: step time vs H per variant (log-log), and
  beneath it the speedup vs the fastest torch variant at each width (named
  above that panel) and vs torch eager (compare_*.csv for the seed protocol,
  trainer_*.csv for the default one; a step-time-only run of N steps gets its
  own, step_time_<protocol>_<N>steps.png);
- persistent_widths.png: the persistent training kernel's step time against
  the fused step's over H, both protocols (the newest run with a persistent
  variant in the compare CSVs);
- loss_curves_<dtype>.png: every variant's loss curve overlaid;
- tuned_vs_default.png: speedup of each tuned kernel over its default
  config (best.json in --tuning-dir, default experiments/results/<gpu>/tuning/<target>/);
- roofline.png: the kernels against the measured ceilings
  (kernels.csv).
A plot whose input is missing is skipped with a message.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments import compare  # noqa: E402
from experiments.bench_kernels import TORCH_TF32, copy_ceiling  # noqa: E402
from experiments.paths import results_dir  # noqa: E402
from experiments.report import load_compare  # noqa: E402
from kernels_core.mlp import PROTOCOLS  # noqa: E402
from kernels_core.provenance import AS_TEXT  # noqa: E402



def latest(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """The last row of each `by` group: a compare CSV gains rows as code changes, and a plot of it
    shows the newest measurement, not an average across code versions."""
    return df.drop_duplicates(by, keep="last")


def step_time_name(protocol: str, length: str) -> str:
    """The step-time plot of a protocol's runs of one length (a step-time-only run's is named for it)."""
    own = compare.protocol_length(protocol)
    return f"step_time_{protocol}{'' if length == own else '_' + length.replace(' ', '')}.png"


def step_time(folder: Path) -> list[Path]:
    """From the compare CSVs in `folder`, into it (experiments.headline draws its own run's)."""
    made = []
    for path in sorted(folder.glob("compare_*.csv")) + sorted(folder.glob("trainer_fp*.csv")):
        df = load_compare(path)
        if df.empty:
            continue
        dtype, protocol = df.dtype.iloc[0], df.protocol.iloc[0]
        p = PROTOCOLS[protocol]
        for length, run in df.groupby("run_length", sort=False):
            run = latest(run, ["variant", "hidden"])
            fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(7, 9), sharex=True, height_ratios=(2, 1, 1))
            for variant, g in run.groupby("variant"):
                g = g.sort_values("hidden")
                top.plot(g.hidden, g.median_step_us, marker="o", label=variant)
                mid.plot(g.hidden, pd.to_numeric(g.speedup_vs_best_torch, errors="coerce"), marker="o")
                bottom.plot(g.hidden, pd.to_numeric(g.speedup_vs_torch_eager, errors="coerce"), marker="o")
            exact = run[(run.backend == "torch") & ~run.variant.map(compare.lower_precision)]  # as the speedups
            fastest = exact.sort_values("median_step_us").drop_duplicates("hidden")
            widths = fastest.sort_values("hidden").groupby("variant", sort=False).hidden
            mid.set_title("fastest torch: " + "; ".join(f"{v} at H={', '.join(map(str, hs))}" for v, hs in widths),
                          fontsize=8)
            top.set(xscale="log", yscale="log", ylabel="median step time (µs)",
                    title=f"MNIST MLP {p.net}, batch {p.batch_size}, {dtype}, {length}, {df.device.iloc[0]}")
            top.legend(fontsize=8)
            mid.set(ylabel="speedup vs the\nfastest torch variant")
            bottom.set(xscale="log", xlabel="hidden width H", ylabel="speedup vs torch eager")
            for ax in (top, mid, bottom):
                ax.grid(True, which="both", alpha=0.3)
            for ax in (mid, bottom):
                ax.axhline(1.0, color="grey", lw=0.8)
            made.append(save(fig, folder, step_time_name(protocol, length)))
    return made


PERSISTENT_VARIANTS = ("triton-persistent", "cuda-persistent", "triton-tuned", "cuda-tuned")


def persistent_run(df: pd.DataFrame) -> tuple[pd.DataFrame, str] | None:
    """(rows, commit) of the newest run in a compare CSV (its rows of one commit and one run length)
    that has every one of PERSISTENT_VARIANTS at two widths or more (a run at one width draws no
    curve), or None. A row of the same commit at another length (a protocol-length run at one width)
    is another run's."""
    df = df[df.variant.isin(PERSISTENT_VARIANTS)] if not df.empty else df
    if df.empty:
        return None
    run = ["commit", "run_length"]
    widths = df.groupby(run + ["variant"]).hidden.nunique().unstack().reindex(columns=PERSISTENT_VARIANTS)
    over_widths = [key for key in widths.index if (widths.loc[key] >= 2).all()]
    if not over_widths:
        return None
    def in_run(key: tuple[str, str]) -> pd.Series:
        return (df.commit == key[0]) & (df.run_length == key[1])

    newest = max(over_widths, key=lambda key: df.index[in_run(key)].max())  # the newest in the file
    return latest(df[in_run(newest)], ["variant", "hidden"]), newest[0]


def persistent_widths(folder: Path) -> list[Path]:
    """The persistent kernel's step time against the fused step's over H, a panel a protocol
    (persistent_run's rows)."""
    panels = []
    for path in (folder / "trainer_fp32.csv", folder / "compare_fp16.csv"):
        found = persistent_run(load_compare(path) if path.exists() else pd.DataFrame())
        if found:
            panels.append(found)
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (run, commit) in zip(axes[0], panels):
        for variant, g in run.groupby("variant"):
            g = g.sort_values("hidden")
            ax.plot(g.hidden, g.median_step_us, marker="o", ls="-" if variant.endswith("-persistent") else "--",
                    label=variant)
        p = PROTOCOLS[run.protocol.iloc[0]]
        widths = sorted(run.hidden.unique())
        ax.set(xscale="log", yscale="log", xlabel="hidden width H", ylabel="median step time (µs)")
        ax.set_title(f"{run.protocol.iloc[0]} protocol, {p.net}, batch {p.batch_size}, {run.dtype.iloc[0]}\n"
                     f"{run.device.iloc[0]}, {commit}, {run.run_length.iloc[0]}", fontsize=9)
        ax.set_xticks(widths, [str(h) for h in widths])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return [save(fig, folder, "persistent_widths.png")]


def loss_curves(folder: Path) -> list[Path]:
    made = []
    curves = folder / "loss_curves"
    for dtype in ("fp16", "fp32", "bf16"):
        files = sorted(curves.glob(f"losses_{dtype}_seed_*.csv"))
        if not files:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for f in files:
            df = pd.read_csv(f, dtype=AS_TEXT)
            h = 1024 if (df.hidden == 1024).any() else df.hidden.max()
            g = df[df.hidden == h]
            ax.plot(g.step, g.loss, lw=0.8, label=f"{f.stem.split('_seed_')[-1]} (H={h})")
        ax.set(xlabel="step", ylabel="training loss", yscale="log", title=f"loss curves, {dtype}, {folder.name}")
        ax.legend(fontsize=8)
        made.append(save(fig, folder, f"loss_curves_{dtype}.png"))
    return made


def tuned_vs_default(folder: Path, target: str, tuning: Path) -> list[Path]:
    store = tuning / "best.json"
    if not store.exists():
        return []
    entries = json.loads(store.read_text())["entries"]
    rows = [(f"{e['op']} {e['shape']} {e['dtype']}", e["backend"], e.get("speedup_vs_default"))
            for e in entries if e.get("speedup_vs_default")]
    if not rows:
        return []
    df = pd.DataFrame(rows, columns=["kernel", "backend", "speedup"]).pivot_table(
        index="kernel", columns="backend", values="speedup")
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(df) + 1.5))
    df.plot.barh(ax=ax)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="tuned / default speed", title=f"what tuning bought per kernel ({target}, {folder.name})")
    return [save(fig, folder, "tuned_vs_default.png")]


def roofline(folder: Path) -> list[Path]:
    path = folder / "kernels.csv"
    if not path.exists():
        return []
    df = pd.read_csv(path, dtype=AS_TEXT)
    ok = df[df.status == "ok"]
    if (ok.op == "copy").sum() == 0:
        return []  # the ceiling is the copy measured in the same run
    copy_gbps = copy_ceiling(ok)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ew = ok[ok.group == "elementwise"]
    labels = ew.op + " " + ew.backend + " " + ew.config_label.fillna("")
    left.barh(labels, ew.gbps)
    left.axvline(copy_gbps, color="k", lw=1, label=f"device copy {copy_gbps:.0f} GB/s")
    left.axvline(0.9 * copy_gbps, color="k", lw=0.8, ls="--", label="90% of copy")
    left.set(xlabel="GB/s (bytes read + written)", title="memory-bound kernels, 256M fp32")
    left.legend(fontsize=8)
    mm = ok[ok.op == "matmul"].copy()
    if mm.empty:  # e.g. `bench_kernels --only elementwise`
        right.set_axis_off()
        right.text(0.5, 0.5, "no matmul rows in this CSV", ha="center")
        return [save(fig, folder, "roofline.png")]
    elt = mm.dtype.map({"fp32": 4, "fp16": 2, "bf16": 2})
    dims = mm["shape"].str.split(":").str[0].str.split("x", expand=True).astype(float)
    m, n, k = dims[0], dims[1], dims[2]
    mm["intensity"] = 2 * m * n * k / ((m * k + k * n + m * n) * elt)
    cublas = mm[(mm.backend == "torch") & (mm.config_label != TORCH_TF32)]  # the dtype's own precision
    torch_peak = {dt: cublas[cublas.dtype == dt].tflops.max() for dt in mm.dtype.unique()}
    for (backend, dtype), g in mm.groupby(["backend", "dtype"]):
        right.scatter(g.intensity, g.tflops, s=12, label=f"{backend} {dtype}")
    xs = pd.Series([1, 10, 100, 1000, 3000], dtype=float)
    for dtype, peak in torch_peak.items():
        right.plot(xs, [min(peak, copy_gbps * x / 1000) for x in xs], lw=0.8, ls="--",
                   label=f"roof {dtype}: {peak:.0f} TFLOP/s (best cuBLAS seen)")
    right.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte of compulsory traffic)",
              ylabel="TFLOP/s", title="matmuls vs the measured roofline")
    right.legend(fontsize=6)
    return [save(fig, folder, "roofline.png")]


def save(fig, folder: Path, name: str) -> Path:
    fig.tight_layout()
    path = folder / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Draw the lab's plots from the committed CSVs.")
    ap.add_argument("--gpu", default="h200", help="the device whose results folder to read (experiments/results/<gpu>)")
    ap.add_argument("--target", default="sm_90", help="tuning target (names the plots)")
    ap.add_argument("--tuning-dir", type=Path, default=None,
                    help="folder with the tuner's trials.csv and best.json (default: the committed copy, "
                         "experiments/results/<gpu>/tuning/<target>)")
    args = ap.parse_args(argv)
    tuning = args.tuning_dir or results_dir(args.gpu) / "tuning" / args.target
    folder = results_dir(args.gpu)
    makers = {
        "step time": lambda: step_time(folder),
        "persistent kernel over widths": lambda: persistent_widths(folder),
        "loss curves": lambda: loss_curves(folder),
        "tuned vs default": lambda: tuned_vs_default(folder, args.target, tuning),
        "roofline": lambda: roofline(folder),
    }
    failed = 0
    for name, make in makers.items():
        try:
            made = make()
        except Exception as exc:  # noqa: BLE001 - one odd CSV must not cost the other plots
            failed += 1
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        print(f"{name}: {', '.join(p.name for p in made) if made else 'skipped (no input CSV)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
