"""How good is the tuner's search? Samplers against the exhaustive grid, for matmul.

1. Measure the grid once (on the GPU; the only step that needs one): every
   config of the target-pruned space -- a deterministic sample when it has more
   than --max-configs, said so -- at each shape, through the tuner's own
   worker pool (so the numbers are what the tuner sees), within --grid-seconds.
   -> experiments/results/search_quality_grid_<gpu>.csv, with provenance.
2. Replay each sampler offline against that table, through the tuner's own
   ask/check/tell loop: the objective looks up the measured time; configs that
   failed or were not measured count as failed/invalid, as in a real search.
   -> experiments/results/search_quality_<gpu>.csv (shape, sampler, seed,
   trial, best_so_far_ms) and search_quality_<gpu>.png.
3. Print whether TPE gets within 3% of the grid's best within 15% of the
   grid's evaluations (median over seeds).

    python -m experiments.search_quality                     # measure + replay (GPU)
    python -m experiments.search_quality --grid-csv FILE     # replay only (any machine)
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import optuna
import pandas as pd
from tqdm import tqdm

from autotune import studies
from kernels_core import backends
from autotune.evaluate import Evaluator
from kernels_core.provenance import device_slug, provenance
from autotune.targets import TARGETS, resolve_target
from autotune.workload import Call, parse_shapes
from kernels_core.contract import DTYPES

RESULTS = Path(__file__).resolve().parent / "results"
WITHIN, GRID_SHARE = 0.03, 0.15


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="triton")
    p.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    p.add_argument("--shapes", default="128x1024x784:nn,4096x4096x4096:nn", help="matmul MxNxK[:layout], comma-separated")
    p.add_argument("--target", default="auto", choices=["auto", *TARGETS])
    p.add_argument("--grid-csv", type=Path, help="replay this measured grid instead of measuring one")
    p.add_argument("--max-configs", type=int, default=300, help="configs measured per shape at most (sampled beyond)")
    p.add_argument("--grid-seconds", type=float, default=150.0, help="time budget for measuring the whole grid")
    p.add_argument("--workers", type=int, default=8, help="worker processes compiling in parallel")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--samplers", default="tpe,random,grid,cmaes", help="cmaes falls back to gp without the cmaes package")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.3, help="trials per replay, as a share of the grid")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


# -- 1. the grid ----------------------------------------------------------------------

def measure_grid(args, path: Path) -> pd.DataFrame:
    target = resolve_target(args.target, compile_only=False)
    space = backends.space(args.backend, "matmul", args.dtype)
    elt = DTYPES[args.dtype].itemsize
    view = studies.view_space(space, target, elt)
    configs = view.valid
    if len(configs) > args.max_configs:
        picked = sorted(random.Random(0).sample(range(len(configs)), args.max_configs))
        print(f"grid: {len(configs)} valid configs on {target.name}; measuring a deterministic sample of "
              f"{len(picked)} per shape (--max-configs)")
        configs = [configs[i] for i in picked]
    shapes = parse_shapes(args.shapes)
    pool = Evaluator(target.name, args.workers, args.timeout, RESULTS.parent / "logs" / "search_quality",
                     bench={"reps": 30, "max_seconds": 0.3})
    prov, rows, lock = provenance(), [], threading.Lock()
    deadline = time.monotonic() + args.grid_seconds
    bar = tqdm(total=len(configs) * len(shapes), unit="config", desc="grid", file=sys.stderr)
    todo = [(Call("matmul", args.dtype, shape, layout), c) for shape, layout in shapes for c in configs]

    def drain(index: int) -> None:
        while time.monotonic() < deadline:
            with lock:
                if not todo:
                    return
                call, config = todo.pop(0)
            result = pool.evaluate(index, call, args.backend, config, seed=len(todo))
            with lock:
                rows.append({**prov, "target": target.name, "backend": args.backend, "dtype": args.dtype,
                             "shape": call.key, **config, "status": result["status"], "error": result.get("error"),
                             "time_ms": result.get("time_ms"), "compile_s": result.get("compile_s")})
                bar.update(1)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(pool))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    bar.close()
    if todo:
        print(f"grid: --grid-seconds ran out; {len(todo)} configs not measured (left out of the replay)")
    table = pd.DataFrame(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)
    print(f"grid: wrote {path}")
    return table


# -- 2. the replay --------------------------------------------------------------------

def replay(grid: pd.DataFrame, tunables: list[str], sampler: str, seed: int, budget: int) -> list[float]:
    """Best time so far after each counted trial of one sampler run."""
    times = {studies.config_key({t: int(r[t]) for t in tunables}): (r["time_ms"] if r["status"] == "ok" else None)
             for _, r in grid.iterrows()}
    valid = [dict(k) for k in times]
    values = {t: sorted({int(v) for v in grid[t]}) for t in tunables}
    view = studies.SpaceView(space=None, values=values, valid=valid, total=math.prod(len(v) for v in values.values()))
    study = optuna.create_study(sampler=studies.make_sampler(sampler, seed, values), direction="minimize")
    runner = studies.StudyRunner(
        study, view, budget, check=lambda c: None if studies.config_key(c) in times else "not in the measured grid",
        make_row=lambda config, result, number: {"time_ms": result.get("time_ms")}, ordinal=sampler in studies.ORDINAL_SAMPLERS)
    curve, best = [], math.inf
    while (candidate := runner.next_candidate()) is not None:
        t = times[studies.config_key(candidate.config)]
        runner.complete(candidate, {"status": "ok", "time_ms": t} if t is not None else {"status": "launch_error"})
    for trial in study.get_trials(deepcopy=False):
        if studies.counts_toward_budget(trial):
            if trial.user_attrs["status"] == "ok":
                best = min(best, trial.value)
            curve.append(best)
    return curve


def main(argv=None) -> int:
    args = parse_args(argv)
    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    if "cmaes" in samplers:
        try:
            studies.make_sampler("cmaes", 0, {})
        except studies.SearchError:
            print("cmaes is not installed: using gp instead")
            samplers[samplers.index("cmaes")] = "gp"
    if args.grid_csv:
        grid = pd.read_csv(args.grid_csv)
        stem = args.grid_csv.stem
        slug = stem[len("search_quality_grid_"):] if stem.startswith("search_quality_grid_") else stem
    else:
        slug = device_slug()
        grid = measure_grid(args, args.out / f"search_quality_grid_{slug}.csv")
    tunables = list(backends.space(args.backend, "matmul", args.dtype).params)
    records, verdicts = [], []
    for shape, part in grid.groupby("shape", sort=False):
        ok = part[part["status"] == "ok"]
        if ok.empty:
            print(f"{shape}: no config ran; nothing to replay")
            continue
        grid_best, n = ok["time_ms"].min(), len(part)
        budget = max(10, math.ceil(args.budget * n))
        reach: list[float] = []
        for sampler in samplers:
            for seed in range(args.seeds):
                curve = replay(part, tunables, sampler, seed, budget)
                records += [{"shape": shape, "sampler": sampler, "seed": seed, "trial": i + 1, "best_so_far_ms": b}
                            for i, b in enumerate(curve)]
                if sampler == "tpe":
                    hit = next((i + 1 for i, b in enumerate(curve) if b <= grid_best * (1 + WITHIN)), math.inf)
                    reach.append(hit)
        if reach:
            median = statistics.median(reach)
            ok_verdict = median <= GRID_SHARE * n
            verdicts.append(ok_verdict)
            print(f"{shape}: grid of {n} configs, best {grid_best:.4g} ms. TPE gets within {WITHIN:.0%} in a median "
                  f"of {median} trials ({median / n:.0%} of the grid) over {args.seeds} seeds: "
                  f"{'yes' if ok_verdict else 'no'} (<= {GRID_SHARE:.0%} needed)")
    curves = pd.DataFrame(records)
    args.out.mkdir(parents=True, exist_ok=True)
    curves.to_csv(args.out / f"search_quality_{slug}.csv", index=False)
    plot(curves, grid, args.out / f"search_quality_{slug}.png")
    print(f"wrote {args.out / f'search_quality_{slug}.csv'} and .png")
    return 0 if verdicts and all(verdicts) else 1


def plot(curves: pd.DataFrame, grid: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(curves["shape"].unique())
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        part = grid[(grid["shape"] == shape) & (grid["status"] == "ok")]
        best = part["time_ms"].min()
        for sampler, runs in curves[curves["shape"] == shape].groupby("sampler"):
            median = runs.groupby("trial")["best_so_far_ms"].median() / best
            ax.plot(median.index, median.values, label=sampler)
        n = (grid["shape"] == shape).sum()
        ax.axhline(1 + WITHIN, color="grey", linestyle="--", label=f"grid best +{WITHIN:.0%}")
        ax.axvline(GRID_SHARE * n, color="grey", linestyle=":", label=f"{GRID_SHARE:.0%} of the {n}-config grid")
        ax.set(title=f"matmul {shape}", xlabel="trials", ylabel="best so far / grid best (median of seeds)",
               ylim=(0.98, min(3.0, ax.get_ylim()[1])))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
