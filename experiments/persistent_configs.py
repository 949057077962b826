"""The persistent training kernel's step time over a few of its configs (a GPU machine): which
tile sizes, warps and grid sizes its phases want, and where a tuned config's time goes (the
config `tuned`: a store's entry for the net).

    python -m experiments.persistent_configs [--backends triton,cuda] [--protocol default,seed]
        [--hidden 128] [--configs NAME,...] [--tuned-configs STORE] [--reps 5] [--phases]

Each config trains the protocol's net on MNIST from the trainer's initial weights and data order
(trainer.train.build with --persistent): the first steps are checked against the fused step's
losses (compare's bar: within 1e-4 over 5 steps, fp32; 1e-2 in fp16, whose roundings the two
make in other orders), then each rep times one launch of a whole epoch's steps with CUDA events
(468 steps at batch 128, 1875 at 32), the weights put back between reps; the step's time is the
launch's over its steps, the median of the reps. Rows are written as each config ends, after the
file's earlier rows.

-> experiments/results/<gpu>/persistent_configs.csv: backend, protocol, hidden, config (its name),
   kernel_config, programs, steps, us_per_step (median), us_p20, us_p80, loss_diff (the
   largest relative difference from the fused step over its first 5 steps), provenance.
-> with --phases, experiments/results/<gpu>/persistent_phases.csv: backend, protocol, hidden,
   config, phase, what (kernels_core.persistent.phase_names), us_median, us_p20, us_p80 over an
   epoch's steps (one launch with the kernel's clock stamps: a phase from the barrier before it to
   the one after it, as program 0 sees them), provenance.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from experiments.compare import base_config
from experiments.paths import results_dir
from kernels_core.mlp import PROTOCOLS
from kernels_core.provenance import provenance
from kernels_core.persistent import barriers_per_step, phase_names, resolve_config

CONFIGS = {  # name: what it changes from DEFAULT
    "default": {},
    "tiles16": dict(BM=16, BN=16),
    "updates16": dict(BR=16, BC=16),
    "updates64x32": dict(BR=64, BC=32),
    "split2": dict(SPLIT_K=2),
    "split4": dict(SPLIT_K=4),
    "tiles16-split4": dict(BM=16, BN=16, SPLIT_K=4),
    "warps4": dict(num_warps=4),
    "warps4-split4": dict(num_warps=4, SPLIT_K=4),
    "tiles16-warps4-split4": dict(BM=16, BN=16, num_warps=4, SPLIT_K=4),
    "split8": dict(SPLIT_K=8),
    "programs64": dict(PROGRAMS=64),
}
CHECK_STEPS = 5
BAR = {"fp32": 1e-4, "fp16": 1e-2}


def _losses(step, batches, losses: torch.Tensor, steps: int) -> list[float]:
    """The first `steps` losses of steps taken by `step()` from the epoch's start."""
    batches.pos.zero_()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return losses[:steps].tolist()


def measure(backend: str, protocol: str, hidden: int, name: str, config: dict, reps: int,
            fused_losses: list[float], phases: list[dict]) -> dict:
    """The config's row; with `phases` a list, also one launch of an epoch with the kernel's clock
    stamps, each phase's median, p20 and p80 over the steps appended to it."""
    from trainer.persistent import PersistentMLP
    from trainer.torch_backend import initial_mlp
    from trainer.train import build

    cfg = replace(base_config(protocol, PROTOCOLS[protocol].dtype, None), backend=backend, hidden=hidden,
                  tuned_configs="none")
    built = build(cfg)  # the data, batches and loss slots; the fused model it holds compiles nothing unused
    mlp = PersistentMLP(initial_mlp(hidden, cfg.layers, cfg.seed), cfg, built.batches, built.stepper.losses,
                        kernel_config=config)
    saved = mlp.snapshot()
    got = _losses(lambda: mlp.run(1), built.batches, built.stepper.losses, CHECK_STEPS)
    diff = max(abs(a - b) / abs(b) for a, b in zip(got, fused_losses))
    if diff > BAR[cfg.dtype]:
        raise RuntimeError(f"{name}: the first steps' losses {got} are {diff:.3g} off the fused step's {fused_losses}")
    steps = built.batches.steps_per_epoch
    times = []
    for _ in range(reps):
        mlp.restore(saved)
        built.batches.pos.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        mlp.run(steps)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    q = statistics.quantiles(times, n=5, method="inclusive")
    row = dict(backend=backend, protocol=protocol, hidden=hidden, config=name,
               kernel_config=str(resolve_config(config)), programs=mlp.plan.programs, steps=steps,
               us_per_step=statistics.median(times), us_p20=q[0], us_p80=q[3], loss_diff=diff, **provenance())
    if phases is not None:
        barriers = barriers_per_step(cfg.layers)
        stamps = torch.zeros(1 + steps * barriers, dtype=torch.int64, device=built.batches.x.device)
        timed = PersistentMLP(initial_mlp(hidden, cfg.layers, cfg.seed), cfg, built.batches, built.stepper.losses,
                              kernel_config=config, stamps=stamps)  # from the same initial weights
        built.batches.pos.zero_()
        timed.run(steps)
        torch.cuda.synchronize()
        us = (stamps[1:] - stamps[:-1]).view(steps, barriers).double().cpu() / 1e3
        for i, what in enumerate(phase_names(cfg.layers)):
            q = us[:, i].quantile(torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
            phases.append(dict(backend=backend, protocol=protocol, hidden=hidden, config=name, phase=i, what=what,
                               us_median=q[1], us_p20=q[0], us_p80=q[2], **provenance()))
    return row


def fused_losses(backend: str, protocol: str, hidden: int) -> list[float]:
    """The twin's fused step's first losses (its default configs), eager: the reference."""
    from trainer.train import build

    built = build(replace(base_config(protocol, PROTOCOLS[protocol].dtype, None), backend=backend, hidden=hidden,
                          tuned_configs="none"))
    return _losses(built.stepper.eager, built.batches, built.stepper.losses, CHECK_STEPS)


def tuned_config(store: str, backend: str, protocol: str, hidden: int) -> dict:
    """The store's persistent entry for the protocol's net at `hidden` (the tuner's, `python -m
    autotune.search --ops persistent`), refused in one line where it has none."""
    import json

    from kernels_core.mlp import persistent_call
    from kernels_core.store import load_store

    p = PROTOCOLS[protocol]
    call = persistent_call(hidden, p.layers, p.batch_size, p.dtype, p.momentum)
    config, source = load_store(store, json.loads(Path(store).read_text())["target"]).lookup(
        call.op, backend, call.dtype, call.key)
    if source != "tuned":
        raise ValueError(f"{store}: no persistent entry for {backend} {call.dtype} {call.key}")
    return config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.persistent_configs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="triton", help="comma-separated, of triton, cuda (default triton)")
    p.add_argument("--protocol", default="default,seed", help="comma-separated, of default, seed")
    p.add_argument("--hidden", default="128", help="comma-separated widths (default 128)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)}, and tuned (the store's config for the net)")
    p.add_argument("--tuned-configs", default=None, metavar="STORE",
                   help="a config store (best.json) whose persistent entry for each net the config 'tuned' runs")
    p.add_argument("--reps", type=int, default=5, help="launches of an epoch's steps a config (default 5)")
    p.add_argument("--phases", action="store_true",
                   help="also each phase's time, from the kernel's clock stamps (persistent_phases.csv)")
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    if set(backends) - {"triton", "cuda"}:
        p.error(f"--backends {args.backends}: of triton, cuda")
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS and n != "tuned"]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {list(CONFIGS)} and tuned")
    if "tuned" in names and not args.tuned_configs:
        p.error("--configs tuned: give the store it reads, --tuned-configs STORE")
    if args.tuned_configs and not Path(args.tuned_configs).is_file():
        p.error(f"--tuned-configs {args.tuned_configs}: no such file")
    if not torch.cuda.is_available():
        p.error("no CUDA device: the kernel's step time is a GPU's")
    out = results_dir() / "persistent_configs.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    earlier = pd.read_csv(out) if out.exists() else pd.DataFrame()
    phases_out = results_dir() / "persistent_phases.csv"
    earlier_phases = pd.read_csv(phases_out) if phases_out.exists() else pd.DataFrame()
    rows, phases = [], [] if args.phases else None
    for backend in backends:
        for protocol in args.protocol.split(","):
            for hidden in (int(h) for h in args.hidden.split(",")):
                reference = fused_losses(backend, protocol, hidden)
                for name in names:
                    what = f"{backend} {protocol} H={hidden} {name}"
                    try:
                        config = tuned_config(args.tuned_configs, backend, protocol, hidden) if name == "tuned" \
                            else CONFIGS[name]
                        rows.append(measure(backend, protocol, hidden, name, config, args.reps, reference, phases))
                    except Exception as exc:  # one config failing must not lose the others' rows
                        print(f"FAILED {what}: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    r = rows[-1]
                    print(f"{what}: {r['us_per_step']:.2f} µs a step ({r['programs']} programs, "
                          f"p20 {r['us_p20']:.2f}, "
                          f"p80 {r['us_p80']:.2f}; loss {r['loss_diff']:.2g} off fused)", flush=True)
                    pd.concat([earlier, pd.DataFrame(rows)]).to_csv(out, index=False)
                    if phases:
                        pd.concat([earlier_phases, pd.DataFrame(phases)]).to_csv(phases_out, index=False)
                        print("  " + ", ".join(f"{p['what']} {p['us_median']:.2f}" for p in phases
                                               if p["config"] == name and p["protocol"] == protocol
                                               and p["hidden"] == hidden and p["backend"] == backend), flush=True)
    print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
