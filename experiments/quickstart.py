"""The main job of the README (`make run`): a short tuning run, then MNIST training.

On a machine with a CUDA GPU:
  1. tune the kernels the default MLP runs (`autotune.search --workload mnist-mlp`,
     a short budget per study) for both twins;
  2. train the default MLP on each backend (cuda, triton, torch) on the tuned
     configs and print one summary table.
Without a GPU nothing can be timed, so it does what a CPU can and says what it skipped:
  1. compiles the kernels' search spaces offline for sm_90 (`--compile-only`),
     recording registers, shared memory and spills under experiments/runs/quickstart/;
  2. trains with the torch backend on the CPU, and with the Triton backend under
     the Triton interpreter on a few steps of a small model.
Each step is the CLI a user would type, printed before it runs.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time

import torch


def run(cmd: list[str], results: list) -> bool:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    t0 = time.time()
    ok = subprocess.run(cmd).returncode == 0
    results.append((shlex.join(cmd[2:]), "ok" if ok else "FAILED", time.time() - t0))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Short tuning run plus MNIST training (the README's main job).")
    ap.add_argument("--trials", type=int, default=12, help="tuning trials per study (GPU)")
    args = ap.parse_args(argv)
    py = sys.executable
    results: list = []
    skipped: list[str] = []
    if torch.cuda.is_available():
        run([py, "-m", "autotune.search", "--workload", "mnist-mlp", "--backends", "cuda,triton",
             "--trials", str(args.trials)], results)
        for backend in ("cuda", "triton", "torch"):
            run([py, "-m", "trainer.run", "--backend", backend], results)
    else:
        skipped = [
            "timing any kernel and tuning (no CUDA GPU: only offline compilation was done)",
            "the cuda backend of the trainer (raw CUDA needs a GPU)",
            "the full-size triton training run (the Triton interpreter is far too slow for it)",
        ]
        # Not into experiments/sm_90/, which holds the H200's own trials and winners.
        run([py, "-m", "autotune.search", "--compile-only", "--target", "sm_90",
             "--ops", "matmul,relu,softmax_cross_entropy", "--backends", "cuda,triton", "--trials", "4",
             "--out", "experiments/runs/quickstart"], results)
        run([py, "-m", "trainer.run", "--backend", "torch", "--epochs", "2"], results)
        run([py, "-m", "trainer.run", "--backend", "triton", "--hidden", "32", "--batch-size", "32",
             "--steps", "30"], results)

    print("\n=== quickstart summary ===")
    for cmd, status, seconds in results:
        print(f"{status:7} {seconds:7.1f}s  {cmd}")
    for item in skipped:
        print(f"skipped: {item}")
    return 0 if all(status == "ok" for _, status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
