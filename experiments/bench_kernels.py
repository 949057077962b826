"""Both kernel twins next to PyTorch, in one run.

    python -m experiments.bench_kernels [--quick] [--only elementwise,gemm,mlp,trainer]
        [--tuned-configs PATH] [--repeat N] [--out CSV]

Groups: `elementwise` (256M elements), `gemm` (4096^3 per dtype, each twin's
default config and its tuned one where the store has the shape), `mlp` (81
MLP-shaped GEMMs per dtype, default configs), and `trainer`: the GEMMs the
trainer runs, in both of its protocols at the widths kernels_core.mlp.PROTOCOLS
lists, with each twin's default config and, where the
tuned store (experiments/<target>/best.json) has that exact shape, its tuned
one. `--repeat N` runs every case N times in turn, so the spread between runs
of one config shows next to the differences between configs.

Every case is checked against a reference before it is timed (a wrong kernel
is reported as such and never timed); a matmul row records its error against
float64 (`rel_err`). fp32 products are timed in 3xTF32 too (label `tf32x3`,
each twin whose space has the TF32 tunable; square ones also on operands split
ahead, `tf32x3 split ahead` and on sm_90 `tf32x3 wgmma`), and torch's with TF32 on
(`cuBLAS TF32`, a lower precision held to TF32's tolerance), beside cuBLAS's
IEEE fp32, which `vs_torch` stays against. Two times per row, both medians of many
repetitions: `time_ms`, one call at a time with L2 flushed between calls
(kernels_core.timing.bench: what an eager caller pays, Python wrapper included),
and `graph_ms`, ten calls replayed as one CUDA graph (kernels_core.timing.
bench_in_graph: the kernel's own time, as inside a graphed training step).
For small shapes the two differ by the host's launch cost. Writes
experiments/results/<gpu>/kernels.csv, one row per (case, backend), with the
provenance columns, and prints a table.

The two ceilings every row is compared with are measured in the same run: a
device-to-device copy (bytes read + written) and cuBLAS through torch on the
same GEMM shape (`vs_torch`).
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from kernels_core import contract
from kernels_core.provenance import provenance
from kernels_core.timing import bench, bench_in_graph
from kernels_core import backends as kernel_packages
from kernels_core.reference import exact, native
from kernels_core.shapes import shape_key
from experiments.paths import RESULTS, results_dir

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Case:
    group: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    layout: str = "nn"
    kwargs: dict = field(default_factory=dict)
    configs: dict = field(default_factory=dict)  # backend -> list of (label, config overrides)


def elementwise_cases(n_rows: int) -> list[Case]:
    # 256M fp32 elements (1 GiB per tensor): far past L2, one launch ~0.5 ms.
    shape = (n_rows, 4096)
    vec = {"cuda": [("default", None), ("VEC=1", {"VEC": 1}), ("VEC=4", {"VEC": 4})]}
    return [
        Case("elementwise", "relu", "fp32", shape, configs=vec),
        Case("elementwise", "relu_backward", "fp32", shape, configs=vec),
        Case("elementwise", "bias_add", "fp32", shape, configs=vec),
    ]


def gemm_cases(shapes: list[tuple[str, int]], store=None, arch: int | None = None) -> list[Case]:
    """Square products, (dtype, size) each, with each twin's default config and its tuned one where
    the store has that exact shape; fp32 in 3xTF32 on operands split ahead too (`arch`, by default
    the local GPU's: the wgmma kernel on sm_90)."""
    if arch is None:
        arch = contract.device_arch(torch.device("cuda")) if torch.cuda.is_available() else 0
    return [Case("gemm", "matmul", dt, (size,) * 3,
                 configs=_configs(store, dt, shape_key((size,) * 3, "nn"), ahead_arch=arch)) for dt, size in shapes]


def _configs(store, dtype: str, key: str, ahead_arch: int | None = None) -> dict:
    """Each twin's configs to time: its default, in 3xTF32 where its space has the TF32 tunable, and
    its tuned one if the store has `key`. With `ahead_arch`, 3xTF32 on operands split ahead too, the
    twins' fast path for large products: Triton's SPLIT_AHEAD (`tf32x3 split ahead`) and, on sm_90,
    the CUDA twin's wgmma kernel (`tf32x3 wgmma`), each the nearest such config to the default."""
    configs = {}
    for backend in ("cuda", "triton"):
        configs[backend] = [("default", None)]
        space = kernel_packages.space(backend, "matmul", dtype)
        if "TF32" in space.params:
            configs[backend].append(("tf32x3", _nearest(space, TF32=3)))
            for label, tunable in (("tf32x3 split ahead", "SPLIT_AHEAD"), ("tf32x3 wgmma", "WGMMA")):
                ahead = _nearest(space, ahead_arch, TF32=3, **{tunable: 1}) if ahead_arch and tunable in space.params \
                    else None
                if ahead is not None:  # None: no such config runs on ahead_arch (TF32 before sm_80, wgmma off sm_90)
                    configs[backend].append((label, ahead))
        tuned, source = store.lookup("matmul", backend, dtype, key) if store else (None, "")
        if source == "tuned":
            configs[backend].append(("tuned", tuned))
    return configs


def _nearest(space, arch: int = 90, **fixed) -> dict | None:
    """The overrides of the space's fp32 default for its valid config with the `fixed` values that
    differs from the default in the fewest tunables (the first such in the space's order): just
    `fixed` where the default's tiles take them (Triton's in 3xTF32), else the least change that
    makes them run (the CUDA twin's SIMT default, BLOCK_K = 8, takes 16 on the tensor cores); None
    where no config with them runs on `arch`."""
    configs = [c for c in space.configs(4, arch) if all(c[k] == v for k, v in fixed.items())]
    if not configs:
        return None
    best = min(configs, key=lambda c: sum(c[k] != v for k, v in space.default.items()))
    return {k: v for k, v in best.items() if v != space.default[k]}


# torch's variants: cuBLAS as torch calls it by default (IEEE fp32), and for fp32 products with TF32
# on, a lower precision reported beside it with its error; vs_torch is against the first.
TORCH_IEEE, TORCH_TF32 = "cuBLAS/aten", "cuBLAS TF32"


def _torch_variants(case: Case) -> list[tuple[str, None]]:
    tf32 = case.op == "matmul" and case.dtype == "fp32"
    return [(TORCH_IEEE, None)] + ([(TORCH_TF32, None)] if tf32 else [])


def _with_tf32(fn: Callable) -> Callable:
    """fn with torch's fp32 matmuls on TF32 tensor cores while it runs (or while a graph captures it)."""
    def call(*args, **kwargs):
        before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
        try:
            return fn(*args, **kwargs)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
    return call


def mlp_cases(dtypes: list[str]) -> list[Case]:
    """The GEMMs of an MLP layer: forward X·W, and the two backward products."""
    cases = []
    for dt in dtypes:
        for batch in (32, 128, 1024):
            for fan_in in (784, 1024, 4096):
                for fan_out in (10, 1024, 4096):
                    cases.append(Case("mlp", "matmul", dt, (batch, fan_out, fan_in), "nn",
                                      {"bias": True, "activation": "relu"}))
                    cases.append(Case("mlp", "matmul", dt, (fan_in, fan_out, batch), "tn"))
                    cases.append(Case("mlp", "matmul", dt, (batch, fan_in, fan_out), "nt"))
    return cases


def trainer_cases(store=None, widths: dict[str, tuple[int, ...]] | None = None) -> list[Case]:
    """The distinct GEMMs of both trainer protocols (at `widths[protocol]`, default each protocol's
    own), with the default and (when the store has the exact shape) the tuned config of each twin."""
    from kernels_core.mlp import PROTOCOLS, mlp_calls

    cases, seen = [], set()
    for name, protocol in PROTOCOLS.items():
        dtype = protocol.dtype
        for hidden in (widths or {}).get(name, protocol.widths):
            for call in mlp_calls(hidden, protocol.layers, protocol.batch_size, dtype):
                if call.op != "matmul" or (dtype, call.key) in seen:
                    continue
                seen.add((dtype, call.key))
                kwargs = {"bias": call.bias, "activation": call.activation}
                cases.append(Case("trainer", "matmul", dtype, call.shape, call.layout, kwargs,
                                  _configs(store, dtype, call.key)))
    return cases


def _randn(shape, dtype, gen, device):
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def make_call(case: Case, gen: torch.Generator, device: torch.device):
    """Inputs for one case and a function (module, config) -> result."""
    dt = DTYPES[case.dtype]
    if case.op == "matmul":
        m, n, k = case.shape
        a = _randn((k, m) if case.layout[0] == "t" else (m, k), dt, gen, device)
        b = _randn((n, k) if case.layout[1] == "t" else (k, n), dt, gen, device)
        bias = _randn((n,), dt, gen, device) if case.kwargs.get("bias") else None
        kw = dict(bias=bias, activation=case.kwargs.get("activation"),
                  trans_a=case.layout[0] == "t", trans_b=case.layout[1] == "t")
        args = (a, b)
        nbytes = (m * k + k * n + m * n) * a.element_size()
        work = 2.0 * m * n * k
    else:
        x = _randn(case.shape, dt, gen, device)
        if case.op == "relu":
            args, kw = (x,), {}
            nbytes = 2 * x.numel() * x.element_size()
        elif case.op == "relu_backward":
            args, kw = (_randn(case.shape, dt, gen, device), torch.relu(x)), {}
            nbytes = 3 * x.numel() * x.element_size()
        else:
            bias = _randn((case.shape[1],), dt, gen, device)
            args, kw = (x, bias), {}
            nbytes = (2 * x.numel() + bias.numel()) * x.element_size()
        work = None
    return args, kw, nbytes, work


# ||out - ref|| / ||ref|| allowed per dtype, and for TF32 products (10 mantissa bits, as fp16's).
MATMUL_TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2, "tf32": 2e-3}


def check(case: Case, out: torch.Tensor, args, kw, precision: str | None = None) -> tuple[float | None, str | None]:
    """(relative error against float64 for a matmul, else None; why the result is wrong, or None).
    `precision`: the lower precision the variant computes at, whose tolerance then applies."""
    if case.op == "matmul":
        ref = getattr(exact, case.op)(*args, **kw)
        err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        tol = MATMUL_TOLERANCE[precision or case.dtype]
        return err, None if err <= tol else f"relative error {err:.2e} > {tol:.0e}"
    ref = getattr(native, case.op)(*args, **kw)
    if not torch.equal(out, ref):
        return None, f"{(out != ref).sum().item()} elements differ from torch"
    return None, None


def run_case(case: Case, backends: dict, device, gen, copy_gbps: float | None) -> list[dict]:
    args, kw, nbytes, work = make_call(case, gen, device)
    rows, torch_ms, torch_graph_ms = [], None, None
    for backend, module in backends.items():
        variants = case.configs.get(backend, [("default", None)]) if backend != "torch" else _torch_variants(case)
        for label, config in variants:
            fn_op = _with_tf32(getattr(module, case.op)) if label == TORCH_TF32 else getattr(module, case.op)
            extra = {} if backend == "torch" else {"config": config}
            row = dict(group=case.group, op=case.op, backend=backend, dtype=case.dtype,
                       shape="x".join(map(str, case.shape)) + (f":{case.layout}" if case.op == "matmul" else ""),
                       config_label=label, config="" if config is None else str(config))
            precision = "tf32" if label == TORCH_TF32 else _precision(backend, case, config)
            try:
                out = fn_op(*args, **kw, **extra)
                torch.cuda.synchronize()
                error, problem = check(case, out, args, kw, precision)
                status, row["rel_err"] = "wrong_result", error
            except Exception as exc:  # a failing kernel is a result to report, not a crash
                status, problem = "error", f"{type(exc).__name__}: {exc}"
            if problem:
                row.update(status=status, error=problem[:300])
                rows.append(row)
                continue
            call = lambda: fn_op(*args, **kw, **extra)  # noqa: E731
            big = work and work > 1e11
            t = bench(call, max_seconds=1.0, reps=50 if big else 100)
            g = bench_in_graph(call, calls=2 if big or case.group == "elementwise" else 10)
            row.update(status="ok", error="", **t.as_row(), gbps=nbytes / t.median_ms / 1e6,
                       graph_ms=g.median_ms, graph_p20_ms=g.p20_ms, graph_p80_ms=g.p80_ms,
                       graph_gbps=nbytes / g.median_ms / 1e6)
            if work:
                row["tflops"] = work / t.median_ms / 1e9
                row["graph_tflops"] = work / g.median_ms / 1e9
            else:
                row["pct_of_copy"] = 100.0 * row["gbps"] / copy_gbps
            if label == TORCH_IEEE:
                torch_ms, torch_graph_ms = t.median_ms, g.median_ms
            rows.append(row)
    for row in rows:
        if torch_ms and row.get("status") == "ok":
            row["vs_torch"] = torch_ms / row["time_ms"]
            row["graph_vs_torch"] = torch_graph_ms / row["graph_ms"]
    return rows


def _precision(backend: str, case: Case, config: dict | None) -> str | None:
    """The lower precision a twin's config computes at (its space's declaration), or None."""
    if config is None:
        return None
    space = kernel_packages.space(backend, case.op, case.dtype)
    return space.precision_of(space.with_defaults(config))


def copy_ceiling(rows) -> float:
    """A kernels CSV's device copy in GB/s (its `ok` rows): the median of the copies its rounds
    measured, one a round."""
    return rows[rows.op == "copy"].gbps.astype(float).median()


def measure_copy(n: int, device) -> float:
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), max_seconds=1.0)
    return 2 * n * 4 / t.median_ms / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fp16 only for the MLP shapes")
    ap.add_argument("--only", default="elementwise,gemm,mlp", help="comma list of case groups "
                    "(elementwise, gemm, mlp, trainer)")
    ap.add_argument("--backends", default="cuda,triton,torch")
    ap.add_argument("--tuned-configs", default=None,
                    help="tuned store for the gemm and trainer groups (default experiments/<target>/best.json, else the one "
                         "shipped for this GPU)")
    ap.add_argument("--repeat", type=int, default=1, help="run every case this many times in turn (default 1)")
    ap.add_argument("--out", default=None, help="CSV path (default experiments/results/<gpu>/kernels.csv, "
                    "or trainer_gemms.csv for a run with the trainer group)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU: nothing to time on this machine.", file=sys.stderr)
        return 2
    backends = {b: (native if b == "torch" else kernel_packages.load(b)) for b in args.backends.split(",")}

    groups = args.only.split(",")
    n_rows = 16384 if args.quick else 65536
    store = _tuned_store(args.tuned_configs) if {"gemm", "trainer"} & set(groups) else None
    cases = []
    if "elementwise" in groups:
        cases += elementwise_cases(n_rows)
    if "gemm" in groups:
        cases += gemm_cases([(dt, 2048 if args.quick else 4096) for dt in ("fp32", "fp16", "bf16")], store)
    if "mlp" in groups:
        cases += mlp_cases(["fp16"] if args.quick else ["fp32", "fp16"])
    if "trainer" in groups:
        cases += trainer_cases(store)

    name = "trainer_gemms" if "trainer" in groups else "kernels"
    out = Path(args.out) if args.out else results_dir() / f"{name}.csv"
    rows = measure(cases, backends, n_rows * 4096, out, args.repeat)
    print_table(rows)
    print(f"wrote {out}")
    return 0


def measure(cases: list[Case], backends: dict, copy_elements: int | None, out: Path, repeat: int = 1,
            log: Callable[[str], None] = partial(print, file=sys.stderr, flush=True),
            done_one: Callable[[], None] = lambda: None) -> list[dict]:
    """The copy ceiling (a copy of `copy_elements` fp32 values; None: no ceiling, for cases that are
    not elementwise), then every case `repeat` times in turn; writes `out` and returns its rows.

    Rows go to OUT.partial as each case ends, which becomes OUT once all are measured: a run
    stopped at its time limit keeps what it measured and leaves the last complete OUT as it was."""
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 baselines are true fp32
    gen = torch.Generator(device=device).manual_seed(0)
    copy_gbps = measure_copy(copy_elements, device) if copy_elements else None
    if copy_gbps:
        log(f"device copy: {copy_gbps:.0f} GB/s (read + write)")
    prov = provenance()
    out.parent.mkdir(parents=True, exist_ok=True)
    in_progress = out.with_name(out.name + ".partial")
    columns = ["group", "op", "backend", "dtype", "shape", "config_label", "config", "status", "error",
               "rel_err", "time_ms", "time_p20_ms", "time_p80_ms", "reps", "gbps", "pct_of_copy", "tflops", "vs_torch",
               "graph_ms", "graph_p20_ms", "graph_p80_ms", "graph_gbps", "graph_tflops", "graph_vs_torch", "rep",
               *prov]
    rows = [dict(group="ceiling", op="copy", backend="torch", dtype="fp32", shape=f"{copy_elements}",
                 status="ok", gbps=copy_gbps, pct_of_copy=100.0)] if copy_gbps else []
    with in_progress.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({**prov, **row} for row in rows)
        for rep in range(repeat):
            for i, case in enumerate(cases):
                done = run_case(case, backends, device, gen, copy_gbps)
                for row in done:
                    writer.writerow({**prov, **row, "rep": rep})
                f.flush()
                rows += done
                log(f"[{rep + 1}/{repeat} {i + 1}/{len(cases)}] {case.group} {case.op} {case.dtype} {case.shape}")
                done_one()
    in_progress.replace(out)
    return rows


def _tuned_store(path):
    """The tuned store for the local GPU, or None (then the trainer group times defaults only)."""
    from kernels_core.store import choose_local_store, load_store
    from trainer.tuned_configs import target_name

    path = Path(path) if path else choose_local_store(RESULTS.parent).path
    if path is None or not path.exists():
        print(f"no tuned store ({path or 'none of yours or shipped'}): the trainer group times default configs only",
              file=sys.stderr)
        return None
    return load_store(path, target_name("auto"))


def _fmt(v, spec):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_table(rows: list[dict]) -> None:
    print(f"{'op':14} {'backend':7} {'dt':4} {'shape':22} {'config':9} {'ms':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'vs torch':>8} {'graph ms':>9} {'g vs torch':>10}")
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['op']:14} {r['backend']:7} {r['dtype']:4} {r['shape']:22} {r.get('config_label', ''):9} "
                  f"{r['status']}: {r.get('error', '')}")
            continue
        print(f"{r['op']:14} {r['backend']:7} {r['dtype']:4} {r['shape']:22} {r.get('config_label', ''):9} "
              f"{_fmt(r.get('time_ms'), '9.4f')} {_fmt(r.get('gbps'), '7.0f')} {_fmt(r.get('pct_of_copy'), '6.1f')} "
              f"{_fmt(r.get('tflops'), '8.1f')} {_fmt(r.get('vs_torch'), '8.2f')} "
              f"{_fmt(r.get('graph_ms'), '9.4f')} {_fmt(r.get('graph_vs_torch'), '10.2f')}")


if __name__ == "__main__":
    sys.exit(main())
