"""The seed protocol's big-output products under Nsight Compute: what holds the CUDA twin there.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python -m experiments.ncu_probe [--tuned-configs STORE] [--hidden 8192]

At H = 8192 the seed step's weight gradients are 8192 x 8192 outputs over K = 32 (the batch):
memory-bound by their epilogue. linear_sgd there moves 10 bytes per weight without momentum (fp32
w read and written, its fp16 copy written: 671 MB, 158 µs at the H200's 4245 GB/s copy ceiling),
the plain product 2 (C in fp16: 134 MB, 32 µs). The tuner timed the CUDA twin's at 1.7x (with
momentum) and 3.6x those floors, the Triton twin's at 1.0x and 1.5x (experiments/NOTES.md,
section 23). This runs each twin's call once at the store's config, after a warm-up that compiles
and checks it, between cudaProfilerStart and Stop, so that ncu reads those launches alone.
"""
from __future__ import annotations

import argparse
import sys

import torch

from autotune.store import load_store
from kernels_core import backends
from kernels_core.reference import exact
from trainer.tuned_configs import target_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tuned-configs", default="experiments/results/trainer_shapes_s12_sm_90/best.json")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)
    store = load_store(args.tuned_configs, target_name("auto"))
    h, b = args.hidden, args.batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, h, generator=gen, device="cuda").half()
    dy = torch.randn(b, h, generator=gen, device="cuda").half() * 0.01
    w0 = torch.randn(h, h, generator=gen, device="cuda") * 0.01
    bias = torch.zeros(h, device="cuda")
    shape = f"{h}x{h}x{b}:tn"
    calls = []
    for backend in ("cuda", "triton"):
        twin = backends.load(backend)
        mm_cfg, _ = store.lookup("matmul", backend, "fp16", shape)
        sgd_cfg, _ = store.lookup("linear_sgd", backend, "fp16", shape)
        w, b_, w_low = w0.clone(), bias.clone(), torch.empty(h, h, device="cuda", dtype=torch.float16)
        calls.append((f"{backend} matmul {mm_cfg}",
                      lambda twin=twin, cfg=mm_cfg: twin.matmul(x, dy, trans_a=True, config=cfg)))
        calls.append((f"{backend} linear_sgd {sgd_cfg}",
                      lambda twin=twin, cfg=sgd_cfg, w=w, b_=b_, w_low=w_low: twin.linear_sgd(
                          x, dy, w, b_, None, None, lr=0.003, w_low=w_low, config=cfg)))
    ref = exact.matmul(x, dy, trans_a=True)
    for name, call in calls:  # compile, and check the plain products before anything is profiled
        out = call()
        torch.cuda.synchronize()
        if out is not None:
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"{name}: relative error {err:.1e}", file=sys.stderr)
            if not err < 2e-3:
                return 1
    torch.cuda.profiler.start()
    for name, call in calls:
        print(f"profiled: {name}", file=sys.stderr, flush=True)
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
