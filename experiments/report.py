"""The README's results section, regenerated from one run of experiments.headline (no hand-typed numbers).

    python -m experiments.report [--gpu h200] [--check | --rerun FOLDER]

Rewrites what lies between the markers `<!-- results:begin -->` and `<!-- results:end -->` in
README.md from experiments/results/<gpu>/headline/. `--check` exits 1 if that section is stale,
or if the run's CSVs mix commits or repeat a row: the section shows one run, whole.

Each figure's spread is how far a next run may move it: the wider of the run's own band (the range
of its rounds, or a step time's 20th-80th percentiles) and the largest move between two runs that
figures of its kind have made in the pairs of runs on record, on any GPU (experiments/results/*/
headline_reruns.csv). `--rerun FOLDER` judges another run's headline folder against that one's
spreads, figure by figure, the record as it stood before (so the judgement is of a pair the spreads
did not see), then adds the pair to the record.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments import compare
from experiments.bench_kernels import TORCH_IEEE, TORCH_TF32, copy_ceiling
from experiments.paths import results_dir
from kernels_core.provenance import AS_TEXT

EXPERIMENTS = Path(__file__).resolve().parent
README = EXPERIMENTS.parent / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
STEP_CSVS = tuple(compare.csv_name(p) for p in compare.PROTOCOLS)  # the headline's training-step CSVs
# The seed project's published step-time speedups of its CUDA MLP over eager PyTorch on an RTX 3060
# (experiments/FINDINGS.md, "Training step: seed protocol"); it gave no figure for H = 512 and 1024.
SEED_PROJECT = {128: 5.2, 256: 5.2, 2048: 1.5, 4096: 1.5, 8192: 1.5}
RERUNS = "headline_reruns.csv"  # the record of pairs of runs, in results/<gpu>/
NEXT_RUN = ("`next run`: how far another run may move the figure, the wider of this run's band and the largest "
            "move of a figure of its kind between two runs on record")
# A trainer GEMM of a few µs moves between processes far more than a longer one (its time is a few
# hundred cycles of latency: experiments/FINDINGS.md, "The headline run"), so the two are kinds apart.
SHORT_GEMM_MS = 0.005
KINDS = {"elementwise": "elementwise GB/s", "gemm": "square matmuls",
         "short": "trainer GEMMs of 5 µs or less (graph replays)", "long": "trainer GEMMs over 5 µs (graph replays)"}


class NotOneRun(ValueError):
    """The headline folder's CSVs are not one run: several commits, or a repeated row."""


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


def _table(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *body])


def _unique(df: pd.DataFrame, key: list[str], what: str) -> pd.DataFrame:
    dupes = df[df.duplicated(key, keep=False)]
    if len(dupes):
        first = dupes.iloc[0]
        raise NotOneRun(f"{what} repeats a row: {', '.join(f'{k}={first[k]}' for k in key)}")
    return df


def _rounds(df: pd.DataFrame, key: list[str], value: str) -> pd.DataFrame:
    """Per `key`, the median of a value over the run's rounds and their range (lo, hi)."""
    _unique(df, [*key, "rep"], "a round")
    g = df.groupby(key, sort=False, dropna=False)[value]
    return pd.DataFrame({"median": g.median(), "lo": g.min(), "hi": g.max()}).reset_index()


def _x(v) -> str:
    return f"{v:.2f}×" if pd.notna(v) and v != "" else ""


def kernels_section(df: pd.DataFrame, commit: str, between: pd.Series) -> list[str]:
    ok = df[df.status == "ok"]
    ew = ok[ok.group == "elementwise"]
    copy = copy_ceiling(ok)
    ew = _rounds(ew, ["op", "backend", "config_label"], "gbps")
    ew_t = pd.DataFrame({"op": ew.op, "backend": ew.backend, "config": ew.config_label.str.replace("cuBLAS/", ""),
                         "GB/s (range of rounds)": [f"{m:.0f} ({lo:.0f}–{hi:.0f})" for m, lo, hi in
                                                    zip(ew["median"], ew.lo, ew.hi)],
                         "% of copy": (100 * ew["median"] / copy).map("{:.1f}".format),
                         "next run": spread(ew["median"], ew.lo, ew.hi, KINDS["elementwise"], between).map(_pm)})
    gemm = ok[ok.group == "gemm"]
    ms = _rounds(gemm, ["dtype", "shape", "backend", "config_label"], "time_ms")
    x = _rounds(gemm, ["dtype", "shape", "backend", "config_label"], "vs_torch")
    # Runs before the error was recorded have no rel_err: an empty column.
    err = _rounds(gemm.assign(rel_err=pd.to_numeric(gemm.get("rel_err", np.nan))),
                  ["dtype", "shape", "backend", "config_label"], "rel_err")
    size = ms["shape"].str.split("x").str[0].astype(int)
    gemm_t = pd.DataFrame({
        "matmul": [f"{s}³ {d}" for s, d in zip(size, ms.dtype)], "backend": ms.backend,
        "config": ms.config_label.str.replace("cuBLAS/aten", "cuBLAS"),
        "ms (range of rounds)": [f"{m:.3f} ({lo:.3f}–{hi:.3f})" for m, lo, hi in zip(ms["median"], ms.lo, ms.hi)],
        "TFLOP/s": (2 * size.astype(float) ** 3 / ms["median"] / 1e9).map("{:.0f}".format),
        "vs cuBLAS": x["median"].map("{:.2f}".format),
        "error": err.hi.map(lambda e: f"{e:.1e}" if pd.notna(e) else ""),
        "next run": spread(ms["median"], ms.lo, ms.hi, KINDS["gemm"], between).map(_pm)})
    rounds = int(gemm.rep.max()) + 1
    return [f"### Kernels against the device's ceilings (commit {commit})", "",
            f"Elementwise ops on 256M fp32 elements against a device-to-device copy of {copy:.0f} GB/s "
            f"(bytes read + written), L2 flushed between repetitions; the median of {rounds} rounds, each in a "
            f"process of its own, and their range; {NEXT_RUN}:", "", _table(ew_t), "",
            "Square matmuls, each twin at its default config"
            + (", in 3xTF32 (fp32, `tf32x3`: its default, on the tensor cores where that is the FMA units'"
               " kernel" + ("; `tf32x3 split ahead`: the nearest config with the operands split into TF32 parts"
                            " before the GEMM" if (gemm.config_label == "tf32x3 split ahead").any() else "")
               + ("; `tf32x3 wgmma`: the nearest config on Hopper's wgmma, the operands split ahead"
                  if (gemm.config_label == "tf32x3 wgmma").any() else "") + ")"
               if (gemm.config_label == "tf32x3").any() else "")
            + " and at the store's tuned one (`tuned`), against cuBLAS through torch in the same round (fp32 with "
            "TF32 off" + ("; with it on, `cuBLAS TF32`, a lower precision" if (gemm.config_label == TORCH_TF32).any()
                          else "") + "); `vs cuBLAS` is the median of the rounds' ratios; `error` the largest of the "
            "rounds' norm-wise errors against float64 on the same inputs, ||C - C64|| / ||C64||; `next run` as above:", "",
            _table(gemm_t), ""]


def gemms_section(df: pd.DataFrame, commit: str, between: pd.Series) -> list[str]:
    """The trainer's GEMMs: CUDA-graph replays, the kernels' own time, each against cuBLAS."""
    ok = df[(df.group == "trainer") & (df.status == "ok")]
    t = _rounds(ok, ["dtype", "shape", "backend", "config_label"], "graph_ms")
    cublas = t[(t.backend == "torch") & (t.config_label == TORCH_IEEE)].set_index(["dtype", "shape"])["median"]
    t = t[t.backend != "torch"].copy()
    t["x"] = [cublas[(d, s)] / ms for d, s, ms in zip(t.dtype, t["shape"], t["median"])]
    t["next"] = [spread(m, lo, hi, gemm_kind(m), between) for m, lo, hi in zip(t["median"], t.lo, t.hi)]
    summary = [{"dtype": dtype, "backend": backend, "config": label, "shapes": len(g),
                "median vs cuBLAS": f"{g.x.median():.2f}×", "slowest": f"{g.x.min():.2f}×", "fastest": f"{g.x.max():.2f}×"}
               for (dtype, backend, label), g in t.groupby(["dtype", "backend", "config_label"])]
    tuned = t[t.config_label == "tuned"].pivot_table(index=["dtype", "shape"], columns="backend",
                                                     values=["median", "x", "next"], sort=False)
    rows = []
    for (dtype, shape), r in tuned.iterrows():
        row = {"dtype": dtype, "shape": shape, "cuBLAS µs": f"{cublas[(dtype, shape)] * 1e3:.1f}"}
        for backend in ("cuda", "triton"):
            ms, x, nxt = (r.get((column, backend)) for column in ("median", "x", "next"))
            row[f"{backend} tuned µs"] = f"{ms * 1e3:.1f} {_pm(nxt)} ({x:.2f}×)" if pd.notna(ms) else ""
        rows.append(row)
    return [f"### The trainer's GEMMs against cuBLAS (commit {commit})", "",
            f"Every distinct GEMM of both protocols' training steps at every width ({t['shape'].nunique()} "
            "shapes), each twin at its default and its tuned config; CUDA-graph replays of 10 calls (inputs "
            "warm in L2, as in a graphed step), medians of the rounds (each in a process of its own); cuBLAS time / "
            "twin time:", "",
            _table(pd.DataFrame(summary)), "", "<details><summary>Per shape, tuned</summary>", "",
            "Each twin's time with its `next run` spread (above), then its speedup over cuBLAS:", "",
            _table(pd.DataFrame(rows)), "", "</details>", ""]


def headline_steps(df: pd.DataFrame) -> pd.DataFrame:
    """Per width: each tuned twin's median step, the fastest torch variant's of those run, and the twins'
    speedups."""
    rows = []
    for h, g in df.groupby(df.hidden.astype(int)):
        torch_rows = g[(g.backend == "torch") & ~g.variant.map(compare.lower_precision)].sort_values("median_step_us")
        best = torch_rows.iloc[0]
        eager = torch_rows[torch_rows.variant == "torch-eager"].median_step_us
        row = {"H": h}
        for twin in ("cuda", "triton"):
            us = g[g.variant == f"{twin}-tuned"].median_step_us
            row[f"{twin} µs"] = f"{us.iloc[0]:.1f}" if len(us) else ""
            row[f"{twin} vs fastest torch run"] = _x(best.median_step_us / us.iloc[0]) if len(us) else ""
            row[f"{twin} vs eager"] = _x(eager.iloc[0] / us.iloc[0]) if len(us) and len(eager) else ""
        row["fastest torch run"] = f"{best.variant} {best.median_step_us:.1f}"
        rows.append(row)
    return pd.DataFrame(rows)


def steps_section(df: pd.DataFrame, commit: str, folder: Path, between: pd.Series) -> list[str]:
    from experiments.headline import MAX_AUTOTUNE_VARIANTS, STEPS

    _unique(df, ["variant", "hidden"], "a step-time table")
    protocol = df.protocol.iloc[0]
    p = compare.PROTOCOLS[protocol]
    widths = sorted(df.hidden.astype(int).unique())
    cells = {}
    for r in df.itertuples():
        nxt = spread(float(r.median_step_us), float(r.p20_step_us), float(r.p80_step_us), step_kind(r.variant), between)
        cells.setdefault(r.variant, {})[int(r.hidden)] = f"{float(r.median_step_us):.1f} {_pm(nxt)}"
    order = [v for v in compare.VARIANTS if v in cells or v in MAX_AUTOTUNE_VARIANTS]
    table = pd.DataFrame([{"variant": v, **{f"H={h}": cells.get(v, {}).get(h, "`--full`" if v in MAX_AUTOTUNE_VARIANTS else "")
                                           for h in widths}} for v in order])
    what = ("the seed project's protocol" if protocol == "seed" else "the trainer's defaults")
    lines = [f"### Training step, {what}: {p.net}, {p.dtype}, batch {p.batch_size} (commit {commit})", "",
             f"Median step time in µs over {STEPS} steps, ± how far another run may move it (the wider of the "
             "band from its steps' 20th to 80th percentile and the largest move of that variant's step time "
             "between two runs on record), data gather included, compilation and autotuning excluded; `--full` marks the max-autotune variants, "
             "measured only by `python -m experiments.headline --full` (they spend minutes autotuning each "
             "width's GEMMs):", "", _table(table), ""]
    speed = headline_steps(df)
    if protocol == "seed":
        speed["seed project, CUDA vs eager (RTX 3060)"] = speed.H.map(lambda h: f"~{SEED_PROJECT[h]}×" if h in SEED_PROJECT else "")
    lines += ["Each twin on its tuned configs against the fastest torch variant this run measured at that width "
              "(not max-autotune, which earlier runs measured faster than torch-compile-graph at H = 128: "
              "experiments/FINDINGS.md, \"The headline run\") and against torch eager:", "", _table(speed), ""]
    from experiments.plots import step_time_name

    plot = folder / step_time_name(protocol, df.run_length.iloc[0])
    if plot.exists():
        lines += [f"![step time vs H, {protocol} protocol]({plot.relative_to(README.parent)})", ""]
    return lines


def pool(t: pd.Series) -> str:
    """The tuner's processes, where the run recorded them."""
    if "workers" not in t or t.workers != t.workers:
        return ""
    compiling = f"{int(t.workers)} compile processes" if t.workers else "no compile pool"
    return f" ({compiling}, one timing process per GPU, {int(t.cores)} cores)"


def tuning_section(df: pd.DataFrame, commit: str) -> list[str]:
    t = df.iloc[0]
    return [f"### Tuning cost (commit {commit})", "",
            f"`{t.command}`{pool(t)}: {int(t.trials)} trials ({int(t.ok_trials)} valid) in "
            f"{int(t.studies)} studies, {t.wall_s:.0f} s of wall time, {t.trials_per_s:.2f} trials per second.", ""]


def render(gpu: str) -> str:
    """The section, from experiments/results/<gpu>/headline/; raises NotOneRun if that is not one run."""
    folder = results_dir(gpu) / "headline"
    read = lambda name: pd.read_csv(folder / name, dtype=AS_TEXT) if (folder / name).exists() else None  # noqa: E731
    frames = {name: read(name) for name in ("kernels.csv", "trainer_gemms.csv", *STEP_CSVS, "tuning.csv",
                                              "stages.csv")}
    found = {name: df for name, df in frames.items() if df is not None and len(df)}
    between = between_runs(reruns(results_dir(gpu).parent))
    if "stages.csv" not in found:
        return "\n".join([BEGIN, "", "No results yet: run `python -m experiments.headline` on a GPU.", "", END])
    commits = {str(c) for df in found.values() for c in df["commit"].dropna().unique()}
    if len(commits) > 1:
        raise NotOneRun(f"the headline CSVs in {folder} mix commits: {', '.join(sorted(commits))}")
    commit = commits.pop()
    prov = next(df for df in found.values() if "device" in df).iloc[0]
    stack = ", ".join(f"{name} {prov[col]}" for name, col in (("torch", "torch"), ("triton", "triton"),
                                                               ("cupy", "cupy"), ("CUDA", "cuda")) if pd.notna(prov.get(col)))
    stages = found["stages.csv"]
    lines = [f"One run of `python -m experiments.headline` ({stages.seconds.sum() / 60:.1f} min): {prov['device']}, "
             f"{str(prov['utc'])[:10]}, {stack}, commit {commit}, config store `{stages.config_store.iloc[0]}`. "
             "Earlier runs, and why each number is what it is, are in `experiments/FINDINGS.md`.", ""]
    if "kernels.csv" in found:
        lines += kernels_section(found["kernels.csv"], commit, between)
        if (folder / "roofline.png").exists():
            lines += [f"![kernels against the measured ceilings]({(folder / 'roofline.png').relative_to(README.parent)})", ""]
    if "trainer_gemms.csv" in found:
        lines += gemms_section(found["trainer_gemms.csv"], commit, between)
    for name in STEP_CSVS:
        if name in found:
            lines += steps_section(load_compare(folder / name), commit, folder, between)
    if "tuning.csv" in found:
        lines += tuning_section(found["tuning.csv"], commit)
    return "\n".join([BEGIN, "", *lines, END])


def figures(folder: Path) -> pd.DataFrame:
    """Every figure of a headline folder with the band it reports: (kind, figure, median, lo, hi)."""
    parts = []
    kernels = pd.read_csv(folder / "kernels.csv", dtype=AS_TEXT)
    kernels = kernels[kernels.status == "ok"]
    for group, value, kind in (("elementwise", "gbps", KINDS["elementwise"]), ("gemm", "time_ms", KINDS["gemm"])):
        t = _rounds(kernels[kernels.group == group], ["op", "dtype", "shape", "backend", "config_label"], value)
        parts.append(pd.DataFrame({"kind": kind, "figure": [f"{group} {value} " + " ".join(map(str, k)) for k in
                                              zip(t.op, t.dtype, t["shape"], t.backend, t.config_label)],
                                   "median": t["median"], "lo": t.lo, "hi": t.hi}))
    gemms = pd.read_csv(folder / "trainer_gemms.csv", dtype=AS_TEXT)
    t = _rounds(gemms[(gemms.group == "trainer") & (gemms.status == "ok")], ["dtype", "shape", "backend", "config_label"],
                "graph_ms")
    parts.append(pd.DataFrame({"kind": t["median"].map(gemm_kind),
                               "figure": [f"trainer graph_ms {d} {s} {b} {c}" for d, s, b, c in
                                          zip(t.dtype, t["shape"], t.backend, t.config_label)],
                               "median": t["median"], "lo": t.lo, "hi": t.hi}))
    for name in STEP_CSVS:
        df = pd.read_csv(folder / name, dtype=AS_TEXT)
        parts.append(pd.DataFrame({"kind": df.variant.map(step_kind),
                                   "figure": [f"step_us {p} H={h} {v}" for p, h, v in zip(df.protocol, df.hidden, df.variant)],
                                   "median": df.median_step_us, "lo": df.p20_step_us, "hi": df.p80_step_us}))
    return pd.concat(parts, ignore_index=True)


def gemm_kind(ms: float) -> str:
    return KINDS["short"] if ms <= SHORT_GEMM_MS else KINDS["long"]


def step_kind(variant: str) -> str:
    return f"step, {variant}"


def band(median, lo, hi):
    """A figure's own band as a fraction either side of its median: a step time's percentiles lie
    unevenly about it, so the farther end."""
    return np.maximum(hi / median - 1, 1 - lo / median)


def between_runs(record: pd.DataFrame) -> pd.Series:
    """Per kind of figure, the largest move between the two runs of a pair on record (a fraction)."""
    if record.empty:
        return pd.Series(dtype=float)
    return record.moved.abs().groupby(record.kind).max()


def spread(median, lo, hi, kind: str, between: pd.Series):
    """How far a next run may move a figure: the wider of its own band and its kind's moves on record."""
    return np.maximum(band(median, lo, hi), between.get(kind, 0.0))


def _pm(fraction) -> str:
    return f"±{100 * fraction:.1f}%"


def reruns(results: Path) -> pd.DataFrame:
    """The pairs of runs on record in every GPU's folder under `results` (a `gpu` column names each
    pair's): a user's next run is on another machine, and how far figures move between machines is
    measured wherever two runs were made, not only on the GPU a README shows."""
    paths = sorted(results.glob(f"*/{RERUNS}"))
    return pd.concat([pd.read_csv(path, dtype={"commit": str, "commit_second": str}).assign(gpu=path.parent.name)
                      for path in paths], ignore_index=True) if paths else pd.DataFrame(
        columns=["kind", "moved", "commit", "commit_second", "gpu"])


def rerun(first: Path, second: Path, record: pd.DataFrame) -> pd.DataFrame:
    """Each figure of two headline runs, and whether the second's median lies within the spread the
    first reports for it, the kinds' moves taken from `record` (pairs other than this one)."""
    a, b = figures(first), figures(second)
    both = a.merge(b[["figure", "median"]], on="figure", suffixes=("", "_second"))
    both["moved"] = both.median_second / both["median"] - 1
    between = between_runs(record)
    both["band"] = band(both["median"], both.lo, both.hi)
    both["between_runs"] = both.kind.map(between).fillna(0.0)
    both["spread"] = both[["band", "between_runs"]].max(axis=1)
    both["within_spread"] = both.moved.abs() <= both.spread
    both["commit"], both["commit_second"] = run_commit(first), run_commit(second)
    return both


def run_commit(folder: Path) -> str:
    return pd.read_csv(folder / "stages.csv", dtype=AS_TEXT).commit.iloc[0]


def rerun_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per kind of figure, as rerun judged them: how many, how many within the first run's spread,
    the median and largest move, the median band and the kind's largest move on record before, in %."""
    g = table.groupby("kind", sort=False)
    pct = lambda s: (100 * s).round(1)  # noqa: E731
    return pd.DataFrame({"n": g.size(), "within": g.within_spread.sum(),
                         "median move %": pct(g.moved.apply(lambda m: m.abs().median())),
                         "largest move %": pct(g.moved.apply(lambda m: m.abs().max())),
                         "median band %": pct(g.band.median()),
                         "on record %": pct(g.between_runs.max())}).reset_index()


def _spliced(gpu: str) -> tuple[str, str]:
    """(the README as it is, the README with its section regenerated)."""
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md lacks the markers {BEGIN} ... {END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return text, head + render(gpu) + tail


def write_readme(gpu: str) -> None:
    README.write_text(_spliced(gpu)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the section is stale, or the run's CSVs mix commits or repeat a row")
    ap.add_argument("--rerun", type=Path, metavar="FOLDER",
                    help="judge another headline run's folder against this GPU's run and the spreads every "
                         f"GPU's pairs give, then add the pair to this GPU's record ({RERUNS} beside it)")
    args = ap.parse_args(argv)
    if args.rerun:
        out = results_dir(args.gpu) / RERUNS
        first = results_dir(args.gpu) / "headline"
        record = reruns(results_dir(args.gpu).parent)
        pair = (run_commit(first), run_commit(args.rerun))
        earlier = record[(record.gpu != args.gpu) | (record.commit != pair[0]) | (record.commit_second != pair[1])]
        table = rerun(first, args.rerun, earlier)
        print(f"{int(table.within_spread.sum())} of {len(table)} figures of {args.rerun} lie within the spread this "
              f"run reports ({len(earlier.groupby(['gpu', 'commit', 'commit_second']))} earlier pairs on record):\n"
              f"{rerun_summary(table).to_string(index=False)}\nthe largest moves against their spreads:\n"
              + table.reindex((table.moved.abs() / table.spread).sort_values(ascending=False).index).head(8)
              .drop(columns="kind").to_string(index=False))
        pd.concat([earlier[earlier.gpu == args.gpu].drop(columns="gpu"), table], ignore_index=True)[table.columns].to_csv(
            out, index=False)
        print(f"added the pair {pair[0]} / {pair[1]} to {out}")
        return 0
    try:
        text, new = _spliced(args.gpu)
    except NotOneRun as exc:
        print(f"experiments.report: {exc}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print("experiments.report: the README's results section is stale: run python -m experiments.report",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    print("README results section regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
