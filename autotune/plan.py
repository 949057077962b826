"""What a search command asks for, resolved and checked before any work starts."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from types import ModuleType

from kernels_core import backends
from kernels_core.targets import Target, resolve_target
from autotune.workload import calls_for_shapes
from kernels_core.mlp import Call, dedupe, mlp_calls, persistent_call
from kernels_core.shapes import OP_RANK, parse_shapes
from kernels_core.contract import DTYPES, OPS, TUNED_OPS
from kernels_core.space import Space


@dataclass
class Job:
    backend: str
    call: Call
    space: Space


@dataclass
class Plan:
    target: Target
    modules: dict[str, ModuleType]
    ops: list[str]
    dtypes: list[str]
    jobs: list[Job] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "what: why", for the summary

    def tunables(self) -> list[str]:
        """Every tunable name of the chosen backends (all ops), for stable CSV columns."""
        names: list[str] = []
        for module in self.modules.values():
            for op in OPS + tuple(op for op in self.ops if op not in OPS):  # the ops' columns in every run
                for dtype in DTYPES:
                    try:
                        space = module.space(op, dtype)
                    except Exception:  # an op a backend lacks has no columns to add
                        continue
                    names += [n for n in space.params if n not in names]
        return names


def split_list(text: str, allowed, what: str, everything=None) -> list[str]:
    """The comma-separated `text`, each item one of `allowed`; "all": `everything` (default `allowed`)."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if items == ["all"]:
        return list(allowed if everything is None else everything)
    unknown = [i for i in items if i not in allowed]
    if unknown or not items:
        raise ValueError(f"--{what}: unknown {unknown or 'empty list'}; choose from {', '.join(allowed)} or all")
    return list(dict.fromkeys(items))


# The twin that launches through CuPy: nothing of it runs on the cpu target (the host, with the
# Triton interpreter).
NEEDS_GPU = {"cuda": "the raw-CUDA twin runs on an NVIDIA GPU only"}


def build_plan(args: argparse.Namespace) -> Plan:
    target = resolve_target(args.target, compile_only=args.compile_only)
    ops = split_list(args.ops, TUNED_OPS, "ops", everything=OPS)  # the persistent kernel only when named
    skipped = []
    if args.compile_only and "persistent" in ops:  # compile reports know the ops' kernels, not the net's
        ops.remove("persistent")
        skipped.append("persistent: --compile-only has no compile report of the persistent kernel (its kernel is "
                       "the net's, not a config's); time it on a GPU")
    # The workload's default is the trainer's default dtype, so a plain run tunes what it trains.
    dtypes = split_list(args.dtypes or ("fp16" if args.shapes is not None else "fp32"), tuple(DTYPES), "dtypes")
    names = split_list(args.backends, tuple(backends.registry()), "backends")
    if target.name == "cpu":  # search.parse_args refuses --compile-only with it
        skipped += [f"{name}: {NEEDS_GPU[name]}; --target cpu times on the host" for name in names if name in NEEDS_GPU]
        names = [name for name in names if name not in NEEDS_GPU]
    plan = Plan(target, {name: backends.load(name) for name in names}, ops, dtypes, skipped=skipped)
    shapes = parse_shapes(args.shapes) if args.shapes is not None else None
    ops_with_calls: set[str] = set()
    for dtype in dtypes:
        if shapes is not None:
            calls = calls_for_shapes(ops, dtype, shapes, args.momentum)
        else:
            calls = dedupe([c for hidden in args.hidden
                            for c in mlp_calls(hidden, args.layers, args.batch_size, dtype, momentum=args.momentum)
                            + [persistent_call(hidden, args.layers, args.batch_size, dtype, args.momentum)]
                            if c.op in ops])
        ops_with_calls |= {c.op for c in calls}
        for call in calls:
            for name, module in plan.modules.items():
                what = f"{call.op}:{name}:{dtype}:{call.key}"
                try:
                    space = module.space(call.op, dtype)
                except Exception as exc:  # the backend does not offer this op/dtype
                    plan.skipped.append(f"{what}: {name}.space failed: {type(exc).__name__}: {exc}")
                    continue
                problem = target.space_problem(space, DTYPES[dtype].itemsize)
                if problem:
                    plan.skipped.append(f"{what}: {problem}")
                    continue
                plan.jobs.append(Job(name, call, space))
    for op in ops:
        rank = OP_RANK[op]
        if op in ops_with_calls:
            continue
        if op == "persistent":
            plan.skipped.append(f"{op}: the persistent kernel is tuned on the {args.workload} workload's net, "
                                "which --shapes does not give (leave --shapes out)")
        elif shapes is not None:
            plan.skipped.append(f"{op}: --shapes has no shape of {rank} dimension{'s' * (rank > 1)} ({op}'s rank)")
        else:  # the workload is the trainer's calls, and its MLP fuses the bias add and the ReLU into matmul
            plan.skipped.append(
                f"{op}: the {args.workload} workload has no {op} call (the trainer runs its bias add and ReLU "
                f"fused in matmul's epilogue); to tune {op} on the MLP's activations, give their shape: "
                f"--shapes {args.batch_size}x{args.hidden[0]}")
    return plan
