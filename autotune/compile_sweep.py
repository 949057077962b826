"""--compile-only: compile a target's configs without a GPU and record what they cost.

Each (op, backend, dtype) gets every config that passes the target's rules
(a deterministic sample when there are more than the cap), compiled in worker
subprocesses, in batches through the backend's compile_reports when it has
one. Registers, shared memory and spills go to trials.csv; configs already
recorded there are not compiled again.
"""
from __future__ import annotations

import argparse
import itertools
import os
import queue
import random
import threading

from autotune import console
from autotune.plan import Plan
from kernels_core.provenance import AS_TEXT, COLUMNS as PROVENANCE, provenance
from autotune.samplers import view_space
from autotune.studies import LOWER_PRECISION_SUFFIX
from autotune.trials_csv import TrialsCsv, columns
from autotune.worker_pool import WorkerProcess, WorkerStartError, worker_env
from kernels_core.contract import DTYPES

DEFAULT_CAP = 256
BATCH = 8


def _sample(view, target, elt, cap: int, seed: int) -> tuple[list[tuple[int, dict]], int | None]:
    """(index, config) pairs to compile and the number of valid configs (None: too many to count)."""
    rng = random.Random(seed)
    if view.valid is not None:
        picked = range(len(view.valid)) if len(view.valid) <= cap else sorted(rng.sample(range(len(view.valid)), cap))
        return [(i, view.valid[i]) for i in picked], len(view.valid)
    # Too large to enumerate: draw combos at random, index them by their position in the full product.
    names, sizes = list(view.space.params), [len(v) for v in view.space.params.values()]
    chosen: dict[int, dict] = {}
    for _ in range(200 * cap):
        if len(chosen) >= cap:
            break
        picks = [rng.randrange(s) for s in sizes]
        index = 0
        for p, s in zip(picks, sizes):
            index = index * s + p
        config = {n: view.space.params[n][p] for n, p in zip(names, picks)}
        if target.target_violation(view.space, config, elt) is None:
            chosen[index] = config
    return sorted(chosen.items()), None


def run(plan: Plan, args: argparse.Namespace) -> int:
    target, cap = plan.target, args.trials or DEFAULT_CAP
    out_dir = args.out / target.name
    csv = TrialsCsv(out_dir / "trials.csv", columns(plan.tunables()))
    have, prov = csv.keys(), provenance()
    work: queue.Queue = queue.Queue()
    notes, studies, total = [], [], 0
    for (backend, module), op, dtype in itertools.product(plan.modules.items(), plan.ops, plan.dtypes):
        what, elt = f"{op}:{backend}:{dtype}", DTYPES[dtype].itemsize
        try:
            space = module.space(op, dtype)
        except Exception as exc:  # the backend does not offer this op/dtype
            notes.append(f"skipped {what}: {backend}.space failed: {type(exc).__name__}: {exc}")
            continue
        problem = target.space_problem(space, elt)
        if problem:
            notes.append(f"skipped {what}: {problem}")
            continue
        lower = bool(args.lower_precision and space.lower_precision)
        view = view_space(space, target, elt, lower)
        picked, n_valid = _sample(view, target, elt, cap, args.seed)
        # Rows are keyed by the index into the view's configs, which the lower precision changes.
        name = (f"{args.study_prefix}{target.name}:{op}:{backend}:{dtype}:compile"
                + (LOWER_PRECISION_SUFFIX if lower else ""))
        pruned = "?" if n_valid is None else view.total - n_valid
        studies.append({"study": name, "op": op, "backend": backend, "dtype": dtype,
                        "valid": "?" if n_valid is None else n_valid, "pruned": pruned, "sampled": len(picked)})
        if n_valid is None or len(picked) < n_valid:
            notes.append(f"{what}: compiling a deterministic sample of {len(picked)} of "
                         f"{n_valid if n_valid is not None else 'too many to count'} valid configs "
                         f"(seed {args.seed}; --trials sets the cap)")
        todo = [(i, c) for i, c in picked if (name, str(i)) not in have]
        total += len(todo)
        for start in range(0, len(todo), BATCH):
            work.put((name, backend, op, dtype, todo[start:start + BATCH]))

    bar = console.bar(total=total, unit="config", desc=f"compile {target.name}")

    def record(name, backend, op, dtype, index, config, report):
        status, error = report.get("status", "compile_error"), report.get("error")
        smem = report.get("smem_bytes")
        if status == "ok" and smem is not None and smem > target.smem_per_block_optin:
            status, error = "invalid", f"uses {smem} bytes of shared memory; {target.name} allows {target.smem_per_block_optin}"
        csv.append({**{k: prov.get(k) for k in PROVENANCE}, "target": target.name, "op": op, "backend": backend,
                    "dtype": dtype, "shape": "", **config, "status": status, "error": error,
                    **{k: report.get(k) for k in ("compile_s", "registers", "smem_bytes", "spill_bytes")},
                    "trial": index, "study": name, "sampler": "compile-only"})
        bar.update(1)

    n = args.workers or max(1, min(8, os.cpu_count() or 1))
    workers = [WorkerProcess(f"compile-{i}", worker_env(None, interpret=False),
                             args.out / "logs" / target.name / f"compile-{i}.log") for i in range(n)]
    stop = threading.Event()
    failed: list[WorkerStartError] = []

    def drain(worker: WorkerProcess) -> None:
        try:
            while not stop.is_set():
                try:
                    name, backend, op, dtype, batch = work.get_nowait()
                except queue.Empty:
                    return
                answer = worker.request({"cmd": "compile", "backend": backend, "op": op, "dtype": dtype,
                                         "configs": [c for _, c in batch], "arch": target.arch}, args.timeout)
                if stop.is_set():  # its worker was killed: not an outcome of the batch
                    return
                if answer.get("ok"):
                    for (i, config), report in zip(batch, answer["reports"]):
                        record(name, backend, op, dtype, i, config, report)
                elif len(batch) > 1:  # a hang or crash in a batch: find the culprit one by one
                    for item in batch:
                        work.put((name, backend, op, dtype, [item]))
                else:
                    record(name, backend, op, dtype, batch[0][0], batch[0][1], answer)
        except WorkerStartError as exc:
            if not stop.is_set():  # killed while starting is no failure of its own
                failed.append(exc)
                stop.set()
        finally:
            worker.close()

    threads = [threading.Thread(target=drain, args=(w,), daemon=True) for w in workers]
    interrupted = False
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
        for worker in workers:
            worker.interrupt()  # unblocks its thread, which records nothing more
        for t in threads:
            if t.is_alive():
                t.join(30)
    bar.close()
    csv.close()
    if failed:
        raise failed[0]
    _summary(csv.path, studies, notes)
    if interrupted:
        print("interrupted: configs in flight were dropped; re-run the same command to resume.")
        return console.INTERRUPTED
    return 0


def _summary(path, studies: list[dict], notes: list[str]) -> None:
    import pandas as pd

    rows = pd.read_csv(path, dtype=AS_TEXT)
    table = []
    for s in studies:
        mine = rows[rows["study"] == s["study"]]
        ok = mine[mine["status"] == "ok"]
        regs = ok["registers"].dropna()
        table.append({**{k: s[k] for k in ("op", "backend", "dtype", "valid", "pruned", "sampled")},
                      "compiled ok": len(ok),
                      "failures": ", ".join(f"{k}:{v}" for k, v in mine.loc[mine["status"] != "ok", "status"]
                                            .value_counts().items()) or "-",
                      "registers": f"{int(regs.min())}-{int(regs.max())}" if len(regs) else "-",
                      "with spills": int((ok["spill_bytes"].fillna(0) > 0).sum()),
                      "max smem": int(ok["smem_bytes"].max()) if ok["smem_bytes"].notna().any() else "-"})
    print()
    if table:
        print(pd.DataFrame(table).to_string(index=False))
    pruned = sum(s["pruned"] for s in studies if s["pruned"] != "?")
    print(f"\nstatically invalid configs pruned before compiling: {pruned}")
    for line in notes:
        print(line)
    print(f"trials: {path}")
