"""Measuring one config on a pool of worker subprocesses pinned to GPUs, and compiling configs
ahead of their measurement on a pool of its own.

Evaluator: workers overlap their compiles; the check and the timing hold their GPU's
lock, so two measurements never share a GPU. The tuner gives it one worker per GPU, which
times configs one at a time, and compiles them first on a CompilePool: processes on the host's
other cores that compile a call's kernels without launching them (kernels_core.compile_only),
so the timing worker finds them in the kernel libraries' disk caches and its GPU runs nothing
but the measurement under way.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from autotune.worker_pool import WorkerProcess, visible_gpus, worker_env
from kernels_core.mlp import Call

CPU_BENCH = {"reps": 5, "max_seconds": 0.2}  # interpreter runs: the numbers only need to exist
GPU_BENCH = {"reps": 100, "max_seconds": 2.0}
# A worker's crash, hang or failure to launch: counted against the worker, in a row
# (--max-failures-in-a-row), since a lost GPU fails every config the same way.
WORKER_FAILURES = ("launch_error", "timeout")
# An ask runs no kernel, and --timeout is a compile's or a measurement's bound. It may still wait a
# while: for a claim of a process that died on another host until its heartbeat is stale
# (autotune.storage's GRACE_S), for SQLite's write lock (its 120 s). Longer than all that, it hangs.
ASK_TIMEOUT_S = 600.0


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_compilers(target: str, most: int) -> int:
    """Compile processes when --workers is not given: none on the cpu target (its interpreter compiles
    nothing), else the host's cores but one per GPU's timing process and one for the search."""
    if target == "cpu":
        return 0
    return max(1, min(most, host_cores() - len(visible_gpus()) - 1))


def request(call: Call, backend: str, device: str) -> dict:
    """What a worker needs to know of a call, as its protocol spells it (autotune.worker)."""
    return {"backend": backend, "op": call.op, "dtype": call.dtype, "shape": list(call.shape), "layout": call.layout,
            "bias": call.bias, "activation": call.activation, "fused_arg": call.fused_arg,
            "momentum": call.momentum, "device": device}


class _Pool:
    """Worker processes pinned to the visible GPUs in turn (on the cpu target, to none)."""

    def __init__(self, target: str, n: int | None, timeout: float, log_dir: Path, name: str):
        on_cpu = target == "cpu"
        self.gpus = [None] if on_cpu else visible_gpus()
        n = len(self.gpus) if n is None else n  # one per GPU
        self.workers = [(WorkerProcess(f"{name}{i}", worker_env(self.gpus[i % len(self.gpus)], interpret=on_cpu),
                                       log_dir / f"{name or 'worker-'}{i}.log"), self.gpus[i % len(self.gpus)])
                        for i in range(n)]
        self.device = "cpu" if on_cpu else "cuda"
        self.timeout = timeout

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> None:
        """Starts every worker process, waiting for none (WorkerProcess.start)."""
        for worker, _ in self.workers:
            worker.start()

    def interrupt(self) -> None:
        for worker, _ in self.workers:
            worker.interrupt()

    def close(self) -> None:
        close_pools(self)


def close_pools(*pools: _Pool) -> None:
    """Ends every worker of `pools`: all are told to exit before any is waited for."""
    for pool in pools:
        for worker, _ in pool.workers:
            worker.ask_to_exit()
    for pool in pools:
        for worker, _ in pool.workers:
            worker.close()


class Evaluator(_Pool):
    def __init__(self, target: str, workers: int | None, timeout: float, log_dir: Path, bench: dict | None = None):
        super().__init__(target, workers or None, timeout, log_dir, "")
        self.gpu_locks = {g: threading.Lock() for g in self.gpus}
        self.bench = bench or (CPU_BENCH if target == "cpu" else GPU_BENCH)
        # Where the timing processes' time goes, over the pool's life: loading a config (fresh inputs, its
        # kernels from the disk caches, a first call) and measuring it (the check, then the timing).
        self.evaluations, self.load_s, self.measure_s = 0, 0.0, 0.0
        self._stats = threading.Lock()

    def evaluate(self, index: int, call: Call, backend: str, config: dict | None, seed: int) -> dict:
        """Outcome of `config` on worker `index`: status, error, times, compile figures, gpu."""
        worker, gpu = self.workers[index]
        base = request(call, backend, self.device)
        worker.wait_ready()  # a process's start (after a crash too) is no part of a measurement's time
        start = time.perf_counter()
        prepared = worker.request({"cmd": "prepare", **base, "config": config, "seed": seed}, self.timeout)
        loaded = time.perf_counter() - start
        if not prepared.get("ok"):
            return {**prepared, "gpu": gpu}
        with self.gpu_locks[gpu]:
            start = time.perf_counter()
            measured = worker.request({"cmd": "measure", **self.bench}, self.timeout)
            measuring = time.perf_counter() - start
        if measured.get("status") not in WORKER_FAILURES:  # a hang's or a crash's wait is no measurement
            with self._stats:
                self.evaluations += 1
                self.load_s += loaded
                self.measure_s += measuring
        keep = {k: prepared.get(k) for k in ("compile_s", "registers", "smem_bytes", "spill_bytes")}
        status = {"status": "ok"} if measured.get("ok") else {}
        return {**keep, **measured, **status, "gpu": gpu}


class CompilePool(_Pool):
    """Processes that compile configs for the GPUs an Evaluator times on, `workers` at once."""

    def __init__(self, target: str, workers: int, timeout: float, log_dir: Path):
        super().__init__(target, workers, timeout, log_dir, "compile-")

    def ask(self, index: int, spec: dict, sampler_seed: int, row: dict, recorder: str) -> dict:
        """Worker `index` asks a study for its next config (autotune.asking.Asker.ask), or its failure."""
        worker, gpu = self.workers[index]
        return {**worker.request({"cmd": "ask", "spec": spec, "sampler_seed": sampler_seed, "row": row,
                                  "recorder": recorder}, ASK_TIMEOUT_S), "gpu": gpu}

    def restarts(self, index: int) -> int:
        """How often worker `index` was started again after a crash or a hang."""
        return self.workers[index][0].restarts

    def build(self, index: int, call: Call, backend: str, config: dict | None, seed: int) -> dict:
        """{"ok": True, "compile_s"} once worker `index` compiled every kernel of the call at
        `config`, else the failure as a trial's outcome (status, error)."""
        worker, gpu = self.workers[index]
        answer = worker.request({"cmd": "build", **request(call, backend, self.device), "config": config,
                                 "seed": seed}, self.timeout)
        return {**answer, "gpu": gpu}
