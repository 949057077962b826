"""How far a training protocol's test accuracy moves with the seed alone: one backend, one width, many seeds.

    python -m experiments.accuracy_spread [--backend torch] [--hidden 128] [--seeds 0-19]
        [--protocol default|seed] [--epochs N] [--train-subset N] [--tuned-configs STORE]

The bar: every backend at 98% test accuracy or more after the default protocol's 10
epochs (784-H-H-10, fp32, batch 128, SGD lr 0.05, momentum 0.9). The twins compute torch's step
in other roundings, and a step's rounding changes a run about as much as its seed does (the
initial weights and the data order): the trajectories part within a few hundred steps. So
whether a width's bar is about the backends or about the protocol is told by the spread of one
backend's accuracy over seeds: if torch itself ends below 98% on most seeds, a twin's run below
it is that protocol's spread, and one run passing it is luck.

The torch backend runs on the CPU (about 12 s a run at H = 128 on two cores); cuda and triton
need the GPU (the interpreter takes about a second a step). Appends a row per run to
experiments/results/<device>/accuracy_spread.csv (a rerun skips the runs already there for the
same commit) and prints, per backend and width: runs, mean, standard deviation, min, max, and how
many reached 98%.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

from kernels_core.provenance import AS_TEXT, provenance
from trainer.config import BACKENDS, PRESETS, Config
from trainer.train import TARGET_ACCURACY, train
from experiments.paths import results_dir

KEY = ("backend", "hidden", "protocol", "epochs", "train_subset", "seed", "commit")


def _seeds(text: str) -> list[int]:
    """'0-19' or '0,3,7' (or both: '0-4,9')."""
    seeds = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            seeds += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not seeds like 0-19 or 0,3,7") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{text!r} names no seed")
    return seeds


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per backend and width: runs, mean / sd / min / max test accuracy, runs at or above 98%."""
    g = rows.groupby(["backend", "hidden", "protocol", "epochs"])["test_accuracy"]
    return pd.DataFrame({"runs": g.size(), "mean": g.mean(), "sd": g.std(), "min": g.min(), "max": g.max(),
                         f"runs >= {TARGET_ACCURACY:.0%}": g.apply(lambda a: int((a >= TARGET_ACCURACY).sum()))})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=BACKENDS, default="torch")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seeds", type=_seeds, default=_seeds("0-19"), help="e.g. 0-19 (default) or 0,3,7")
    ap.add_argument("--protocol", choices=("default", "seed"), default="default",
                    help="the trainer's defaults (10 epochs), or the seed preset")
    ap.add_argument("--epochs", type=int, default=None, help="instead of the protocol's length")
    ap.add_argument("--train-subset", type=int, default=0, help="train on the first N images (quick runs)")
    ap.add_argument("--tuned-configs", default=None, help="cuda/triton: the config store to run on")
    ap.add_argument("--results", type=Path, default=None,
                    help="the CSV to append to (default experiments/results/<device>/accuracy_spread.csv)")
    ap.add_argument("--out", default="experiments", help="the trainer's output root (its run CSVs)")
    args = ap.parse_args(argv)

    base = Config(**PRESETS["seed"]) if args.protocol == "seed" else Config()
    base = replace(base, backend=args.backend, hidden=args.hidden, train_subset=args.train_subset, out=args.out,
                   progress=False, tuned_configs=args.tuned_configs,
                   **({"epochs": args.epochs, "steps": None} if args.epochs else {}))
    length = f"{base.steps} steps" if base.steps else f"{base.epochs} epochs"
    path = args.results or results_dir() / "accuracy_spread.csv"
    rows = pd.read_csv(path, dtype=AS_TEXT) if path.exists() else pd.DataFrame(columns=list(KEY))
    commit = provenance()["commit"]
    done = {tuple(str(v) for v in r) for r in rows[list(KEY)].itertuples(index=False)}
    for seed in args.seeds:
        key = (args.backend, str(args.hidden), args.protocol, length, str(args.train_subset), str(seed), commit)
        if key in done:
            continue
        s = train(replace(base, seed=seed))
        row = {"backend": args.backend, "hidden": args.hidden, "protocol": args.protocol, "epochs": length,
               "train_subset": args.train_subset, "seed": seed, "dtype": base.dtype, "layers": base.layers,
               "batch_size": base.batch_size, "lr": base.lr, "momentum": base.momentum, "steps": s.steps,
               "test_accuracy": s.test_accuracy, "final_loss": s.final_loss,
               "config_source": s.config_source, **s.provenance}
        rows = pd.concat([rows, pd.DataFrame([row])], ignore_index=True) if len(rows) else pd.DataFrame([row])
        path.parent.mkdir(parents=True, exist_ok=True)
        rows.to_csv(path, index=False)  # after every run: an interrupted sweep keeps what it ran
        print(f"{args.backend} h{args.hidden} seed {seed}: test accuracy {s.test_accuracy:.4f}", file=sys.stderr,
              flush=True)
    mine = rows[(rows["commit"] == commit) & (rows["backend"] == args.backend)
                & (rows["hidden"].astype(int) == args.hidden) & (rows["protocol"] == args.protocol)
                & (rows["epochs"] == length) & (rows["train_subset"].astype(int) == args.train_subset)]
    if len(mine):
        print(summary(mine).to_string(float_format=lambda v: f"{v:.4f}"))
        accs = mine["test_accuracy"].astype(float)
        print(f"{(accs >= TARGET_ACCURACY).sum()} of {len(accs)} seeds reached {TARGET_ACCURACY:.0%} "
              f"(median {statistics.median(accs):.4f}); rows in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
