"""What a kernel change buys: the same configs timed on two versions of the code, in turn, in one run.

    python -m experiments.code_ab --old-tree DIR --tuned-configs STORE [--protocol seed] [--hidden 128]
        [--backends cuda] [--rounds 5] [--label NAME]

DIR is a copy of the repository at an older commit, made where git is (`git archive REV | tar -x -C
DIR`; the GPU machine's copy of the tree has no .git, so carry DIR there). Worker 0 runs this
checkout and worker 1 the old tree, on the same GPU: worker 1 gets PYTHONSAFEPATH=1, so that its
PYTHONPATH (the old tree first) rather than its working directory decides which packages it
imports. Every call of the protocol's fused training step (kernels_core.mlp.mlp_calls) is
run by each backend at the store's config on both workers, each time after the tuner's correctness
check against float64, and timed as the tuner times it (graph replays of 10 calls), the two
workers in turn, --rounds times (experiments.steps.timings_in_turn): a drift of the GPU's clocks
falls on both alike.

-> results/<device>/code_ab[_<label>].csv, a row per call, backend and code ("new" this checkout, "old" the
   old tree): median, min and max over the rounds, the config, provenance (commit is this
   checkout's; old_commit the old tree's, from its SOURCE_COMMIT file or its directory name), and the
   SGD calls' momentum (an old tree may force 0.9: experiments/FINDINGS.md, "The tuner's workload"). The summary prints the median old / new ratio and the sum over the step's distinct calls (a call
   the step makes twice, as the seed protocol's hidden layers do, counts once).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import pandas as pd

from autotune.evaluate import Evaluator
from kernels_core.store import load_store
from kernels_core.targets import resolve_target
from autotune.workload import SGD_HYPER
from kernels_core.mlp import PROTOCOLS, SGD_OPS, mlp_calls
from experiments.steps import timings_in_turn
from kernels_core.provenance import REPO, provenance
from experiments.paths import results_dir

CODES = ("new", "old")  # worker 0, worker 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.code_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-tree", type=Path, required=True, help="the repository at the older commit")
    p.add_argument("--tuned-configs", type=Path, required=True, help="the store whose configs both codes run")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="seed")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--backends", default="cuda")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--label", default=None, help="results file suffix (default: none)")
    p.add_argument("--results", type=Path, default=None, help="folder (default experiments/results/<device>)")
    args = p.parse_args(argv)
    if not (args.old_tree / "kernels_cuda").is_dir():
        p.error(f"--old-tree {args.old_tree}: no kernels_cuda/ there; make it with git archive REV | tar -x -C DIR")
    return args


def old_commit(tree: Path) -> str:
    stamp = tree / "SOURCE_COMMIT"
    return stamp.read_text().strip() if stamp.exists() else tree.resolve().name


def takes_momentum(tree: Path) -> bool:
    """Whether the tree's tuner builds SGD inputs by the call's momentum: older ones make
    momentum buffers whatever the call says."""
    worker = tree / "autotune" / "worker.py"
    return worker.exists() and 'req["momentum"]' in worker.read_text()


def code_pool(target: str, old_tree: Path, log_dir: Path) -> Evaluator:
    """Two workers on the same GPU: 0 runs this checkout, 1 the old tree's packages."""
    pool = Evaluator(target, len(CODES), 120.0, log_dir)
    env = pool.workers[1][0].env  # read when the worker starts, at its first request
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(old_tree.resolve()), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return pool


def measure(args) -> pd.DataFrame:
    protocol = PROTOCOLS[args.protocol]
    dtype, batch, layers = protocol.dtype, protocol.batch_size, protocol.layers
    target = resolve_target("auto", compile_only=False)
    store = load_store(args.tuned_configs, target)
    pool = code_pool(target.name, args.old_tree, Path("experiments/logs/code_ab"))
    prov, old, rows = provenance(), old_commit(args.old_tree), []
    momentum = protocol.momentum
    if not momentum and not takes_momentum(args.old_tree):
        momentum = SGD_HYPER["momentum"]
        print(f"code_ab: the old tree ({old}) times SGD with momentum buffers whatever the call says; both "
              f"codes time linear_sgd with momentum {momentum}, not the {args.protocol} protocol's 0", flush=True)
    try:
        for call in mlp_calls(args.hidden, layers, batch, dtype, fused=True, momentum=momentum):
            for backend in args.backends.split(","):
                config, source = store.lookup(call.op, backend, dtype, call.key)
                if source != "tuned":
                    raise SystemExit(f"code_ab: {args.tuned_configs} has no {call.op} {backend} {dtype} {call.key}")
                takes = [(worker, config) for worker in range(len(CODES))]
                times = timings_in_turn(pool, call, backend, takes, args.rounds, "code_ab")
                for code, t in zip(CODES, times):
                    t = pd.Series(t)
                    rows.append({**prov, "old_commit": old, "protocol": args.protocol,
                                 "hidden": args.hidden, "op": call.op, "backend": backend, "dtype": dtype,
                                 "shape": call.key, "fused_arg": call.fused_arg or "",
                                 "momentum": call.momentum if call.op in SGD_OPS else None, "code": code,
                                 "config": json.dumps(config, sort_keys=True), "median_ms": t.median(),
                                 "min_ms": t.min(), "max_ms": t.max(), "rounds": len(t)})
                print(f"{call.op:21s} {backend:6s} {call.key:16s} old {pd.Series(times[1]).median() * 1e3:6.2f} us"
                      f"  new {pd.Series(times[0]).median() * 1e3:6.2f} us", flush=True)
    finally:
        pool.close()
    return pd.DataFrame(rows)


def summary(rows: pd.DataFrame) -> list[str]:
    wide = rows.pivot_table(index=["backend", "op", "shape"], columns="code", values="median_ms")
    lines = []
    for backend, part in wide.groupby(level="backend"):
        old, new = part["old"].sum() * 1e3, part["new"].sum() * 1e3
        lines.append(f"{backend}: the step's {len(part)} distinct calls, once each, {old:.1f} us (old) -> {new:.1f} us (new), "
                     f"{old - new:+.1f} us; per call old / new: median {(part['old'] / part['new']).median():.2f}x")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    args.results = args.results or results_dir()
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / (f"code_ab_{args.label}.csv" if args.label else "code_ab.csv")
    # Both as text, so the file's rows are written back as they were, empty in a column added since.
    text = [pd.read_csv(f, dtype=str, keep_default_na=False)
            for f in ([path] if path.exists() else []) + [io.StringIO(rows.to_csv(index=False, float_format="%.6g"))]]
    pd.concat(text, ignore_index=True).to_csv(path, index=False)
    print("\n".join(summary(rows)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
