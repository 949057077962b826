"""What the tuner's own process spends on a trial, and how fast it can feed a GPU (no GPU needed).

    python -m experiments.tuner_bookkeeping [--trials 12[,50]] [--rounds 3] [--measure-ms 30] [--compile-ms 500] [--workers 14]

`make run`'s tuning plan (both twins, --workload mnist-mlp, sm_90's spaces), every config
answered at once with a random time: each study opened by the search's own Search.open and
driven through its StudyRunner (ask, suggest, the rules, the claim and its heartbeat, the tell and
its trials.csv row), on a new SQLite storage as the search's default, all in one process. What is
left is the cost per trial of an ask (the sampler, the claim and their round trips to the storage:
a compile process's work in the pipeline, autotune.asking) and of a tell (the search process's).

Then the whole pipeline (`pipeline` rows): the same studies through Search.run itself, its compile
threads, timing thread and teller. Each of --workers compile processes is a process that asks the
studies for configs as a compile process does (autotune.asking) and then waits instead of compiling,
about --compile-ms (half to one and a half times it); the timing process is a wait of --measure-ms
(the H200's timing process spent 30 ms a measurement in `make run`, tuning_speed.csv's load_ms +
measure_ms). The search process's CPU a trial is what bounds one GPU's rate on a host with a core
for each process; the ask processes' CPU a trial (their start, imports and study opens included)
is what the compile pool spends beside its compiles. On a host with fewer cores than processes the
rate is the host's, not the pipeline's.

-> experiments/results/<device>/tuner_bookkeeping.csv: a row per budget, round and kind: seconds to open
   the studies, trials, and per trial the ask (sampler and claim) and the tell, in ms (`direct`);
   trials a second, the search process's and the ask processes' CPU ms a trial, the timing lane's
   busy share and the asks answered WAIT (`pipeline`).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import optuna

from autotune import asking, search
from autotune.evaluate import host_cores
from autotune.plan import build_plan
from autotune.studies import WAIT
from autotune.tuning import Search
from experiments.paths import write_results
from kernels_core.provenance import provenance


def make_runs_search(trials: int, seed: int, work: Path, *flags: str) -> Search:
    """The search of make run's tuning step (both twins, --workload mnist-mlp, `trials` a study, more
    autotune.search `flags`) on sm_90's spaces, in `work` on a new SQLite storage; its worker pools
    made, not started."""
    args = search.parse_args(["--workload", "mnist-mlp", "--backends", "cuda,triton", "--trials", str(trials),
                              "--seed", str(seed), "--out", str(work), "--storage", f"sqlite:///{work / 'tuning.db'}",
                              *flags])
    # sm_90's spaces, planned as a compile-only run plans them: this needs no GPU, and times nothing.
    args.target, args.compile_only = "sm_90", True
    # Naming the pools' processes needs a GPU id.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    return Search(build_plan(args), args, trials)


def one_round(trials: int, seed: int, work: Path) -> dict:
    """make run's studies opened and run to their budget by the search's own code (Search.open, its
    StudyRunner, heartbeat and trials.csv), no worker started: every config answered at once."""
    tuner = make_runs_search(trials, seed, work)
    tuner.bar = SimpleNamespace(update=lambda n: None)  # record() moves a progress bar: none to show here
    rand = random.Random(seed)
    opened = asked = told = 0.0
    n = 0
    try:
        for order, job in enumerate(tuner.plan.jobs):
            start = time.perf_counter()
            runner = tuner.open(order, job).runner
            opened += time.perf_counter() - start
            while True:
                start = time.perf_counter()
                candidate = runner.poll()
                asked += time.perf_counter() - start
                if candidate is None:
                    break
                start = time.perf_counter()
                runner.complete(candidate, {"status": "ok", "time_ms": rand.random()})
                told += time.perf_counter() - start
                n += 1
    finally:
        tuner.heartbeat.stop()
        tuner.csv.close()
    return {"sampler": tuner.args.sampler, "studies": len(tuner.plan.jobs), "open_s": round(opened, 2), "trials": n,
            "ask_ms": round(1e3 * asked / n, 1), "tell_ms": round(1e3 * told / n, 1),
            "per_trial_ms": round(1e3 * (asked + told) / n, 1)}


class _Waits:
    """Stands in for a pool of worker processes: each request is a wait, so what is measured is the
    search process around them."""

    workers = ()  # no process to end (close_pools)

    def __init__(self, size: int, seconds: float, rand: random.Random):
        self.size, self.seconds, self.rand, self.busy = size, seconds, rand, 0.0

    def __len__(self) -> int:
        return self.size

    def start(self) -> None:
        pass

    interrupt = start

    def evaluate(self, index, call, backend, config, seed) -> dict:
        time.sleep(self.seconds)
        self.busy += self.seconds
        return {"status": "ok", "time_ms": self.rand.random(), "gpu": "0"}

    def build(self, index, call, backend, config, seed) -> dict:
        seconds = self.seconds * (0.5 + self.rand.random())
        time.sleep(seconds)
        return {"ok": True, "compile_s": seconds, "gpu": "0"}


class _Compiles(_Waits):
    """Stands in for the compile pool: each compile a wait, each ask made as compile process `index`
    makes it (autotune.asking), in a process of its own, started on its first ask."""

    def __init__(self, size: int, seconds: float, rand: random.Random):
        super().__init__(size, seconds, rand)
        spawn = multiprocessing.get_context("spawn")
        self.processes = [ProcessPoolExecutor(1, mp_context=spawn) for _ in range(size)]

    def ask(self, index, spec, sampler_seed, row, recorder) -> dict:
        return self.processes[index].submit(asking.ask, spec, sampler_seed, row, recorder).result()

    def restarts(self, index) -> int:
        return 0

    def shutdown(self) -> None:
        """Ends the processes, waiting for each: their CPU time then counts as this process's children's."""
        for process in self.processes:
            process.shutdown()


def pipeline_round(trials: int, seed: int, work: Path, measure_ms: float, compile_ms: float, workers: int) -> dict:
    """make run's studies through Search.run, with one GPU's timing process replaced by a wait and
    `workers` compile processes by processes that ask and then wait."""
    tuner, rand = make_runs_search(trials, seed, work, "--workers", str(workers)), random.Random(seed)
    tuner.pool, tuner.compilers = _Waits(1, measure_ms / 1e3, rand), _Compiles(workers, compile_ms / 1e3, rand)
    waits, ask = [0], tuner._ask

    def counted(index, lane):
        answer = ask(index, lane)
        waits[0] += answer is WAIT
        return answer

    tuner._ask = counted
    cpu, children = time.process_time(), _children_cpu()
    try:
        tuner.run()
    finally:
        tuner.compilers.shutdown()
    cpu, asks_cpu = time.process_time() - cpu, _children_cpu() - children
    n = sum(tuner.outcomes.values())
    return {"studies": len(tuner.plan.jobs), "trials": n, "compile_processes": workers, "measure_ms": measure_ms,
            "compile_ms": compile_ms, "tuning_s": round(tuner.seconds, 1), "trials_per_s": round(n / tuner.seconds, 2),
            "cpu_ms_per_trial": round(1e3 * cpu / n, 1), "ask_cpu_ms_per_trial": round(1e3 * asks_cpu / n, 1),
            "lane_busy": round(tuner.pool.busy / tuner.seconds, 2), "asks_answered_wait": waits[0]}


def _children_cpu() -> float:
    """CPU seconds of this process's ended children (the ask processes, once shut down)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tuner_bookkeeping", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", default="12", help="measured configs a study, or a comma list of budgets each "
                   "measured in turn (default 12, make run's; the workload search's is 50)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind, each on a new storage (default 3)")
    p.add_argument("--measure-ms", type=float, default=30.0, help="a measurement's wait in the pipeline rounds "
                   "(default 30, the H200's)")
    p.add_argument("--compile-ms", type=float, default=500.0, help="a compile's mean wait (default 500)")
    p.add_argument("--workers", type=int, default=14, help="compile processes in the pipeline rounds (default 14, "
                   "what the search starts on the H200's 16 cores)")
    args = p.parse_args(argv)
    try:
        budgets = [int(b) for b in args.trials.split(",")]
    except ValueError:
        p.error(f"--trials {args.trials}: expected whole numbers, e.g. 12 or 12,50")
    if min(budgets) < 1:
        p.error(f"--trials {args.trials}: a study measures at least 1 config")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows, prov = [], provenance()
    for budget in budgets:
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                row = one_round(budget, r, Path(tmp))
            rows.append({**prov, "kind": "direct", "budget": budget, "round": r, "storage": "sqlite",
                         "cores": host_cores(), **row})
            print(f"{budget} a study, round {r}: {row['trials']} trials, {row['per_trial_ms']} ms a trial (ask "
                  f"{row['ask_ms']}, tell {row['tell_ms']}); {row['open_s']} s to open {row['studies']} studies",
                  flush=True)
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                row = pipeline_round(budget, r, Path(tmp), args.measure_ms, args.compile_ms, args.workers)
            rows.append({**prov, "kind": "pipeline", "budget": budget, "round": r, "storage": "sqlite",
                         "cores": host_cores(), **row})
            print(f"{budget} a study, pipeline round {r}: {row['trials_per_s']} trials a second, "
                  f"{row['cpu_ms_per_trial']} ms of the search process's CPU a trial and "
                  f"{row['ask_cpu_ms_per_trial']} of the ask processes', the timing lane busy "
                  f"{row['lane_busy']:.0%}, {row['asks_answered_wait']} asks answered WAIT", flush=True)
    write_results(rows, "tuner_bookkeeping.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
