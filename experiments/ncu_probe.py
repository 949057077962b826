"""Trainer GEMMs under Nsight Compute: each twin's call and cuBLAS's, once each, for the counters.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python -m experiments.ncu_probe [--shapes 8192x8192x32:tn,...] [--tuned-configs STORE]

Each shape is a matmul key of the tuner's store (MxNxK:layout, fp16 as the seed protocol runs
it); a tn shape is also run as linear_sgd (the weight gradient with the SGD update, no momentum,
as the seed step calls it). Every call runs at the store's config, first for a warm-up that
compiles it and checks the plain products against float64, then once between cudaProfilerStart
and Stop, so that ncu reads those launches alone (cuBLAS's through torch, the baseline).

Why (experiments/FINDINGS.md, "Tensor-core kernel: large tiles and the staged epilogue"): at seed H = 8192 the weight gradients (8192x8192x32:tn)
move 2 bytes per output (plain: C in fp16, 134 MB, 32 µs at the H200's 4245 GB/s copy ceiling)
or 10 (linear_sgd: the fp32 w read and written, its fp16 copy written; 671 MB, 158 µs), and the
CUDA twin took 3.6x and 2.2x those floors where Triton took 1.5x and 1.2x. The counters showed
why: one L2 request per sector stored.
"""
from __future__ import annotations

import argparse
import sys

import torch

from kernels_core.store import load_store
from kernels_core.shapes import parse_shapes, shape_key
from kernels_core import backends
from kernels_core.reference import exact, native
from trainer.tuned_configs import target_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x8192x32:tn")
    ap.add_argument("--tuned-configs", default="kernels_core/tuned/h200.json")
    args = ap.parse_args(argv)
    store = load_store(args.tuned_configs, target_name("auto"))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=gen, device="cuda") * scale

    calls = []
    for (m, n, k), layout in parse_shapes(args.shapes):
        trans_a, trans_b = layout[0] == "t", layout[1] == "t"
        a = randn(*((k, m) if trans_a else (m, k))).half()
        b = randn(*((n, k) if trans_b else (k, n))).half()
        kw = dict(trans_a=trans_a, trans_b=trans_b)
        key = shape_key((m, n, k), layout)
        ref = exact.matmul(a, b, **kw)
        calls.append((f"cuBLAS matmul {key}", ref, lambda a=a, b=b, kw=kw: native.matmul(a, b, **kw)))
        for backend in ("cuda", "triton"):
            twin = backends.load(backend)
            cfg, _ = store.lookup("matmul", backend, "fp16", key)
            calls.append((f"{backend} matmul {key} {cfg}", ref,
                          lambda twin=twin, a=a, b=b, kw=kw, cfg=cfg: twin.matmul(a, b, config=cfg, **kw)))
            if layout == "tn":  # x = a (batch x K_in), dy = b (batch x N_out)
                cfg, _ = store.lookup("linear_sgd", backend, "fp16", key)
                w, bias = randn(m, n, scale=0.01), randn(n, scale=0.01)
                w_low = torch.empty(m, n, device="cuda", dtype=torch.float16)
                calls.append((f"{backend} linear_sgd {key} {cfg}", None,
                              lambda twin=twin, a=a, b=b, w=w, bias=bias, w_low=w_low, cfg=cfg: twin.linear_sgd(
                                  a, b, w, bias, None, None, lr=0.003, w_low=w_low, config=cfg)))
    for name, ref, call in calls:  # compile, and check the plain products before anything is profiled
        out = call()
        torch.cuda.synchronize()
        if ref is not None:
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"{name}: relative error {err:.1e}", file=sys.stderr)
            if not err < 2e-3:
                return 1
    torch.cuda.profiler.start()
    for name, _, call in calls:
        print(f"profiled: {name}", file=sys.stderr, flush=True)
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
