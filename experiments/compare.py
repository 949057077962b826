"""The seed study, redone: PyTorch vs raw CUDA vs Triton MLP training per hidden width.

    python -m experiments.compare [--protocol seed|default] [--dtype fp16|fp32]
        [--hidden 128,256,...] [--variants torch-eager,cuda-tuned,...] [--max-autotune-hidden 128,...]
        [--steps N] [--quick]

The seed project trained 784-H-H-H-10 on MNIST (batch 32, plain SGD lr 0.003,
5000 steps, fp16) and reported step-time speedups of CUDA over PyTorch. Here
every variant trains the same protocol from the same initial weights and
data order (trainer.train), so besides the step time we also get the final
loss, the test accuracy and the per-step loss difference against torch eager.

Variants (`VARIANTS`): torch eager; torch with the whole step, batch gather
included, in one CUDA graph; torch.compile of the model with its loss and of
the SGD step, alone, inside that graph (mode default, and
max-autotune-no-cudagraphs), or in the modes that bring inductor's own CUDA
graphs (reduce-overhead, max-autotune); and the cuda/triton backends on tuned
configs (experiments/<target>/best.json) and on their defaults, running the
fused step (trainer.model), and on tuned configs unfused (`--no-fuse`), so
a table shows what fusion buys, and with the step's GEMMs as programmatic
dependent launches (`--pdl early|exit`, sm_90+: each placed on the GPU
while the one before it ends), and the persistent training kernel
(`--persistent`, cuda-persistent and triton-persistent: a segment of steps in
one launch, on the tuned store's config for the net, op "persistent"). `ops_per_step` counts a step's GPU
operations (kernels, memsets, copies), batch draw and loss record included. The
max-autotune variants run only at the `--max-autotune-hidden` widths: they
spend ~35 s per GEMM shape. Warm-up, compilation and autotuning are
`setup_seconds`, kept out of the step times.

Each row's speedups are against the torch rows of its own run key (width,
dtype, protocol, run length, commit): torch eager, and the fastest torch
variant there at the run's own precision (`best_torch_variant`): the fp32
variant with TF32 matmuls (torch-compile-graph-tf32, fp32 runs only) is
timed, and its loss tracked against eager's, but never the one others are
held to. `--steps N` makes a step-time-only run
(run length "N steps", its own key); its accuracy is not the protocol's.

Writes experiments/results/<gpu>/<stem>_<dtype>.csv (stem `compare` for the
seed protocol, `trainer` for the trainer's default protocol), one row per
variant x H, and a loss-curve file per variant (every 10th step; runs of the
protocol's own length only). A rerun skips rows already there for the same
commit and settings.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import hashlib
import statistics
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from kernels_core.provenance import provenance
from kernels_core.store import choose_local_store
from kernels_core.mlp import PROTOCOLS
from trainer.config import Config
from trainer.train import train
from experiments.paths import RESULTS, results_dir

VARIANTS = {
    "torch-eager": dict(backend="torch"),
    "torch-graph": dict(backend="torch", torch_graph=True),
    "torch-compile": dict(backend="torch", compile="default"),
    "torch-compile-graph": dict(backend="torch", compile="default", torch_graph=True),
    "torch-compile-max-graph": dict(backend="torch", compile="max-autotune-no-cudagraphs", torch_graph=True),
    "torch-reduce-overhead": dict(backend="torch", compile="reduce-overhead"),
    "torch-max-autotune": dict(backend="torch", compile="max-autotune"),
    # fp32 only: a lower precision, timed and tracked beside the others, never the "best torch" they are held to.
    "torch-compile-graph-tf32": dict(backend="torch", compile="default", torch_graph=True, tf32=True),
    "cuda-tuned": dict(backend="cuda", tuned_configs="TUNED"),
    "cuda-tuned-unfused": dict(backend="cuda", tuned_configs="TUNED", fuse=False),
    "cuda-tuned-pdl-early": dict(backend="cuda", tuned_configs="TUNED", pdl="early"),
    "cuda-tuned-pdl-exit": dict(backend="cuda", tuned_configs="TUNED", pdl="exit"),
    "cuda-default": dict(backend="cuda", tuned_configs="none"),
    "triton-tuned": dict(backend="triton", tuned_configs="TUNED"),
    "triton-tuned-unfused": dict(backend="triton", tuned_configs="TUNED", fuse=False),
    "triton-tuned-pdl-early": dict(backend="triton", tuned_configs="TUNED", pdl="early"),
    "triton-tuned-pdl-exit": dict(backend="triton", tuned_configs="TUNED", pdl="exit"),
    "triton-default": dict(backend="triton", tuned_configs="none"),
    "cuda-persistent": dict(backend="cuda", persistent="on", tuned_configs="TUNED"),
    "triton-persistent": dict(backend="triton", persistent="on", tuned_configs="TUNED"),
}
# A row is redone only when one of these changed: `run_length` is what was asked ("5000 steps",
# "10 epochs"), `tuned_configs_sha` the tuned store the row ran on (the store is data, not code).
KEY = ("variant", "hidden", "dtype", "protocol", "run_length", "tuned_configs_sha", "commit")
RUN = tuple(k for k in KEY if k not in ("variant", "tuned_configs_sha"))  # the rows a row is measured against
COLUMNS = ["variant", "backend", "hidden", "layers", "batch_size", "dtype", "protocol", "run_length", "steps",
           "fused", "ops_per_step", "median_step_us", "p20_step_us", "p80_step_us", "train_seconds", "setup_seconds", "final_loss",
           "test_accuracy", "seconds_to_98", "speedup_vs_torch_eager", "speedup_vs_best_torch", "best_torch_variant",
           "max_loss_diff_vs_torch_eager", "tracks_torch_eager", "config_source", "tuned_configs_sha", "run_csv",
           *provenance()]
# The trainer tests' bar (tests/test_trainer_gpu.py): two correct fp32 runs of the default protocol differ
# only in rounding order, which SGD with momentum grows from ~1e-6 at step 5 to ~1e-2 at step 100.
TRACKING = ((5, 1e-4), (100, 5e-2))  # (first steps, largest relative loss difference)


def lower_precision(variant: str) -> bool:
    """Whether the variant computes below its run's dtype (torch's TF32 matmuls in an fp32 run)."""
    return VARIANTS.get(variant, {}).get("tf32", False)


def autotunes(variant: str) -> bool:
    """Whether the variant runs inductor's max-autotune (~35 s per GEMM shape on the H200)."""
    return VARIANTS[variant].get("compile", "").startswith("max-autotune")


def base_config(protocol: str, dtype: str, steps: int | None) -> Config:
    values = PROTOCOLS[protocol].settings()
    values.update(dtype=dtype, progress=False, out=str(RESULTS.parent))
    if steps:
        values["steps"] = steps
    return Config(**values)


def run_length(cfg: Config) -> str:
    return f"{cfg.steps} steps" if cfg.steps else f"{cfg.epochs} epochs"


def protocol_length(protocol: str) -> str:
    """The protocol's own run length; rows of any other were run for their step time only."""
    return run_length(base_config(protocol, "fp32", None))


def csv_name(protocol: str, dtype: str | None = None) -> str:
    """The CSV a protocol's comparison goes to (its dtype by default): compare_<dtype>.csv for the seed
    protocol, trainer_<dtype>.csv for the trainer's default one."""
    return f"{'compare' if protocol == 'seed' else 'trainer'}_{dtype or PROTOCOLS[protocol].dtype}.csv"


def file_sha(path: str | None) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12] if path and Path(path).is_file() else ""


def eager_losses_of(row: dict) -> list[float] | None:
    """An earlier torch-eager row's losses, if its run file is still here."""
    run_csv = RESULTS.parent / "runs" / row["run_csv"]
    return read_losses(str(run_csv))[0] if run_csv.is_file() else None


def read_losses(run_csv: str) -> tuple[list[float], list[float]]:
    with open(run_csv) as f:
        rows = list(csv.DictReader(f))
    return [float(r["loss"]) for r in rows], [float(r["step_time_us"]) for r in rows]


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[int(q * 100) - 1]


def tracking_failure(got: list[float], expected: list[float]) -> str | None:
    """Where a loss curve leaves the reference by more than `TRACKING` allows; None if it never does."""
    for steps, tolerance in TRACKING:
        for i, (a, b) in enumerate(zip(got[:steps], expected[:steps])):
            rel = abs(a - b) / abs(b)
            if not rel <= tolerance:  # a NaN fails too
                return f"step {i + 1}: relative difference {rel:.2e} > {tolerance:g}"
    return None


def add_speedups(rows: list[dict]) -> None:
    """Set each row's speedups against torch eager and against the fastest torch variant of its run key."""
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        runs.setdefault(tuple(str(r.get(k, "")) for k in RUN), []).append(r)
    for run in runs.values():
        torch_rows = [r for r in run if r["backend"] == "torch"]
        eager = next((r for r in torch_rows if r["variant"] == "torch-eager"), None)
        best = min((r for r in torch_rows if not lower_precision(r["variant"])),
                   key=lambda r: float(r["median_step_us"]), default=None)
        for r in run:
            us = float(r["median_step_us"])
            r["speedup_vs_torch_eager"] = float(eager["median_step_us"]) / us if eager else ""
            r["speedup_vs_best_torch"] = float(best["median_step_us"]) / us if best else ""
            r["best_torch_variant"] = best["variant"] if best else ""


def existing_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default="seed")
    ap.add_argument("--dtype", choices=("fp16", "fp32", "bf16"), default=None,
                    help="default: fp16 for the seed protocol, fp32 for the trainer's")
    ap.add_argument("--hidden", default=None, help="comma-separated widths (default: the protocol's)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--max-autotune-hidden", default="128,1024",
                    help="the only widths at which the max-autotune variants run ('' for none)")
    ap.add_argument("--steps", type=int, default=None,
                    help="run N steps instead of the protocol's: a step-time-only run, recorded under its own "
                         "run length (its accuracy is not the protocol's)")
    ap.add_argument("--tuned-configs", default=None, help="tuned config store (default experiments/<target>/best.json, else the one shipped for this GPU)")
    ap.add_argument("--quick", action="store_true", help="H 128,1024 and 500 steps: a smoke run")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if not torch.cuda.is_available():
        print("compare needs a CUDA GPU (it times training steps); nothing to do here.", file=sys.stderr)
        return 2

    dtype = args.dtype or PROTOCOLS[args.protocol].dtype
    hidden = ([128, 1024] if args.quick else [int(h) for h in args.hidden.split(",")] if args.hidden
              else list(PROTOCOLS[args.protocol].widths))
    tuned = Path(args.tuned_configs) if args.tuned_configs else choose_local_store(RESULTS.parent).path
    out = results_dir() / csv_name(args.protocol, dtype)
    rows = measure(args.protocol, dtype, hidden, variants, steps=500 if args.quick and not args.steps else args.steps,
                   autotune_hidden={int(h) for h in args.max_autotune_hidden.split(",") if h}, tuned=tuned, out=out,
                   curves_dir=results_dir() / "loss_curves")
    print_table(rows)
    print(f"wrote {out}")
    return 0


def measure(protocol: str, dtype: str, hidden: list[int], variants: list[str], *, steps: int | None,
            autotune_hidden: set[int], tuned: Path | None, out: Path, curves_dir: Path | None = None,
            log: Callable[[str], None] = partial(print, file=sys.stderr, flush=True),
            done_one: Callable[[], None] = lambda: None) -> list[dict]:
    """Trains each variant at each width (torch eager first: the reference), merging a row per run
    into `out` as it ends; returns all of out's rows. Runs `out` already holds for this commit and
    settings are skipped; `done_one` is called after each run or skip (a progress bar's tick)."""
    base = base_config(protocol, dtype, steps)
    rows = existing_rows(out)
    commit = provenance()["commit"]
    done = {tuple(str(r.get(k, "")) for k in KEY): r for r in rows}
    if curves_dir:
        curves_dir.mkdir(parents=True, exist_ok=True)

    for h in hidden:
        eager_losses = None  # this width's torch-eager run: the reference
        for variant in ["torch-eager"] + [v for v in variants if v != "torch-eager"]:
            if (autotunes(variant) and h not in autotune_hidden) or (lower_precision(variant) and dtype != "fp32"):
                continue
            spec = dict(VARIANTS[variant])
            if spec.get("tuned_configs") == "TUNED":
                if tuned is None or not tuned.exists():
                    log(f"skip {variant} h{h}: no tuned configs ({tuned or 'none of yours or shipped'})")
                    done_one()
                    continue
                spec["tuned_configs"] = str(tuned)
            cfg = replace(base, hidden=h, **spec)
            sha = file_sha(spec.get("tuned_configs"))
            key = (variant, str(h), dtype, protocol, run_length(cfg), sha, commit)
            if key in done:
                if variant == "torch-eager":
                    eager_losses = eager_losses_of(done[key])
                done_one()
                continue
            log(f"== {variant} h{h} {dtype}")
            try:
                s = train(cfg)
            except Exception as exc:  # one failing variant must not lose the others' rows
                log(f"FAILED {variant} h{h}: {type(exc).__name__}: {exc}")
                done_one()
                continue
            losses, times = read_losses(s.csv)
            if variant == "torch-eager":
                eager_losses = losses
            row = dict(variant=variant, backend=cfg.backend, hidden=h, layers=cfg.layers,
                       batch_size=cfg.batch_size, dtype=dtype, protocol=protocol, run_length=run_length(cfg),
                       steps=s.steps, fused="" if s.fused is None else s.fused, ops_per_step=s.ops_per_step or "",
                       median_step_us=s.median_step_us, p20_step_us=quantile(times, 0.2),
                       p80_step_us=quantile(times, 0.8), train_seconds=s.train_seconds,
                       setup_seconds=s.setup_seconds, final_loss=s.final_loss, test_accuracy=s.test_accuracy,
                       seconds_to_98=s.seconds_to_98,
                       max_loss_diff_vs_torch_eager=max(abs(a - b) for a, b in zip(losses, eager_losses))
                       if eager_losses else "",
                       # The tolerances are fp32's; fp16/bf16 runs differ by their own roundings from step 1.
                       tracks_torch_eager=(tracking_failure(losses, eager_losses) or "yes")
                       if eager_losses and dtype == "fp32" else "",
                       config_source=s.config_source, tuned_configs_sha=sha, run_csv=Path(s.csv).name, **s.provenance)
            done[key] = row
            rows = write_csv(out, [row])
            if curves_dir and run_length(cfg) == protocol_length(protocol):  # a step-time-only run keeps none
                write_curve(curves_dir / f"losses_{dtype}_{protocol}_{variant}.csv", h, losses)
            log(f"   {s.median_step_us:9.1f} us/step  {_x(row['speedup_vs_torch_eager'])} vs eager  "
                f"{_x(row['speedup_vs_best_torch'])} vs {row['best_torch_variant']}  setup {s.setup_seconds:.1f} s  "
                f"acc {s.test_accuracy:.4f}  loss {s.final_loss:.4f}")
            done_one()
    return rows


@contextlib.contextmanager
def _rewriting(path: Path):
    """Holds `path` for a read-modify-write: comparisons running at once (one per GPU, say) may
    write one file, and each must merge into what the others wrote, not over it. Yields the
    temporary file to write, which then replaces `path`."""
    lock_path = path.with_name(f".{path.name}.lock")
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", newline="") as f:
            yield f
        tmp.replace(path)


def write_csv(path: Path, new_rows: list[dict]) -> list[dict]:
    """Merges `new_rows` into the file (a row of the same KEY replaced), recomputes every row's
    speedups, writes it whole and returns its rows."""
    with _rewriting(path) as f:
        rows = {tuple(str(r.get(k, "")) for k in KEY): r for r in existing_rows(path)}
        rows.update({tuple(str(r.get(k, "")) for k in KEY): r for r in new_rows})
        merged = list(rows.values())
        add_speedups(merged)
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(merged)
    return merged


def write_curve(path: Path, hidden: int, losses: list[float]) -> None:
    """Every 10th step and the last, appended under this width (rows of other widths kept)."""
    picked = [(i + 1, loss) for i, loss in enumerate(losses) if (i + 1) % 10 == 0 or i + 1 == len(losses)]
    with _rewriting(path) as f:
        kept = [r for r in existing_rows(path) if int(r["hidden"]) != hidden]
        writer = csv.writer(f)
        writer.writerow(["hidden", "step", "loss"])
        writer.writerows([(r["hidden"], r["step"], r["loss"]) for r in kept])
        writer.writerows([(hidden, step, f"{loss:.7g}") for step, loss in picked])


def _x(speedup) -> str:
    return f"x{float(speedup):.2f}" if speedup not in ("", None) else "x  -  "


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':24} {'H':>5} {'run length':>12} {'ops':>4} {'us/step':>9} {'vs eager':>8} {'vs best torch':>13} "
          f"{'acc':>7} {'loss':>8} {'setup s':>8}")
    for r in rows:
        print(f"{r['variant']:24} {r['hidden']:>5} {r.get('run_length', ''):>12} {str(r.get('ops_per_step') or '-'):>4} "
              f"{float(r['median_step_us']):9.1f} "
              f"{_x(r['speedup_vs_torch_eager']):>8} {_x(r['speedup_vs_best_torch']):>13} "
              f"{float(r['test_accuracy']):7.4f} {float(r['final_loss']):8.4f} {float(r['setup_seconds']):8.1f}")


if __name__ == "__main__":
    sys.exit(main())
