"""How good is the tuner's search? Samplers against the exhaustive grid, for matmul.

1. Measure the grid (on the GPU; the only step that needs one): every config of
   the target-pruned space with --full-grid, else a deterministic sample of
   --max-configs, at each shape, through the tuner's own worker pool (so the
   numbers are what the tuner sees), each timed --repeats times, the repeats of
   one config apart in time. Every timing is appended as it ends to
   search_quality_grid[_<label>]_runs.csv, and a rerun measures only what that
   file lacks, so a run cut short (--grid-seconds, a kill) resumes. Then
   search_quality_grid[_<label>].csv: a row per config, time_ms the median of its
   repeats, time_min_ms/time_max_ms/time_spread ((max - min) / median) and
   repeats beside it.
2. Replay each sampler offline against that table (--grid-csv reads either file,
   or an older table timed once), through the tuner's own ask/check/tell loop:
   the objective looks up the measured time; configs that failed or were not
   measured count as failed/invalid, as in a real search. A trial is a distinct
   config measured: the tuner never measures one twice.
   Each replay measures exactly --budget's share of the grid (rounded down).
   The grid's backend and dtype are its rows'.
   -> search_quality[_<label>].csv (shape, sampler, seed, trial, best_so_far_ms),
   search_quality[_<label>]_seeds.csv (per seed: distinct configs until within 3%
   and 1% of the grid's best, best found after 20 and 45 trials and after 10% of
   the grid, each left empty where the replay's budget ends before it),
   search_quality[_<label>]_summary.csv and search_quality[_<label>].png (best so
   far vs trials, median and 10th-90th percentile band over seeds).
3. Print per sampler and shape: the median configs to within 3% and 1%, the
   share of seeds within 3% in a budget of 10% of the grid, and whether the
   tuner's default sampler meets the bar (>= 95% of seeds, median <= 5% of the grid).

    python -m experiments.search_quality --full-grid                # measure + replay (GPU)
    python -m experiments.search_quality --full-grid --measure-only # measure only (GPU)
    python -m experiments.search_quality --grid-csv FILE            # replay only (any machine)
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time
from pathlib import Path

import optuna
import pandas as pd

from autotune import console, errors, samplers, storage, studies
from autotune.evaluate import Evaluator
from autotune.search import seconds
from kernels_core.targets import TARGETS, resolve_target
from autotune.trials_csv import TrialsCsv, columns
from kernels_core.mlp import Call
from kernels_core.shapes import parse_shapes
from kernels_core import backends
from kernels_core.contract import DTYPES
from kernels_core.provenance import AS_TEXT, provenance
from experiments.paths import RESULTS, results_dir

WITHIN = (0.03, 0.01)  # reach targets: within 3% and 1% of the grid's best
BUDGET_SHARE = 0.10  # a seed succeeds if it gets within 3% in this share of the grid
BAR_SEEDS, BAR_MEDIAN = 0.95, 0.05  # the bar: that often, and a median within this share
CHECKPOINTS = (20, 45)  # trials after which the best found is reported, and after BUDGET_SHARE of the grid
BUDGET_COLUMN = f"{BUDGET_SHARE:.0%}"  # names the figures taken after BUDGET_SHARE of the grid
MEASURED_WITH = ("backend", "dtype")  # a grid's columns that say what it was measured with, one value each
DEFAULTS = {"backend": "triton", "dtype": "fp16"}  # what a new grid is measured with
YTICKS = (1.0, 1.03, 1.1, 1.25, 1.5, 2.0)
PER_TIMING = ("repeat", "status", "error", "time_ms", "time_p20_ms", "time_p80_ms")  # replaced by the aggregate


def _suffix(label: str) -> str:
    return f"_{label}" if label else ""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.search_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", help=f"the twin to measure (default {DEFAULTS['backend']}); a replay takes "
                   "the grid's")
    p.add_argument("--dtype", choices=list(DTYPES), help=f"default {DEFAULTS['dtype']}; a replay takes the grid's")
    p.add_argument("--shapes", default="128x1024x784:nn,4096x4096x4096:nn", help="matmul MxNxK[:layout], comma-separated")
    p.add_argument("--target", default="auto", choices=["auto", *TARGETS])
    p.add_argument("--grid-csv", type=Path, help="replay this measured grid (or its _runs.csv) instead of measuring one")
    p.add_argument("--full-grid", action="store_true", help="measure every valid config (default: a sample of --max-configs)")
    p.add_argument("--max-configs", type=int, default=300, help="configs measured per shape without --full-grid")
    p.add_argument("--measure-only", action="store_true", help="measure the grid and stop: replay it later, "
                   "on any machine, with --grid-csv (the replay is CPU work, no use of GPU time)")
    p.add_argument("--repeats", type=int, default=3, help="timings per config; the median is kept (default 3)")
    p.add_argument("--grid-seconds", type=float, help="stop measuring after this long; a rerun resumes "
                   "(default: 150 for a sample, no limit with --full-grid)")
    p.add_argument("--workers", type=int, default=8, help="worker processes compiling in parallel")
    p.add_argument("--timeout", type=seconds, default=60.0)
    p.add_argument("--samplers", default=f"{samplers.DEFAULT_SAMPLER},random",
                   help=f"comma-separated, of {', '.join(samplers.SAMPLERS)} (default: the tuner's default and random)")
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--budget", type=float, default=0.3,
                   help="configs each replay measures, as a share of the grid (rounded down; at least one)")
    p.add_argument("--label", help="names the outputs (default: none, full with --full-grid; "
                   "with --grid-csv, the grid's)")
    p.add_argument("--out", type=Path, default=None, help="folder (default experiments/results/<device>)")
    args = p.parse_args(argv)
    args.out = args.out or results_dir()
    args.samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    unknown = [s for s in args.samplers if s not in samplers.SAMPLERS]
    if unknown or not args.samplers:
        p.error(f"--samplers: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(samplers.SAMPLERS)}")
    for flag in ("repeats", "seeds", "max_configs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 < args.budget <= 1:
        p.error("--budget must be a share of the grid in (0, 1]")
    if args.grid_csv and args.measure_only:
        p.error("--measure-only measures a grid; --grid-csv replays one: pass one of them")
    if args.grid_csv and not args.grid_csv.is_file():
        p.error(f"--grid-csv {args.grid_csv}: no such file")
    if args.grid_seconds is None:
        args.grid_seconds = math.inf if args.full_grid else 150.0
    return args


# -- 1. the grid ----------------------------------------------------------------------

def measure_grid(args, path: Path) -> pd.DataFrame:
    target = resolve_target(args.target, compile_only=False)
    space = backends.space(args.backend, "matmul", args.dtype)
    tunables = list(space.params)
    configs = samplers.view_space(space, target, DTYPES[args.dtype].itemsize).valid
    if not args.full_grid and len(configs) > args.max_configs:
        picked = sorted(random.Random(0).sample(range(len(configs)), args.max_configs))
        print(f"grid: {len(configs)} valid configs on {target.name}; measuring a deterministic sample of "
              f"{len(picked)} per shape (--max-configs; --full-grid measures all)")
        configs = [configs[i] for i in picked]
    runs_path = path.with_name(f"{path.stem}_runs.csv")
    done = set()
    if runs_path.exists():
        runs = pd.read_csv(runs_path, dtype=AS_TEXT)
        # Runs from before a tunable existed ran its default (Space.with_defaults).
        have = [t for t in tunables if t in runs.columns]
        done = {(r["shape"], samplers.config_key(space.with_defaults({t: int(r[t]) for t in have})), int(r["repeat"]))
                for _, r in runs.iterrows()}
    # Repeat-major: the timings of one config lie a whole pass apart, so a drift of the
    # GPU's clocks or temperature shows in the spread instead of hiding in the median.
    todo = [(repeat, Call("matmul", args.dtype, shape, layout), c) for repeat in range(args.repeats)
            for shape, layout in parse_shapes(args.shapes) for c in configs]
    todo = [job for job in todo if (job[1].key, samplers.config_key(job[2]), job[0]) not in done]
    print(f"grid: {len(configs)} configs x {len(parse_shapes(args.shapes))} shapes x {args.repeats} repeats; "
          f"{len(todo)} timings to go, the rest in {runs_path}")
    if todo:
        _measure(args, target, todo, TrialsCsv(runs_path, columns([*tunables, "repeat"])))
    table = aggregate(pd.read_csv(runs_path, dtype=AS_TEXT), tunables)
    table.to_csv(path, index=False)
    print(f"grid: wrote {path}")
    return table


def _measure(args, target, todo: list, csv: TrialsCsv) -> None:
    pool = Evaluator(target.name, args.workers, args.timeout, RESULTS.parent / "logs" / "search_quality",
                     bench={"reps": 30, "max_seconds": 0.3})
    prov, lock = provenance(), threading.Lock()
    deadline = time.monotonic() + args.grid_seconds
    bar = console.bar(total=len(todo), unit="timing", desc="grid")
    todo = list(reversed(todo))  # popped from the end

    def drain(index: int) -> None:
        while time.monotonic() < deadline:
            with lock:
                if not todo:
                    return
                repeat, call, config = todo.pop()
                seed = len(todo)
            result = pool.evaluate(index, call, args.backend, config, seed=seed)
            csv.append({**prov, "target": target.name, "op": "matmul", "backend": args.backend, "dtype": args.dtype,
                        "shape": call.key, **config, "repeat": repeat, "status": result["status"],
                        "error": result.get("error"), "gpu": result.get("gpu"), "study": "search_quality",
                        **{k: result.get(k) for k in ("time_ms", "time_p20_ms", "time_p80_ms", "compile_s")}})
            with lock:
                bar.update(1)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(pool))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    csv.close()
    bar.close()
    if todo:
        print(f"grid: --grid-seconds ran out with {len(todo)} timings to go; run the same command again to resume")


def aggregate(runs: pd.DataFrame, tunables: list[str]) -> pd.DataFrame:
    """A row per (shape, config): ok only if every repeat ran, time_ms the median of the repeats."""
    keys = ["shape", *[t for t in tunables if t in runs.columns]]
    rows = []
    for key, part in runs.groupby(keys, sort=False):
        ok = part[part["status"] == "ok"]["time_ms"]
        failed = part[part["status"] != "ok"]
        first = part.iloc[0]
        median = ok.median() if len(ok) else None
        rows.append({**{c: first[c] for c in part.columns if c not in PER_TIMING},
                     **dict(zip(keys, key)), "status": failed["status"].iloc[0] if len(failed) else "ok",
                     "error": failed["error"].iloc[0] if len(failed) else None, "time_ms": median,
                     "time_min_ms": ok.min() if len(ok) else None, "time_max_ms": ok.max() if len(ok) else None,
                     "time_spread": (ok.max() - ok.min()) / median if len(ok) else None, "repeats": len(ok)})
    return pd.DataFrame(rows).dropna(axis=1, how="all")  # the trials.csv columns a grid leaves empty


class GridError(ValueError):
    """A --grid-csv that cannot be replayed as asked; the message says why, in one line."""


def load_grid(path: Path, backend: str | None = None, dtype: str | None = None
              ) -> tuple[pd.DataFrame, list[str], str, str]:
    """A grid table (a _runs.csv is aggregated first), the tunables of its space it has, and the
    backend and dtype it was measured with: its rows say, and a --backend or --dtype that says
    otherwise is refused (replayed over another space's tunables, configs that differ only in
    the others' would fold into one). A grid measured before a tunable was added ran that
    tunable's default throughout."""
    grid = pd.read_csv(path, dtype=AS_TEXT)
    missing = {"shape", "status", "time_ms", *MEASURED_WITH} - set(grid.columns)
    if missing:
        raise GridError(f"--grid-csv {path}: no {', '.join(sorted(missing))} column; is it a grid written by "
                        "this script?")
    measured = {}
    for column, flag in zip(MEASURED_WITH, (backend, dtype)):
        values = sorted(grid[column].astype(str).unique())
        if len(values) != 1:
            raise GridError(f"--grid-csv {path}: {column} {', '.join(values) or 'missing'}; a grid holds the "
                            f"configs of one {column}")
        if flag is not None and flag != values[0]:
            raise GridError(f"--grid-csv {path} was measured with {column} {values[0]}, not --{column} {flag}: "
                            f"drop --{column} (a replay takes the grid's) or pass a grid of {flag}")
        measured[column] = values[0]
    try:
        tunables = list(backends.space(measured["backend"], "matmul", measured["dtype"]).params)
    except (backends.BackendError, ValueError) as exc:
        raise GridError(f"--grid-csv {path}: {exc}") from None
    have = [t for t in tunables if t in grid.columns]
    if len(have) < len(tunables):
        print(f"{path.name}: no {', '.join(t for t in tunables if t not in have)} column (measured before it "
              "existed): replaying over the tunables it has")
    if "repeat" in grid.columns:
        grid = aggregate(grid, have)
    return grid, have, measured["backend"], measured["dtype"]


# -- 2. the replay --------------------------------------------------------------------

def replay(grid: pd.DataFrame, tunables: list[str], sampler: str, seed: int, budget: int,
           families: tuple[str, ...] = ()) -> list[float]:
    """Best time so far after each distinct config measured by one sampler run; `families`: the
    space's (Space.families) that the grid has."""
    times = {samplers.config_key({t: int(r[t]) for t in tunables}): (r["time_ms"] if r["status"] == "ok" else None)
             for _, r in grid.iterrows()}
    valid = [dict(k) for k in times]
    values = {t: sorted({int(v) for v in grid[t]}) for t in tunables}
    view = samplers.SpaceView(space=None, values=values, valid=valid, total=math.prod(len(v) for v in values.values()))
    study = optuna.create_study(sampler=samplers.make_sampler(sampler, seed, values, valid=valid, families=families),
                                direction="minimize")
    runner = studies.StudyRunner(
        study, view, budget, check=lambda c: None if samplers.config_key(c) in times else "not in the measured grid",
        make_row=lambda config, result, number: {"time_ms": result.get("time_ms")}, ordinal=sampler in samplers.ORDINAL_SAMPLERS)
    curve, best = [], math.inf
    while (candidate := runner.next_candidate()) is not None:
        t = times[samplers.config_key(candidate.config)]
        runner.complete(candidate, {"status": "ok", "time_ms": t} if t is not None else {"status": "launch_error"})
    for trial in study.get_trials(deepcopy=False):
        if storage.counts_toward_budget(trial):
            if trial.user_attrs["status"] == "ok":
                best = min(best, trial.value)
            curve.append(best)
    return curve


def budget_of(share: float, n: int) -> int:
    """Configs in `share` of an `n`-config grid, rounded down (at least one): 0.1 of 888 is 88."""
    return max(1, math.floor(round(share * n, 9)))  # round: 0.29 * 100 is 28.999999999999996


def seed_figures(curve: list[float], grid_best: float, budget: int, n: int) -> dict:
    """Distinct configs until within each WITHIN of the grid's best (NaN: never), and the best
    found after each checkpoint and after BUDGET_SHARE of the `n`-config grid, as a ratio to the
    grid's best: NaN past the replay's `budget` (what it would have found there was not measured);
    a replay that ended before its budget (the whole grid measured) keeps its last best."""
    out = {}
    for share in WITHIN:
        hit = next((i + 1 for i, b in enumerate(curve) if b <= grid_best * (1 + share)), math.nan)
        out[f"to_{share:.0%}"] = hit
    for name, k in [*((str(k), k) for k in CHECKPOINTS), (BUDGET_COLUMN, budget_of(BUDGET_SHARE, n))]:
        out[f"best_at_{name}"] = curve[min(k, len(curve)) - 1] / grid_best if curve and k <= budget else math.nan
    return out


def summary_at(curves: pd.DataFrame, seeds: pd.DataFrame, share: float) -> pd.DataFrame:
    """The summary of replays (their curves and seeds tables, as run_replays returns or writes
    them) as if each had measured `share` of its grid: each curve cut there. The sampler sees no
    budget, so a replay of a larger one measured the same configs first."""
    meta = seeds.set_index(["shape", "sampler", "seed"])
    figures = []
    for key, run in curves.groupby(["shape", "sampler", "seed"], sort=False):
        n, grid_best = int(meta.loc[key, "grid_configs"]), meta.loc[key, "grid_best_ms"]
        budget = budget_of(share, n)
        curve = run.sort_values("trial")["best_so_far_ms"].tolist()[:budget]
        figures.append({**dict(zip(["shape", "sampler", "seed"], key)), "grid_configs": n,
                        **seed_figures(curve, grid_best, budget, n)})
    return summarize(pd.DataFrame(figures))


def summarize(seeds: pd.DataFrame) -> pd.DataFrame:
    """Per shape and sampler: medians over seeds (a seed that never got there counts as
    infinitely many trials), the share of seeds within 3% in the 10% budget, and the bar."""
    rows = []
    for (shape, sampler), part in seeds.groupby(["shape", "sampler"], sort=False):
        n = int(part["grid_configs"].iloc[0])
        budget = budget_of(BUDGET_SHARE, n)
        row = {"shape": shape, "sampler": sampler, "seeds": len(part), "grid_configs": n, "budget_10pct": budget}
        for share in WITHIN:
            reach = part[f"to_{share:.0%}"].fillna(math.inf)
            row[f"median_to_{share:.0%}"] = reach.median()
            row[f"success_{share:.0%}_in_budget"] = (reach <= budget).mean()
        for name in (*map(str, CHECKPOINTS), BUDGET_COLUMN):
            row[f"median_best_at_{name}"] = part[f"best_at_{name}"].median()
        row["meets_bar"] = bool(row["success_3%_in_budget"] >= BAR_SEEDS and row["median_to_3%"] <= BAR_MEDIAN * n)
        rows.append(row)
    return pd.DataFrame(rows)


def run_replays(grid: pd.DataFrame, tunables: list[str], samplers: list[str], n_seeds: int,
                budget_share: float, families: tuple[str, ...] = ()) -> tuple[pd.DataFrame, pd.DataFrame]:
    curves, seeds = [], []
    shapes = [(shape, part) for shape, part in grid.groupby("shape", sort=False)]
    bar = console.bar(total=len(shapes) * len(samplers) * n_seeds, unit="run", desc="replay")
    for shape, part in shapes:
        ok = part[part["status"] == "ok"]
        if ok.empty:
            print(f"{shape}: no config ran; nothing to replay")
            bar.update(len(samplers) * n_seeds)
            continue
        grid_best, n = ok["time_ms"].min(), len(part)
        budget = budget_of(budget_share, n)
        for sampler in samplers:
            for seed in range(n_seeds):
                curve = replay(part, tunables, sampler, seed, budget, families)
                curves += [{"shape": shape, "sampler": sampler, "seed": seed, "trial": i + 1, "best_so_far_ms": b}
                           for i, b in enumerate(curve)]
                seeds.append({"shape": shape, "sampler": sampler, "seed": seed, "grid_configs": n,
                              "grid_best_ms": grid_best, **seed_figures(curve, grid_best, budget, n)})
                bar.update(1)
    bar.close()
    return pd.DataFrame(curves), pd.DataFrame(seeds)


def report(summary: pd.DataFrame) -> None:
    for _, r in summary.iterrows():
        n = r["grid_configs"]
        reach = "; ".join(f"within {s:.0%}: median {_trials(r[f'median_to_{s:.0%}'], n)}, "
                          f"{r[f'success_{s:.0%}_in_budget']:.0%} of seeds in {r['budget_10pct']}" for s in WITHIN)
        after = (*map(str, CHECKPOINTS), BUDGET_COLUMN)
        best = ", ".join(f"{r[f'median_best_at_{k}']:.3f}" for k in after)
        print(f"{r['shape']} {r['sampler']:>15} ({r['seeds']} seeds, grid {n}): {reach}; "
              f"best/grid best after {' / '.join(after)} configs {best}")


def _trials(median: float, n: int) -> str:
    return "never" if math.isinf(median) else f"{median:g} ({median / n:.1%})"


def main(argv=None) -> int:
    args = parse_args(argv)
    for sampler in args.samplers:
        try:
            samplers.make_sampler(sampler, 0, {})
        except errors.SearchError as exc:
            print(f"search_quality: error: {exc}", file=sys.stderr)
            return 2
    if args.grid_csv:
        try:
            grid, tunables, args.backend, args.dtype = load_grid(args.grid_csv, args.backend, args.dtype)
        except GridError as exc:
            print(f"search_quality: error: {exc}", file=sys.stderr)
            return 2
        stem = args.grid_csv.stem.removeprefix("search_quality_grid").removeprefix("_").removesuffix("_runs")
        label = args.label or stem
    else:
        args.backend, args.dtype = args.backend or DEFAULTS["backend"], args.dtype or DEFAULTS["dtype"]
        label = args.label or ("full" if args.full_grid else "")
        grid = measure_grid(args, args.out / f"search_quality_grid{_suffix(label)}.csv")
        tunables = list(backends.space(args.backend, "matmul", args.dtype).params)
        if args.measure_only:
            return 0
    families = tuple(f for f in backends.space(args.backend, "matmul", args.dtype).families if f in tunables)
    curves, seeds = run_replays(grid, tunables, args.samplers, args.seeds, args.budget, families)
    if seeds.empty:
        print("search_quality: error: no shape has a config that ran", file=sys.stderr)
        return 1
    summary = summarize(seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"search_quality{_suffix(label)}"
    curves.to_csv(f"{stem}.csv", index=False, float_format="%.6g")
    seeds.to_csv(f"{stem}_seeds.csv", index=False, float_format="%.6g")
    summary.to_csv(f"{stem}_summary.csv", index=False, float_format="%.6g")
    plot(curves, seeds, f"{stem}.png")
    report(summary)
    print(f"wrote {stem}.csv, _seeds.csv, _summary.csv and .png")
    default = summary[summary["sampler"] == samplers.DEFAULT_SAMPLER]
    if not default.empty:
        meets = bool(default["meets_bar"].all())
        print(f"the default sampler ({samplers.DEFAULT_SAMPLER}) {'meets' if meets else 'misses'} the bar on every "
              f"shape: within {WITHIN[0]:.0%} in >= {BAR_SEEDS:.0%} of seeds with {BUDGET_SHARE:.0%} of the grid, "
              f"median <= {BAR_MEDIAN:.0%}")
        return 0 if meets else 1
    return 0


def plot(curves: pd.DataFrame, seeds: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(seeds["shape"].unique())
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = seeds[seeds["shape"] == shape]
        best, n = mine["grid_best_ms"].iloc[0], int(mine["grid_configs"].iloc[0])
        for sampler, runs in curves[curves["shape"] == shape].groupby("sampler", sort=False):
            ratio = runs.assign(r=runs["best_so_far_ms"] / best).groupby("trial")["r"]
            line, = ax.plot(ratio.median().index, ratio.median().values, label=f"{sampler} ({runs['seed'].nunique()} seeds)")
            ax.fill_between(ratio.median().index, ratio.quantile(0.1).values, ratio.quantile(0.9).values,
                            color=line.get_color(), alpha=0.15, linewidth=0)
        ax.axhline(1 + WITHIN[0], color="grey", linestyle="--", label=f"grid best +{WITHIN[0]:.0%}")
        ax.axvline(BUDGET_SHARE * n, color="grey", linestyle=":", label=f"{BUDGET_SHARE:.0%} of the {n}-config grid")
        ax.set(title=f"matmul {shape}", xlabel="distinct configs measured",
               ylabel="best so far / grid best (median, 10-90% band)", yscale="log", ylim=(0.99, 2.0))
        ax.set_yticks(YTICKS, [f"{t:g}" for t in YTICKS])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
