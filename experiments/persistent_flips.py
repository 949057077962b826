"""How often do the persistent kernel's full-grid float64 checks fail on a draw that is not the
kernel's fault? Both twins (and, without a GPU, torch's own fp32 training as a stand-in: in fp16,
rounded where the kernels store, kernels_core.reference.mlp_steps) train the default protocol's net
(784-128-128-10, batch 128, momentum 0.9; fp32, or fp16 as the fp16 full-grid tests) a few steps
from the same random draw, each judged against float64 as tests/test_persistent.py's check_against_float64
judges it (tolerance of the updates' path, plus the fp32 weights' own rounding); one float64
reference a draw.

    python -m experiments.persistent_flips [--dtype fp32|fp16] [--steps 2] [--lr 0.005]
        [--biases open-half|random] [--draws 500] [--first-seed 0] [--twins cuda,triton | --twins torch-fp32]

Where a pre-activation lies within a rounding's reach of zero, any fp32 training's ReLU may fall
the other way from float64's: every twin fails that draw alike. `open-half` puts each hidden bias
in the widest gap of its unit's pre-activations over the steps' rows (the tuner gate's inputs:
autotune/workload.py's _open_half), as the full-grid tests now draw them.

-> experiments/results/<gpu or cpu>/persistent_flips.csv (rows added): device, commit, layout,
   batch, dtype, momentum, steps, lr, biases, check, twin, config (tests' FULL_GRID_CONFIGS: default,
   tiles16-warps4-split4), draws, first_seed, failed, worst_of_allowed (the worst draw's error over
   what the check allows), provenance's commit.
"""
from __future__ import annotations

import argparse

import torch

from experiments.paths import add_results
from kernels_core.persistent import Layout
from kernels_core.provenance import provenance
from kernels_core.reference import mlp_steps
from kernels_cuda import persistent as cuda_persistent
from kernels_triton import persistent as triton_persistent
from tests.test_persistent import FULL_GRID_CONFIGS, float64_errors, full_grid_inputs, reference

CONFIG_NAMES = ["default", "tiles16-warps4-split4"]  # FULL_GRID_CONFIGS, in order
LAYOUT = Layout(hidden=128, layers=2, batch=128)
TWINS = {"cuda": cuda_persistent, "triton": triton_persistent}


def draw(seed: int, dtype: str, steps: int, biases: str, device: str):
    """(x, y, batches, p0) as the full-grid tests draw them (tests/test_persistent.py's
    full_grid_inputs), from `seed`."""
    torch.manual_seed(seed)
    return full_grid_inputs(LAYOUT, dtype, steps, device=device, open_half=biases == "open-half")


def trained(twin: str, config: dict, x, y, batches, p0, steps: int, sgd: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(params, losses) after `steps` steps of `twin` from p0."""
    params, bufs = p0.clone(), torch.zeros_like(p0)
    losses = torch.zeros(steps, device=p0.device)
    pos = torch.zeros((), dtype=torch.int64, device=p0.device)
    if twin == "torch-fp32":
        mlp_steps(x, y, batches, pos, params, bufs, losses, LAYOUT, steps=steps, compute=torch.float32, **sgd)
    else:
        TWINS[twin].plan(x, y, batches, pos, params, bufs, losses, LAYOUT, **sgd, config=config).run(steps)
    return params, losses


def judged(params, losses, ref_losses, ref, paths, dtype: str, steps: int) -> float:
    """The draw's worst error over what check_against_float64 allows (above 1: it fails)."""
    errors = float64_errors(params, losses, ref_losses, ref, paths, LAYOUT, dtype, steps)
    return max(err / allowed for err, allowed in errors.values())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--biases", choices=("open-half", "random"), default="open-half")
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--twins", default="cuda,triton", help="comma-separated, of cuda, triton, torch-fp32 (the CPU's)")
    args = p.parse_args(argv)
    twins = args.twins.split(",")
    unknown = [t for t in twins if t not in ("cuda", "triton", "torch-fp32")]
    if unknown:
        p.error(f"--twins: unknown {unknown}; known: cuda, triton, torch-fp32")
    if any(t != "torch-fp32" for t in twins) and not torch.cuda.is_available():
        p.error("--twins cuda,triton need a GPU; on the CPU, --twins torch-fp32")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sgd = dict(lr=args.lr, momentum=0.9, weight_decay=0.0)
    cells = [(t, i) for t in twins for i in range(1 if t == "torch-fp32" else len(FULL_GRID_CONFIGS))]
    errors = {c: [] for c in cells}
    for seed in range(args.first_seed, args.first_seed + args.draws):
        x, y, batches, p0 = draw(seed, args.dtype, args.steps, args.biases, device)
        ref_losses, ref, paths = reference(x, y, batches, p0, LAYOUT, args.steps, **sgd)
        for twin, i in cells:
            params, losses = trained(twin, FULL_GRID_CONFIGS[i], x, y, batches, p0, args.steps, sgd)
            errors[(twin, i)].append(judged(params, losses, ref_losses, ref, paths, args.dtype, args.steps))
    prov = provenance()
    rows = [dict(device=prov["device"], commit=prov["commit"], layout="784-128-128-10", batch=LAYOUT.batch,
                 dtype=args.dtype, momentum=0.9, steps=args.steps, lr=args.lr, biases=args.biases, check="path+stored",
                 twin=twin, config="-" if twin == "torch-fp32" else CONFIG_NAMES[i], draws=args.draws,
                 first_seed=args.first_seed, failed=sum(e > 1 for e in errors[(twin, i)]),
                 worst_of_allowed=max(errors[(twin, i)])) for twin, i in cells]
    for r in rows:
        print(f"{r['twin']} {r['config']}: {r['failed']} of {r['draws']} draws failed, the worst "
              f"{r['worst_of_allowed']:.3g} of what the check allows")
    add_results(rows, "persistent_flips.csv")


if __name__ == "__main__":
    main()
