"""Measuring one config on a pool of worker subprocesses pinned to GPUs.

Workers overlap their compiles; the check and the timing hold their GPU's
lock, so two measurements never share a GPU.
"""
from __future__ import annotations

import threading
from pathlib import Path

from autotune.worker_pool import WorkerProcess, visible_gpus, worker_env
from kernels_core.mlp import Call

CPU_BENCH = {"reps": 5, "max_seconds": 0.2}  # interpreter runs: the numbers only need to exist
GPU_BENCH = {"reps": 100, "max_seconds": 2.0}


class Evaluator:
    def __init__(self, target: str, workers: int | None, timeout: float, log_dir: Path, bench: dict | None = None):
        on_cpu = target == "cpu"
        gpus = [None] if on_cpu else visible_gpus()
        n = workers or len(gpus)
        self.workers = [(WorkerProcess(str(i), worker_env(gpus[i % len(gpus)], interpret=on_cpu),
                                       log_dir / f"worker-{i}.log"), gpus[i % len(gpus)]) for i in range(n)]
        self.gpu_locks = {g: threading.Lock() for g in gpus}
        self.device = "cpu" if on_cpu else "cuda"
        self.bench = bench or (CPU_BENCH if on_cpu else GPU_BENCH)
        self.timeout = timeout

    def __len__(self) -> int:
        return len(self.workers)

    def evaluate(self, index: int, call: Call, backend: str, config: dict | None, seed: int) -> dict:
        """Outcome of `config` on worker `index`: status, error, times, compile figures, gpu."""
        worker, gpu = self.workers[index]
        base = {"backend": backend, "op": call.op, "dtype": call.dtype, "shape": list(call.shape),
                "layout": call.layout, "bias": call.bias, "activation": call.activation, "fused_arg": call.fused_arg,
                "momentum": call.momentum, "device": self.device}
        prepared = worker.request({"cmd": "prepare", **base, "config": config, "seed": seed}, self.timeout)
        if not prepared.get("ok"):
            return {**prepared, "gpu": gpu}
        with self.gpu_locks[gpu]:
            measured = worker.request({"cmd": "measure", **self.bench}, self.timeout)
        keep = {k: prepared.get(k) for k in ("compile_s", "registers", "smem_bytes", "spill_bytes")}
        status = {"status": "ok"} if measured.get("ok") else {}
        return {**keep, **measured, **status, "gpu": gpu}

    def interrupt(self) -> None:
        for worker, _ in self.workers:
            worker.interrupt()

    def close(self) -> None:
        for worker, _ in self.workers:
            worker.close()
