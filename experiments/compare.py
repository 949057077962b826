"""The seed study, redone: PyTorch vs raw CUDA vs Triton MLP training per hidden width.

    python -m experiments.compare [--protocol seed|default] [--dtype fp16|fp32]
        [--hidden 128,256,...] [--variants torch-eager,cuda-tuned,...] [--steps N] [--quick]

The seed project trained 784-H-H-H-10 on MNIST (batch 32, plain SGD lr 0.003,
5000 steps, fp16) and reported step-time speedups of CUDA over PyTorch. Here
every variant trains the same protocol from the same initial weights and
data order (trainer.train), so besides the step time we also get the final
loss, the test accuracy and the per-step loss difference against torch eager.

Variants: torch eager, torch.compile (default; max-autotune only at the
`--max-autotune-hidden` widths since it spends ~35 s per GEMM shape), torch
with the whole step in one CUDA graph, and the cuda/triton backends on tuned
configs (experiments/<target>/best.json) and on their defaults. Warm-up and
compilation are `setup_seconds`, kept out of the step times.

Writes experiments/results/<stem>_<gpu>_<dtype>.csv (stem `compare` for the
seed protocol, `trainer` for the trainer's default protocol), one row per
variant x H, and a loss-curve file per variant (every 10th step). A rerun
skips rows already there for the same commit and settings.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from kernels_core.provenance import device_slug, provenance
from trainer.config import PRESETS, Config
from trainer.tuned_configs import target_name
from trainer.train import train

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "torch-eager": dict(backend="torch"),
    "torch-compile": dict(backend="torch", compile="default"),
    "torch-max-autotune": dict(backend="torch", compile="max-autotune"),
    "torch-graph": dict(backend="torch", torch_graph=True),
    "cuda-tuned": dict(backend="cuda", tuned_configs="TUNED"),
    "cuda-default": dict(backend="cuda", tuned_configs="none"),
    "triton-tuned": dict(backend="triton", tuned_configs="TUNED"),
    "triton-default": dict(backend="triton", tuned_configs="none"),
}
# A row is redone only when one of these changed: `run_length` is what was asked ("5000 steps",
# "10 epochs"), `tuned_configs_sha` the tuned store the row ran on (the store is data, not code).
KEY = ("variant", "hidden", "dtype", "protocol", "run_length", "tuned_configs_sha", "commit")
COLUMNS = ["variant", "backend", "hidden", "layers", "batch_size", "dtype", "protocol", "run_length", "steps",
           "median_step_us", "p20_step_us", "p80_step_us", "train_seconds", "setup_seconds", "final_loss",
           "test_accuracy", "seconds_to_98", "speedup_vs_torch_eager", "max_loss_diff_vs_torch_eager",
           "config_source", "tuned_configs_sha", "run_csv", *provenance()]


def base_config(protocol: str, dtype: str, steps: int | None) -> Config:
    values = dict(PRESETS["seed"]) if protocol == "seed" else {}
    values.update(dtype=dtype, progress=False, out=str(RESULTS.parent))
    if steps:
        values["steps"] = steps
    return Config(**values)


def run_length(cfg: Config) -> str:
    return f"{cfg.steps} steps" if cfg.steps else f"{cfg.epochs} epochs"


def file_sha(path: str | None) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12] if path and Path(path).is_file() else ""


def eager_from_row(row: dict) -> tuple[list[float] | None, float]:
    """An earlier torch-eager row's step time, and its losses if its run file is still here."""
    run_csv = RESULTS.parent / "runs" / row["run_csv"]
    return (read_losses(str(run_csv))[0] if run_csv.is_file() else None), float(row["median_step_us"])


def read_losses(run_csv: str) -> tuple[list[float], list[float]]:
    with open(run_csv) as f:
        rows = list(csv.DictReader(f))
    return [float(r["loss"]) for r in rows], [float(r["step_time_us"]) for r in rows]


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[int(q * 100) - 1]


def existing_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", choices=("seed", "default"), default="seed")
    ap.add_argument("--dtype", choices=("fp16", "fp32", "bf16"), default=None,
                    help="default: fp16 for the seed protocol, fp32 for the trainer's")
    ap.add_argument("--hidden", default="128,256,512,1024,2048,4096,8192")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "torch-max-autotune"))
    ap.add_argument("--max-autotune-hidden", default="128,1024",
                    help="widths at which torch-max-autotune also runs ('' for none)")
    ap.add_argument("--steps", type=int, default=None, help="override the protocol's step count")
    ap.add_argument("--tuned-configs", default=None, help="tuned config store (default experiments/<target>/best.json)")
    ap.add_argument("--quick", action="store_true", help="H 128,1024 and 500 steps: a smoke run")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("compare needs a CUDA GPU (it times training steps); nothing to do here.", file=sys.stderr)
        return 2

    dtype = args.dtype or ("fp16" if args.protocol == "seed" else "fp32")
    hidden = [128, 1024] if args.quick else [int(h) for h in args.hidden.split(",")]
    steps = 500 if args.quick and not args.steps else args.steps
    base = base_config(args.protocol, dtype, steps)
    tuned = Path(args.tuned_configs) if args.tuned_configs else RESULTS.parent / target_name("auto") / "best.json"
    variants = args.variants.split(",")
    mat_h = {int(h) for h in args.max_autotune_hidden.split(",") if h}
    if "torch-max-autotune" not in variants and mat_h:
        variants.append("torch-max-autotune")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")

    stem = "compare" if args.protocol == "seed" else "trainer"
    out = RESULTS / f"{stem}_{device_slug()}_{dtype}.csv"
    rows = existing_rows(out)
    commit = provenance()["commit"]
    done = {tuple(str(r.get(k, "")) for k in KEY): r for r in rows}
    curves_dir = RESULTS / "loss_curves"
    curves_dir.mkdir(parents=True, exist_ok=True)

    for h in hidden:
        eager_losses, eager_us = None, None  # this width's torch-eager run: the reference
        for variant in ["torch-eager"] + [v for v in variants if v != "torch-eager"]:
            if variant == "torch-max-autotune" and h not in mat_h:
                continue
            spec = dict(VARIANTS[variant])
            if spec.get("tuned_configs") == "TUNED":
                if not tuned.exists():
                    print(f"skip {variant} h{h}: no tuned configs at {tuned}", file=sys.stderr)
                    continue
                spec["tuned_configs"] = str(tuned)
            cfg = replace(base, hidden=h, **spec)
            sha = file_sha(spec.get("tuned_configs"))
            key = (variant, str(h), dtype, args.protocol, run_length(cfg), sha, commit)
            if key in done:
                if variant == "torch-eager":
                    eager_losses, eager_us = eager_from_row(done[key])
                continue
            print(f"== {variant} h{h} {dtype}", file=sys.stderr, flush=True)
            try:
                s = train(cfg)
            except Exception as exc:  # one failing variant must not lose the others' rows
                print(f"FAILED {variant} h{h}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            losses, times = read_losses(s.csv)
            if variant == "torch-eager":
                eager_losses, eager_us = losses, s.median_step_us
            row = dict(variant=variant, backend=cfg.backend, hidden=h, layers=cfg.layers,
                       batch_size=cfg.batch_size, dtype=dtype, protocol=args.protocol, run_length=run_length(cfg),
                       steps=s.steps, median_step_us=s.median_step_us, p20_step_us=quantile(times, 0.2),
                       p80_step_us=quantile(times, 0.8), train_seconds=s.train_seconds,
                       setup_seconds=s.setup_seconds, final_loss=s.final_loss, test_accuracy=s.test_accuracy,
                       seconds_to_98=s.seconds_to_98,
                       speedup_vs_torch_eager=eager_us / s.median_step_us if eager_us else "",
                       max_loss_diff_vs_torch_eager=max(abs(a - b) for a, b in zip(losses, eager_losses))
                       if eager_losses else "",
                       config_source=s.config_source, tuned_configs_sha=sha, run_csv=Path(s.csv).name, **s.provenance)
            rows.append(row)
            done[key] = row
            write_csv(out, rows)
            write_curve(curves_dir / f"losses_{device_slug()}_{dtype}_{args.protocol}_{variant}.csv", h, losses)
            print(f"   {s.median_step_us:9.1f} us/step  {_x(row['speedup_vs_torch_eager'])} vs eager  "
                  f"acc {s.test_accuracy:.4f}  loss {s.final_loss:.4f}", file=sys.stderr, flush=True)
    print_table(rows)
    print(f"wrote {out}")
    return 0


def write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def write_curve(path: Path, hidden: int, losses: list[float]) -> None:
    """Every 10th step and the last, appended under this width (rows of other widths kept)."""
    kept = [r for r in existing_rows(path) if int(r["hidden"]) != hidden]
    picked = [(i + 1, loss) for i, loss in enumerate(losses) if (i + 1) % 10 == 0 or i + 1 == len(losses)]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["hidden", "step", "loss"])
        writer.writerows([(r["hidden"], r["step"], r["loss"]) for r in kept])
        writer.writerows([(hidden, step, f"{loss:.7g}") for step, loss in picked])


def _x(speedup) -> str:
    return f"x{float(speedup):.2f}" if speedup not in ("", None) else "x  -  "


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':20} {'H':>5} {'us/step':>9} {'vs eager':>8} {'acc':>7} {'loss':>8} {'setup s':>8}")
    for r in rows:
        print(f"{r['variant']:20} {r['hidden']:>5} {float(r['median_step_us']):9.1f} "
              f"{_x(r['speedup_vs_torch_eager']):>8} {float(r['test_accuracy']):7.4f} "
              f"{float(r['final_loss']):8.4f} {float(r['setup_seconds']):8.1f}")


if __name__ == "__main__":
    sys.exit(main())
