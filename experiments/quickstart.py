"""The main job of the README (`make run`): a short tuning run, then MNIST training.

On a machine with a CUDA GPU:
  1. tune the kernels the default MLP runs (`autotune.search --workload mnist-mlp`,
     a short budget per study) for both twins;
  2. train the default MLP on each backend: cuda and triton on the tuned configs,
     torch with its whole step in one CUDA graph (the twins replay theirs too).
Without a GPU nothing can be timed, so it does what a CPU can and says what it skipped:
  1. compiles the kernels' search spaces offline for sm_90 (`--compile-only`),
     recording registers, shared memory and spills under experiments/runs/quickstart/;
  2. trains with the torch backend on the CPU, and with the Triton backend under
     the Triton interpreter on a few steps of a small model.
Each step is the CLI a user would type, printed before it runs. The summary at
the end says where every output went, each training run's accuracy and step
time, and the command to try next.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from kernels_core.cli import INTERRUPTED, OneLineParser, ctrl_c_ends_the_command, whole_number

with ctrl_c_ends_the_command(__name__ == "__main__"):
    import torch

    from trainer.config import Config
    from trainer.data import SPECS

OUT = Path(Config.out)  # the tools' default --out, under the working directory


class CommandInterrupted(KeyboardInterrupt):
    """Ctrl-C while a command ran; that command has reported it."""


def child_env(environ=os.environ) -> dict[str, str]:
    """The commands' environment. Unbuffered: a child's stdout into a pipe is block-buffered, and its
    lines would come late. And where the environment forbids writing Python's bytecode
    (PYTHONDONTWRITEBYTECODE, as container images often set, with the installed packages left
    without it), each of the run's processes (the search, its compile pool, three training runs)
    would compile torch's modules from source again, about 5 of a training run's 10 s on the H200's
    host (experiments/FINDINGS.md, "Tuner pipeline: compile pool and timing process"): there the
    commands keep their bytecode under <out>/pycache instead, which is this run's own."""
    env = {**environ, "PYTHONUNBUFFERED": "1"}
    if env.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in env:
        del env["PYTHONDONTWRITEBYTECODE"]
        env["PYTHONPYCACHEPREFIX"] = str((OUT / "pycache").resolve())
    return env


def run(cmd: list[str], results: list, env: dict[str, str] | None = None) -> bool:
    """Runs one CLI in `env` (child_env() where not given), its output passed through; a trainer
    run's summary (its JSON), or a search's own figures (trials, rate), goes with its result."""
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    before = set((OUT / "runs").glob("*.json"))
    t0 = time.time()
    command = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, env=child_env() if env is None else env)
    printed = []
    try:
        for line in command.stdout:
            sys.stdout.write(line)
            printed.append(line)
        ok = command.wait() == 0
    except KeyboardInterrupt:
        # A Ctrl-C reaches the whole process group: the command stops on its own and says in one
        # line what it kept, which it could not if it were killed first.
        for line in command.stdout:
            sys.stdout.write(line)
        command.wait()
        raise CommandInterrupted from None
    new = sorted(set((OUT / "runs").glob("*.json")) - before)
    summary = json.loads(new[-1].read_text())["summary"] if ok and new else None
    if ok and cmd[1:3] == ["-m", "autotune.search"] and "--compile-only" not in cmd:
        from autotune.search import summary_figures

        summary = {"tuning": summary_figures("".join(printed))}
    results.append((shlex.join(cmd[2:]), "ok" if ok else "FAILED", time.time() - t0, summary))
    return ok


def _duration(seconds: float) -> str:
    """Seconds under two minutes, minutes above: "about 0 min" says nothing."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def summary_lines(results: list, outputs: list[str], skipped: list[str], next_cmd: str) -> list[str]:
    lines = ["", "=== quickstart summary ==="]
    lines += [f"{status:7} {seconds:7.1f}s  {cmd}" for cmd, status, seconds, _ in results]
    lines += [f"total   {sum(seconds for _, _, seconds, _ in results):7.1f}s"]
    for t in (s["tuning"] for _, _, _, s in results if s and "tuning" in s):
        lines += ["", f"tuning: {t['trials']} trials in {t['tuning_s']:.1f} s, {t['trials_per_s']:.2f} a second "
                      f"({t['workers']} compile processes, {t['timing_processes']} timing, {t['cores']} cores)"]
    trained = [s for _, _, _, s in results if s and "backend" in s]
    if trained:
        lines += ["", "training runs (step time: median; the CSV has every step's loss and time):"]
        lines += [f"  {s['backend']:6} {'graph' if s['graph'] else 'eager'}  H={s['hidden']:<5} {s['steps']:5} steps  "
                  f"test accuracy {s['test_accuracy']:7.2%}  step {s['median_step_us'] / 1e3:9.2f} ms  {s['csv']}"
                  for s in trained]
    lines += [""] + [f"outputs: {o}" for o in outputs]
    lines += [f"skipped: {item}" for item in skipped]
    lines += [f"next:    {next_cmd}"]
    return lines


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m experiments.quickstart",
                       description="Short tuning run plus MNIST training (the README's main job).")
    ap.add_argument("--trials", type=whole_number(1), default=12, help="tuning trials per study (GPU; default 12)")
    args = ap.parse_args(argv)
    try:
        return _quickstart(args)
    except CommandInterrupted:
        return INTERRUPTED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED


def _quickstart(args: argparse.Namespace) -> int:
    py = sys.executable
    env = child_env()
    if "PYTHONPYCACHEPREFIX" in env.keys() - os.environ.keys():
        print(f"PYTHONDONTWRITEBYTECODE is set: the commands below keep their Python bytecode under "
              f"{env['PYTHONPYCACHEPREFIX']}, so that each does not compile torch's modules again")
    results: list = []
    skipped: list[str] = []
    outputs = [f"{OUT / 'runs'}/ (one CSV of steps and one JSON summary per training run)"]
    if torch.cuda.is_available():
        run([py, "-m", "autotune.search", "--workload", "mnist-mlp", "--backends", "cuda,triton",
             "--trials", str(args.trials)], results, env)
        for backend in ("cuda", "triton"):
            run([py, "-m", "trainer.run", "--backend", backend], results, env)
        # torch's whole step in one CUDA graph, as the twins replay theirs: eager, its step time is the
        # host's launch path (1.4-1.7 ms on the H200's host against 0.09 ms for the twins' graphs).
        run([py, "-m", "trainer.run", "--backend", "torch", "--torch-graph"], results, env)
        outputs.insert(0, f"{OUT}/<target>/trials.csv and best.json (the tuned configs the trainer used), "
                          f"{OUT}/tuning.db (Optuna)")
        next_cmd = ("python -m experiments.compare --protocol default --dtype fp32 --quick "
                    "(every variant's step time against torch, a few minutes)")
    else:
        skipped = [
            "timing any kernel and tuning (no CUDA GPU: only offline compilation was done)",
            "the cuda backend of the trainer (raw CUDA needs a GPU)",
            "the full-size triton training run (the Triton interpreter is far too slow for it)",
        ]
        # Not into experiments/sm_90/, which holds the H200's own trials and winners.
        quick = OUT / "runs" / "quickstart"
        run([py, "-m", "autotune.search", "--compile-only", "--target", "sm_90",
             "--ops", "matmul,relu,softmax_cross_entropy", "--backends", "cuda,triton", "--trials", "4",
             "--out", str(quick)], results, env)
        run([py, "-m", "trainer.run", "--backend", "torch", "--epochs", "2"], results, env)
        run([py, "-m", "trainer.run", "--backend", "triton", "--hidden", "32", "--batch-size", "32",
             "--steps", "30"], results, env)
        outputs.insert(0, f"{quick / 'sm_90' / 'trials.csv'} (registers, shared memory and spills per config)")
        torch_run = next((s for _, _, _, s in results if s and s["backend"] == "torch"), None)
        default = Config()
        steps = default.epochs * (SPECS["train_images"].count // default.batch_size)
        took = f", about {_duration(steps * torch_run['median_step_us'] / 1e6)} here" if torch_run else ""
        next_cmd = f"python -m trainer.run --backend torch (the full default run: {default.epochs} epochs{took})"

    print("\n".join(summary_lines(results, outputs, skipped, next_cmd)))
    return 0 if all(status == "ok" for _, status, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
