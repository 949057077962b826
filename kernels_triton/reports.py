"""What a config costs the hardware: registers, shared memory, spills.

`compile_report` answers offline, with no GPU: it builds the same launch plan
the op would build for a representative large problem (on shape-only "meta"
tensors), hands the kernel to `triton.compile` for the requested target, and
reads shared memory from Triton's metadata and registers / spills from
`ptxas -v` on the PTX it produced. The interpreter never compiles, so this is
also how CPU-only tests find kernels that would not build for a real GPU.

`resource_report` answers from the kernel the op last launched with that
config on the local GPU (Triton's CompiledKernel knows n_regs, n_spills).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernels_core import contract

from . import _runtime as rt
from . import elementwise, fused, loss, optim, reduction
# The package re-exports the function `matmul`, so the module's names are imported directly.
from .matmul import plan as plan_matmul


def _sample_plan(op: str, dtype: str, config) -> rt.Plan:
    """The launch plan for a representative large, aligned problem of `op` (the fused loss's N is
    the trainer's 10 classes: a whole row must fit the smallest BLOCK_N)."""
    dt = contract.DTYPES[dtype]

    def t(*shape, dtype=dt):
        return torch.empty(shape, dtype=dtype, device="meta")

    if op == "matmul":
        return plan_matmul(t(4096, 4096), t(4096, 4096), bias=t(4096), config=config)[1]
    if op == "relu":
        return elementwise.plan_relu(t(1 << 24), config=config)[1]
    if op == "relu_backward":
        return elementwise.plan_relu_backward(t(1 << 24), t(1 << 24), config=config)[1]
    if op == "bias_add":
        return elementwise.plan_bias_add(t(4096, 4096), t(4096), activation="relu", config=config)[1]
    if op == "bias_grad":
        return reduction.plan_bias_grad(t(4096, 4096), config=config)[1]
    if op == "softmax_cross_entropy":
        labels = t(4096, dtype=torch.int64)
        return loss.plan_softmax_cross_entropy(t(4096, 32768), labels, config=config)[2]
    f32 = torch.float32
    if op == "linear_cross_entropy":  # the trainer's last layer: a batch drawn from the labels by index
        return fused.plan_linear_cross_entropy(t(4096, 4096), t(4096, 10), t(60000, dtype=torch.int64), bias=t(10),
                                               label_rows=t(4096, dtype=torch.int64), config=config)[2]
    if op == "linear_sgd":  # every feature on: a gathered batch, momentum, weight decay, low-precision copies
        return fused.plan_linear_sgd(t(60000, 4096), t(4096, 4096), t(4096, 4096, dtype=f32), t(4096, dtype=f32),
                                     t(4096, 4096, dtype=f32), t(4096, dtype=f32), lr=0.1, momentum=0.9,
                                     weight_decay=1e-4, x_rows=t(4096, dtype=torch.int64), w_low=t(4096, 4096),
                                     b_low=t(4096), config=config)
    return optim.plan_sgd_update([t(1 << 20, dtype=f32)], [t(1 << 20)], [t(1 << 20, dtype=f32)],
                                 lr=0.1, momentum=0.9, weight_decay=1e-4, config=config)[0]


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                 torch.int64: "i64"}


def _ast_source(plan: rt.Plan) -> ASTSource:
    """Specialize the plan's arguments the way a launch would: pointers and
    integers known to be 16-divisible get the divisibility hint, integers
    equal to 1 become constants."""
    # Under the interpreter @triton.jit produced an InterpretedFunction; the
    # compiler needs a JITFunction of the same Python function.
    fn = plan.kernel if isinstance(plan.kernel, JITFunction) else JITFunction(plan.kernel.fn)
    signature, constexprs, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for i, param in enumerate(fn.params):
        value = plan.args[param.name]
        if param.is_constexpr or (isinstance(value, int) and value == 1):
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = divisible
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = divisible
        else:
            signature[param.name] = "fp32"
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptxas_candidates() -> list[str]:
    """ptxas binaries, newest first: the one Triton itself compiles with (its
    bundled ptxas-blackwell for sm_90+ in 3.9), the other bundled one, PATH's."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    paths = [os.path.join(bin_dir, name) for name in ("ptxas-blackwell", "ptxas")]
    paths.append(shutil.which("ptxas") or "")
    return [p for p in paths if os.path.isfile(p)]


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) as `ptxas -v` reports them. The PTX's
    .version may be newer than an older ptxas reads, so each is tried."""
    target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for ptxas in _ptxas_candidates():
            done = subprocess.run([ptxas, f"-arch={target}", "-v", src, "-o", os.path.join(tmp, "kernel.cubin")],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
                spills = re.search(r"(\d+) bytes spill stores", done.stderr)
                return registers, int(spills.group(1)) if spills else 0
            errors.append(f"{ptxas}: {done.stderr.strip()[-300:]}")
    raise RuntimeError("no ptxas could assemble the PTX:\n" + "\n".join(errors))


def _arch_number(arch) -> int:
    if isinstance(arch, str) and re.fullmatch(r"sm_\d+a?", arch):
        return int(arch[3:].rstrip("a"))
    if isinstance(arch, bool) or not isinstance(arch, int):
        raise TypeError(f"arch: expected a compute capability like 90 or 'sm_90', got {arch!r}")
    return arch


def compile_report(op: str, dtype: str, config=None, arch=90) -> dict:
    """Compile `op`'s kernel for `arch` without a GPU; report what it uses."""
    from . import space

    sp = space(op, dtype)
    arch = _arch_number(arch)
    cfg = sp.resolve(config, contract.DTYPES[dtype].itemsize, arch)
    if rt.interpreting():
        return _compile_elsewhere(op, dtype, cfg, arch)
    plan = _sample_plan(op, dtype, cfg)
    start = time.perf_counter()
    compiled = triton.compile(_ast_source(plan), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    compile_s = time.perf_counter() - start  # a hit in Triton's on-disk cache makes this small
    registers, spill_bytes = _ptxas_usage(compiled.asm["ptx"])
    return dict(registers=registers, smem_bytes=int(compiled.metadata.shared), spill_bytes=spill_bytes,
                compile_s=compile_s)


def _compile_elsewhere(op: str, dtype: str, config: dict, arch: int) -> dict:
    """compile_report in a fresh Python with the interpreter off.

    Under TRITON_INTERPRET=1 every @triton.jit function, Triton's own library
    (tl.cdiv, tl.sum, ...) included, is an interpreter object the compiler
    cannot lower, so this process cannot compile. Costs an interpreter start
    (seconds) per call; batch many reports in one process where that matters.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    script = ("import json, sys, kernels_triton as kt; "
              "print(json.dumps(kt.compile_report(*json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps([op, dtype, config, arch])],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {op}/{dtype} {config} for sm_{arch} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def resource_report(op: str, dtype: str, config=None) -> dict | None:
    """Resources of the kernel `op` last launched with `config` on this GPU, or
    None if it has not run (or runs in the interpreter). compile_s is None:
    launches do not time their compiles."""
    from . import space

    sp = space(op, dtype)
    compiled = rt.LAUNCHED.get(rt.config_key(op, dtype, {**sp.default, **(config or {})}))
    if compiled is None:
        return None
    return dict(registers=int(compiled.n_regs), smem_bytes=int(compiled.metadata.shared),
                spill_bytes=4 * int(compiled.n_spills),  # Triton counts spills in 32-bit words
                compile_s=None)
