"""Every figure of the README's results section, measured in one run at the checkout's commit.

    python -m experiments.headline [--quick | --full] [--resume] [--tuned-configs STORE]
    make bench                                     # the same, default mode

On a GPU, in this order (a progress bar per stage, a summary at the end):

  compile  every GEMM kernel and training step the stages below time (the elementwise kernels, three,
           compile as they run), built first in parallel, a process per core, so that those stages
           find them in the disk caches (CuPy's, Triton's, inductor's) and the run's wall time is
           mostly timing
  kernels  elementwise ops against a device copy (256M fp32 elements); square matmuls (4096^3 in
           fp32, fp16, bf16; 8192^3 in fp16, bf16), each twin at its default config and at the
           store's tuned one, against cuBLAS (experiments.bench_kernels)
  gemms    the trainer's GEMMs, both protocols at every width, the same way, timed as CUDA-graph
           replays (the kernels' own time, as in a graphed step)
  steps    the training step of both protocols (kernels_core.mlp.PROTOCOLS) at their widths, 500
           steps a run: each twin on its tuned configs against the torch variants
           (experiments.compare)
  tuning   the tuner's own cost: autotune.search on the default protocol's GEMMs at H = 128 (4
           configs a study; 2 with --quick), as a user runs it, in a fresh folder (trials per
           second, wall time)
  report   plots, then the README's results section rewritten from this run's CSVs alone
           (experiments.report)

The kernel and GEMM stages run every case `ROUNDS` times, each round in a fresh process: a table
shows the median of the rounds and their range; a step time its median step. Each figure carries
how far another run may move it: the wider of its band within the run (the rounds' range, a step
time's 20th-80th percentiles) and the largest move of its kind between two runs on record
(experiments.report; `--rerun` judges a second run and records the pair).

The stages measure into <folder>.partial, which replaces the folder once every stage has finished
ok: a run that fails or is stopped leaves the folder, and the README drawn from it, as they were.

Modes (the default about 5 minutes on the H200 with the shipped store, caches cold):
  default  every protocol width, every torch variant but the two max-autotune ones (which spend
           minutes autotuning a width's GEMMs), whose rows the README marks "--full"
  --full   the max-autotune variants too, at every width (tens of minutes more)
  --quick  H = 128 and 1024, 4096^3 only, one round; writes
           experiments/runs/headline-quick/ and leaves the README as it is
`--resume` goes on with the run that <folder>.partial (else the folder) holds, at the same commit and
store, instead of starting afresh: the stages it records as done are kept, and the training step
measures only the runs its CSVs lack. So a run stopped by a time limit finishes later, and `--full
--resume` after a default run adds the max-autotune variants alone. Its stage times are the sums over
the runs that made them.

Writes experiments/results/<gpu>/headline/: kernels.csv, trainer_gemms.csv, trainer_fp32.csv,
compare_fp16.csv, tuning.csv, stages.csv (each stage's wall time, the commit, the store),
step_time_<protocol>_500steps.png and roofline.png; the log of the whole run goes to
experiments/logs/headline.log.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments.paths import RESULTS, results_dir
from kernels_core.mlp import PROTOCOLS

ROUNDS = 3
STEPS = 500  # per training run: a step time, not the protocol's accuracy
# The torch variants of every width; the max-autotune ones (minutes of autotuning a width:
# experiments/FINDINGS.md, "The headline run") only in a --full run.
TORCH_VARIANTS = ("torch-eager", "torch-graph", "torch-compile", "torch-compile-graph", "torch-reduce-overhead")
MAX_AUTOTUNE_VARIANTS = ("torch-compile-max-graph", "torch-max-autotune")
TWIN_VARIANTS = ("cuda-tuned", "triton-tuned")
SQUARE = (("fp32", 4096), ("fp16", 4096), ("bf16", 4096), ("fp16", 8192), ("bf16", 8192))
# The tuning stage's command, less its --out (and --trials, which the mode sets).
TUNING = ("--workload", "mnist-mlp", "--hidden", "128", "--ops", "matmul")
LOG = RESULTS.parent / "logs" / "headline.log"


@dataclass(frozen=True)
class Plan:
    """What one mode measures."""

    widths: dict[str, tuple[int, ...]]  # protocol -> widths
    max_autotune: bool  # whether the max-autotune variants run (at every width)
    square: tuple[tuple[str, int], ...]
    rounds: int
    tuning_trials: int
    folder: Path
    readme: bool  # whether the run rewrites the README

    @property
    def variants(self) -> list[str]:
        """The training-step variants of every width."""
        return [*TORCH_VARIANTS, *(MAX_AUTOTUNE_VARIANTS if self.max_autotune else ()), *TWIN_VARIANTS]


def plan(mode: str, gpu: str) -> Plan:
    widths = {name: p.widths for name, p in PROTOCOLS.items()}
    if mode == "quick":
        return Plan({name: (128, 1024) for name in PROTOCOLS}, False, SQUARE[:3], 1, 2,
                    RESULTS.parent / "runs" / "headline-quick", readme=False)
    return Plan(widths, mode == "full", SQUARE, ROUNDS, 4, results_dir(gpu) / "headline", readme=True)


def resumable(folder: Path, commit: str, store: str) -> dict[str, dict]:
    """The stages a run in `folder` finished ok, by name, for --resume; a run at another commit or on
    another store is not resumed (its figures would mix)."""
    path = folder / "stages.csv"
    if not path.exists():
        return {}
    rows = pd.read_csv(path, dtype={"commit": str}).to_dict("records")
    for row in rows:
        if (row["commit"], row["config_store"]) != (commit, store):
            raise ValueError(f"{folder} holds a run at commit {row['commit']} on {row['config_store']}, not "
                             f"{commit} on {store}: run without --resume to start afresh")
    return {row["stage"]: row for row in rows if str(row["status"]).startswith("ok")}


# ---------------------------------------------------------------- compile: warm the disk caches
def _warm_worker_init() -> None:
    # One inductor compile process per worker: the pool is already one worker per core.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    sys.stdout = open(os.devnull, "w")  # the trainer's epoch lines; the bar is on stderr


def _warm_train(cfg) -> str:
    from trainer.train import train

    with tempfile.TemporaryDirectory() as tmp:
        train(replace(cfg, steps=3, out=tmp, progress=False))
    return f"{cfg.backend} {cfg.compile or ''} h{cfg.hidden}"


def _warm_gemm(case, backend: str, config) -> str:
    import torch

    from experiments import bench_kernels
    from kernels_core import backends as kernel_packages

    gen = torch.Generator(device="cuda").manual_seed(0)
    args, kw, _, _ = bench_kernels.make_call(case, gen, torch.device("cuda"))
    getattr(kernel_packages.load(backend), case.op)(*args, **kw, config=config)
    torch.cuda.synchronize()
    return f"{backend} {case.shape}"


def warm_jobs(p: Plan, store_path: Path | None, cases) -> list[tuple]:
    from experiments import compare

    jobs = [(_warm_gemm, case, backend, config) for case in cases
            for backend, configs in case.configs.items() for _, config in configs]
    seen = set()
    for protocol, widths in p.widths.items():
        base = compare.base_config(protocol, PROTOCOLS[protocol].dtype, STEPS)
        for h in widths:
            for variant in p.variants:
                spec = dict(compare.VARIANTS[variant])
                if compare.autotunes(variant) or spec.get("compile") is None and spec["backend"] == "torch":
                    continue  # max-autotune times itself as it compiles; eager and graph build nothing
                if spec.get("tuned_configs") == "TUNED":
                    spec["tuned_configs"] = str(store_path)
                cfg = replace(base, hidden=h, **spec)
                # Whether torch's step is then captured in a graph changes nothing inductor compiles.
                key = repr(replace(cfg, torch_graph=False))
                if key not in seen:
                    seen.add(key)
                    jobs.append((_warm_train, cfg))
    return jobs


def compile_stage(p: Plan, jobs: list[tuple], log) -> int:
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 2))
    failed = 0
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_warm_worker_init) as pool, \
            tqdm(total=len(jobs), desc=f"compile ({workers} processes)", unit="job") as bar:
        for future in as_completed([pool.submit(fn, *args) for fn, *args in jobs]):
            try:
                log(f"warm: {future.result()}")
            except Exception as exc:  # the timed stage meets the same failure and records it
                failed += 1
                log(f"warm FAILED: {type(exc).__name__}: {exc}")
            bar.update()
    return failed


# ---------------------------------------------------------------- timed stages
def kernels_stage(p: Plan, square, log) -> None:
    from experiments import bench_kernels

    rows = 65536  # x 4096: 256M elements, 1 GiB in fp32, far past L2
    _bench(bench_kernels.elementwise_cases(rows) + square, rows * 4096, p.folder / "kernels.csv", p.rounds, "kernels",
           log)


def gemms_stage(p: Plan, cases, log) -> None:
    _bench(cases, None, p.folder / "trainer_gemms.csv", p.rounds, "gemms", log)


def _bench(cases, copy_elements: int | None, out: Path, rounds: int, name: str, log, measure_round=None) -> None:
    """Every case `rounds` times, each round in a process of its own, one after another: a figure's range
    then holds what moves between processes (where the allocator puts the inputs, which kernels the
    caches hand back), which the rounds of one process hid (experiments/FINDINGS.md, "The headline run")."""
    parts = [out.with_name(f"{out.stem}.round{rep}.csv") for rep in range(rounds)]
    with tqdm(total=len(cases) * rounds, desc=f"{name} ({rounds} processes)", unit="case") as bar:
        for rep, part in enumerate(parts):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                pool.submit(measure_round or _bench_round, cases, copy_elements, part, LOG).result()
            log(f"{name}: round {rep + 1} of {rounds} done")
            bar.update(len(cases))
    pd.concat(pd.read_csv(part, dtype=str, keep_default_na=False).assign(rep=str(rep))
              for rep, part in enumerate(parts)).to_csv(out, index=False)
    for part in parts:
        part.unlink()


def _bench_round(cases, copy_elements: int | None, out: Path, log_path: Path) -> None:
    from experiments import bench_kernels
    from kernels_core import backends as kernel_packages
    from kernels_core.reference import native

    backends = {"cuda": kernel_packages.load("cuda"), "triton": kernel_packages.load("triton"), "torch": native}
    with log_path.open("a") as log_file:
        bench_kernels.measure(cases, backends, copy_elements, out, 1,
                              log=lambda text: print(text, file=log_file, flush=True))


def steps_stage(p: Plan, store_path: Path | None, log) -> None:
    from experiments import compare

    runs = sum(len(p.variants) * len(widths) for widths in p.widths.values())
    with tqdm(total=runs, desc="steps", unit="run") as bar:
        for protocol, widths in p.widths.items():
            compare.measure(protocol, PROTOCOLS[protocol].dtype, list(widths), p.variants, steps=STEPS,
                            autotune_hidden=set(widths) if p.max_autotune else set(), tuned=store_path,
                            out=p.folder / compare.csv_name(protocol), log=log, done_one=bar.update)


def tuning_stage(p: Plan, log) -> None:
    from autotune.search import summary_figures
    from kernels_core.provenance import provenance

    with tempfile.TemporaryDirectory() as tmp, tqdm(total=1, desc="tuning", unit="run") as bar:
        cmd = [sys.executable, "-m", "autotune.search", *TUNING, "--trials", str(p.tuning_trials), "--out", tmp]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        log(done.stdout + done.stderr)
        if done.returncode:
            raise RuntimeError(f"autotune.search exited {done.returncode}: {done.stderr.strip()[-300:]}")
        trials = pd.concat([pd.read_csv(f) for f in Path(tmp).glob("*/trials.csv")])
        bar.update()
    figures = summary_figures(done.stdout)
    row = {**provenance(), "command": " ".join(["python", *cmd[1:-2], "--out", "DIR"]),
           "studies": trials.study.nunique(), "trials": len(trials), "ok_trials": int((trials.status == "ok").sum()),
           "wall_s": wall, "trials_per_s": len(trials) / wall, "workers": figures["workers"],
           "cores": figures["cores"]}
    pd.DataFrame([row]).to_csv(p.folder / "tuning.csv", index=False)


def report_stage(p: Plan, gpu: str, log) -> None:
    from experiments import plots, report

    for make in (plots.step_time, plots.roofline):
        for path in make(p.folder):
            log(f"plot {path}")
    if p.readme:
        report.write_readme(gpu)


# ---------------------------------------------------------------- the run
def summary(p: Plan, stages: list[dict]) -> str:
    from experiments import compare, report

    lines = ["", "stage     seconds  status"]
    lines += [f"{s['stage']:9} {s['seconds']:7.0f}  {s['status']}" for s in stages]
    lines.append(f"total     {sum(s['seconds'] for s in stages):7.0f}")
    for protocol in p.widths:
        path = p.folder / compare.csv_name(protocol)
        if path.exists():
            lines += ["", f"{protocol} protocol, median step µs (x = the fastest torch variant / the twin):"]
            lines += report.headline_steps(report.load_compare(path)).to_string(index=False).splitlines()
    path = p.folder / "tuning.csv"
    if path.exists():
        t = pd.read_csv(path).iloc[0]
        lines += ["", f"tuning: {t.trials} trials in {t.wall_s:.0f} s, {t.trials_per_s:.2f} trials/s ({t.command})"]
    lines += ["", f"CSVs and plots: {p.folder}", f"log: {LOG}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="two widths, one round; the README untouched")
    mode.add_argument("--full", action="store_true", help="the max-autotune torch variants at every width too")
    ap.add_argument("--resume", action="store_true",
                    help="go on with the run the folder holds (same commit and store) instead of starting afresh")
    ap.add_argument("--tuned-configs", default=None,
                    help="tuned store (default experiments/<target>/best.json, else the one shipped for this GPU)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("headline needs a CUDA GPU: every figure it writes is a GPU measurement.", file=sys.stderr)
        return 2
    from experiments import bench_kernels
    from kernels_core.provenance import device_slug, provenance
    from kernels_core.store import choose_local_store, load_store
    from trainer.tuned_configs import target_name

    gpu = device_slug()
    p = plan("quick" if args.quick else "full" if args.full else "default", gpu)
    if args.tuned_configs:
        store_path = Path(args.tuned_configs)
        print(f"config store: {store_path} (given)")
    else:
        choice = choose_local_store(RESULTS.parent)
        store_path = choice.path
        print(f"config store: {choice.note}")
    store = load_store(store_path, target_name("auto")) if store_path else None
    store_name = str(store_path.resolve().relative_to(Path.cwd())) if store_path and store_path.resolve().is_relative_to(
        Path.cwd()) else str(store_path or "none: default configs")
    commit = provenance()["commit"]
    final, work = p.folder, p.folder.with_name(p.folder.name + ".partial")
    prior = {}
    if args.resume:
        source = work if work.exists() else final
        try:
            prior = resumable(source, commit, store_name)
        except ValueError as exc:
            ap.error(str(exc))
        if source == final and final.exists():
            shutil.copytree(final, work)
    elif work.exists():
        shutil.rmtree(work)  # a run's folder holds that run alone
    work.mkdir(parents=True, exist_ok=True)
    p = replace(p, folder=work)
    LOG.parent.mkdir(parents=True, exist_ok=True)
    print(f"headline, {'quick' if args.quick else 'full' if args.full else 'default'} mode, commit {commit}, "
          f"measuring into {work}")

    with LOG.open("a" if args.resume else "w") as log_file:
        def log(text: str) -> None:
            log_file.write(text.rstrip("\n") + "\n")
            log_file.flush()

        gemm_cases = bench_kernels.trainer_cases(store, p.widths)
        square = bench_kernels.gemm_cases(list(p.square), store)
        stages = [
            ("compile", lambda: compile_stage(p, warm_jobs(p, store_path, gemm_cases + square), log)),
            ("kernels", lambda: kernels_stage(p, square, log)),
            ("gemms", lambda: gemms_stage(p, gemm_cases, log)),
            ("steps", lambda: steps_stage(p, store_path, log)),
            ("tuning", lambda: tuning_stage(p, log)),
        ]
        done = []
        for name, run in stages:
            # Kept from the run resumed: every finished stage but the steps, which measure only the runs
            # their CSVs lack (a --full resume adds the max-autotune ones).
            if name in prior and name != "steps":
                done.append(prior[name])
            else:
                start = time.perf_counter() - (prior[name]["seconds"] if name in prior else 0.0)
                try:
                    with contextlib.redirect_stdout(log_file):  # the trainer's and tuner's lines; bars on stderr
                        result = run()
                    status = f"ok ({result} warm-up jobs failed)" if name == "compile" and result else "ok"
                except Exception as exc:  # one stage failing must not cost the others' figures
                    status = f"FAILED: {type(exc).__name__}: {exc}"
                    log(status)
                done.append({"stage": name, "seconds": time.perf_counter() - start, "status": status,
                             "commit": commit, "config_store": store_name})
            pd.DataFrame(done).to_csv(work / "stages.csv", index=False)
        failed = [s for s in done if not s["status"].startswith("ok")]
        if failed:
            print(f"a stage failed: what was measured is in {work}, and --resume goes on from there; {final} "
                  "and the README are as they were", file=sys.stderr)
        else:
            if final.exists():
                shutil.rmtree(final)
            work.rename(final)
            p = replace(p, folder=final)
            start = time.perf_counter()
            try:  # stages.csv, which the README quotes, keeps the measuring stages only
                report_stage(p, gpu, log)
                status = "ok, README rewritten" if p.readme else "ok, README untouched"
            except Exception as exc:  # the figures are safe in the folder: `python -m experiments.report` retries
                status = f"FAILED: {type(exc).__name__}: {exc}"
                failed.append(status)
            done.append({"stage": "report", "seconds": time.perf_counter() - start, "status": status})
    print(summary(p, done))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
