"""The trial runner, alone in a subprocess so a crash, a hang or a poisoned CUDA
context costs one trial, not the search.

Protocol: one JSON object per line on stdin, one answer per line on the
original stdout (which is moved aside: whatever the libraries print goes to
stderr, the worker's log). The first line out is {"ready": true}.

  {"cmd": "prepare", "backend", "op", "dtype", "shape", "layout", "bias",
   "activation", "fused_arg", "momentum", "config", "seed", "device"}
      fresh random inputs, then the first call (which compiles; the kernel
      libraries cache binaries on disk) -> compile_s and resource figures
  {"cmd": "build", "backend", "op", ... as prepare}
      the call's kernels compiled and loaded, none launched (kernels_core.compile_only),
      on inputs of the call's shapes (kept for the next build of the same call)
      -> compile_s; the process that times the config then finds them in the disk caches
  {"cmd": "measure", "reps", "max_seconds"}
      correctness of the prepared call against the float64 reference, then
      its time (kernels_core.timing; on a GPU, replays of a CUDA graph of a few
      calls) -> time_ms, time_p20_ms, time_p80_ms, rel_err. A config that
      computes below its dtype's precision is held to that precision's
      tolerance; one that emulates the dtype's precision (3xTF32) must also be
      at least as accurate as the space's default config on the same inputs
      (else less_accurate), whose error comes back as default_rel_err
  {"cmd": "compile", "backend", "op", "dtype", "configs", "arch"}
      offline compile reports (no GPU needed) -> {"reports": [...]}
  {"cmd": "ask", "spec", "sampler_seed", "row", "recorder"}
      a compile process asks a study for its next config (autotune.asking) -> {"asked": ...}

A failed step answers {"ok": false, "status": ..., "error": ...}; "fatal":
true means the CUDA context is unusable and the worker exits after answering.
Backend "torch" runs reference.native, the baseline every study reports against.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

MAX_ERROR_CHARS = 1500
GRAPH_CALLS = 10


def _watch_parent(parent: int) -> None:
    # The parent may die by SIGKILL; a worker stuck in a kernel must not outlive it.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\r", "")
    text = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    return text[:MAX_ERROR_CHARS]


def classify(exc: BaseException) -> str:
    """Outcome of an exception raised by a backend call."""
    if isinstance(exc, ValueError) and str(exc).startswith("config:"):
        return "invalid"  # the backend's own launch-time check (e.g. this GPU's shared memory)
    kind = f"{type(exc).__module__}.{type(exc).__name__}".lower()
    if any(word in kind for word in ("compil", "outofresources", "nvrtc", "ptxas", "linker")):
        return "compile_error"
    return "launch_error"


def _call(req: dict):
    from kernels_core.mlp import Call

    return Call(req["op"], req["dtype"], tuple(req["shape"]), req.get("layout", ""), req.get("bias", False),
                req.get("activation"), req.get("fused_arg"), req["momentum"])


class Runner:
    def __init__(self):
        import torch

        self.torch = torch
        self.prepared = None
        self.build_inputs = None  # (call, inputs) of the last build: a study builds many configs of one call
        self.default_errors = {}  # (backend, call, seed) -> the default config's error on those inputs

    def _sync(self, device) -> None:
        if device.type == "cuda":
            self.torch.cuda.synchronize(device)

    def _failure(self, exc: BaseException, device) -> dict:
        traceback.print_exc(file=sys.stderr)
        answer = {"ok": False, "status": classify(exc), "error": describe(exc)}
        if answer["status"] == "launch_error" and device is not None and device.type == "cuda":
            answer["fatal"] = not self._context_alive(device)
        return answer

    def _context_alive(self, device) -> bool:
        try:
            self.torch.ones(1, device=device).add_(1).item()
            self.torch.cuda.synchronize(device)
            return True
        except Exception:  # a sticky CUDA error: every later call would fail too
            return False

    def prepare(self, req: dict) -> dict:
        from kernels_core import backends
        from autotune.workload import call_inputs, run
        from kernels_core import reference

        torch = self.torch
        self.prepared = None
        device = torch.device(req["device"])
        call = _call(req)
        try:
            if req["backend"] == "torch":
                module, fn, config, space = None, getattr(reference.native, call.op), None, None
            else:
                module = backends.load(req["backend"])
                fn, config, space = getattr(module, call.op), req.get("config"), module.space(call.op, call.dtype)
            generator = torch.Generator(device=device)
            generator.manual_seed(int(req.get("seed", 0)))
            inputs = call_inputs(call, device, generator)
            start = time.perf_counter()
            run(fn, call.op, inputs.clone(), config)
            self._sync(device)
            compile_s = time.perf_counter() - start
        except Exception as exc:  # every failure is a trial outcome, recorded with its message
            return self._failure(exc, device)
        self.prepared = (call, fn, config, inputs, device, space, (req["backend"], call, int(req.get("seed", 0))))
        answer = {"ok": True, "compile_s": compile_s}
        if module is not None and hasattr(module, "resource_report") and config is not None:
            try:
                report = module.resource_report(call.op, call.dtype, config) or {}
            except Exception:  # resource figures are a nicety; the trial stands without them
                traceback.print_exc(file=sys.stderr)
                report = {}
            answer.update({k: report.get(k) for k in ("registers", "smem_bytes", "spill_bytes")})
        return answer

    def ask(self, req: dict) -> dict:
        from autotune.asking import ask
        from autotune.errors import SearchError
        from autotune.storage import STORAGE_ERRORS, shown_url, storage_problem

        try:
            return ask(req["spec"], req["sampler_seed"], req["row"], req["recorder"])
        except Exception as exc:  # the storage, or a space the study no longer matches: the search stops
            traceback.print_exc(file=sys.stderr)
            if isinstance(exc, STORAGE_ERRORS):  # as the search process says it: a line, no SQL
                error = f"--storage {shown_url(req['spec']['storage'])}: {storage_problem(exc)}"
            else:
                error = str(exc) if isinstance(exc, SearchError) else f"asking for a config: {describe(exc)}"
            return {"ok": False, "status": "ask_error", "error": error}

    def build(self, req: dict) -> dict:
        from autotune.workload import call_inputs, run
        from kernels_core import backends
        from kernels_core.compile_only import compile_only

        device = self.torch.device(req["device"])
        call = _call(req)
        try:
            fn = getattr(backends.load(req["backend"]), call.op)
            if self.build_inputs is None or self.build_inputs[0] != call:
                generator = self.torch.Generator(device=device)
                generator.manual_seed(int(req.get("seed", 0)))
                self.build_inputs = (call, call_inputs(call, device, generator))
            start = time.perf_counter()
            with compile_only():  # what the kernels would compute does not matter: none runs
                run(fn, call.op, self.build_inputs[1], req.get("config"))
            self._sync(device)
            return {"ok": True, "compile_s": time.perf_counter() - start}
        except Exception as exc:  # see prepare
            return self._failure(exc, device)

    def measure(self, req: dict) -> dict:
        """The prepared call checked against float64, then timed (the persistent kernel's time is a
        step's: a segment's over its steps, autotune.workload.timed)."""
        from autotune.workload import bind, check_result, expected, gate_precision, run, timed

        if self.prepared is None:
            return {"ok": False, "status": "launch_error", "error": "measure without a prepared call"}
        call, fn, config, inputs, device, space, inputs_key = self.prepared
        try:
            outputs = run(fn, call.op, inputs.clone(), config)
            refs = expected(call.op, inputs)
            precision = gate_precision(call, space, config)
            error, problem = check_result(outputs, refs, precision)
            default_error = None
            if problem:
                return {"ok": False, "status": "wrong_result", "rel_err": error, "error": problem}
            if config is not None and space.is_emulated(config):
                default_error = self._exact_error(call, fn, inputs, refs, config, space, inputs_key)
                if default_error is None or error > default_error:
                    problem = (f"relative error {error:.3g} above the exact default config's {default_error:.3g} on "
                               "the same inputs" if default_error is not None else
                               "no exact config runs this call to compare with") + \
                        ": a config emulating its dtype's precision must be at least as accurate"
                    return {"ok": False, "status": "less_accurate", "rel_err": error,
                            "default_rel_err": default_error, "error": problem}
            what, units = timed(call.op, inputs.clone())
            timing = self._time(bind(fn, call.op, what, config), device, int(req.get("reps", 100)),
                                float(req.get("max_seconds", 2.0))).per(units)
        except Exception as exc:  # see prepare
            return self._failure(exc, device)
        return {"ok": True, "rel_err": error, "default_rel_err": default_error, **timing.as_row()}

    def _exact_error(self, call, fn, inputs, refs, config, space, key) -> float | None:
        """The error on these inputs of the exact computation an emulating config is held to: the
        space's default (once per call and seed), else, where the default cannot run the call (a
        loss wider than its BLOCK_N), the same config with its emulating tunables at their
        defaults; None where neither runs."""
        from autotune.workload import check_result, run

        if key not in self.default_errors:
            try:
                self.default_errors[key] = check_result(run(fn, call.op, inputs.clone(), None), refs)[0]
            except ValueError:  # a config the call refuses, before anything launches
                self.default_errors[key] = None
        if self.default_errors[key] is not None:
            return self.default_errors[key]
        exact = {**config, **{name: space.default[name] for name in space.emulated}}
        try:
            return check_result(run(fn, call.op, inputs.clone(), exact), refs)[0]
        except ValueError:
            return None

    def _time(self, call, device, reps: int, max_seconds: float):
        """GPU time of one call.

        On a GPU, GRAPH_CALLS calls are captured in a CUDA graph and its replays
        timed: a small kernel then reports its own time, not the Python launch
        path around it (which a trainer replaying graphs does not pay either).
        An op that cannot be captured is timed call by call.
        """
        from kernels_core.timing import bench, bench_in_graph

        if device.type == "cuda":
            try:
                return bench_in_graph(call, calls=GRAPH_CALLS, reps=reps)
            except Exception:  # not capturable: fall back to timing launches
                traceback.print_exc(file=sys.stderr)
                self.torch.cuda.synchronize(device)
        return bench(call, device=device, reps=reps, max_seconds=max_seconds)

    def compile(self, req: dict) -> dict:
        from kernels_core import backends

        try:
            module = backends.load(req["backend"])
        except Exception as exc:
            return self._failure(exc, None)
        op, dtype, configs, arch = req["op"], req["dtype"], req["configs"], int(req["arch"])
        if hasattr(module, "compile_reports") and len(configs) > 1:
            start = time.perf_counter()
            try:
                reports = module.compile_reports(op, dtype, configs, arch)
                share = (time.perf_counter() - start) / len(configs)
                return {"ok": True, "reports": [_report(r, share) for r in reports]}
            except Exception:  # fall back to one by one, so each config gets its own verdict
                traceback.print_exc(file=sys.stderr)
        reports = []
        for config in configs:
            start = time.perf_counter()
            try:
                reports.append(_report(module.compile_report(op, dtype, config, arch), time.perf_counter() - start))
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                reports.append({"status": classify(exc), "error": describe(exc)})
        return {"ok": True, "reports": reports}


def _report(report: dict, elapsed: float) -> dict:
    if report.get("error"):
        return {"status": "compile_error", "error": str(report["error"])[:MAX_ERROR_CHARS]}
    out = {k: report.get(k) for k in ("registers", "smem_bytes", "spill_bytes", "compile_s")}
    out["compile_s"] = out["compile_s"] if out["compile_s"] is not None else elapsed
    return {"status": "ok", **out}


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    def answer(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    runner = Runner()
    answer({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "exit":
            break
        result = getattr(runner, req["cmd"])(req)
        answer(result)
        if result.get("fatal"):
            os._exit(4)


if __name__ == "__main__":
    main()
