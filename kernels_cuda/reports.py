"""What a config costs the hardware: registers, shared memory, spills.

`compile_reports` answers offline, with no GPU: it builds every config's
representative variant (row-major operands, no epilogue extras; for the fused
ops, their epilogue on the trainer's layouts: fused.report_variant) with nvcc
in one call per source file and reads ptxas's numbers. `resource_report` answers
from the variant a call with that config really launched on this GPU (its
layout, epilogue and vector width included).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time

from kernels_core import contract

from . import _runtime as rt
from . import elementwise, fused, loss, optim, reduction
# The package re-exports the function `matmul`, so the module's name is taken directly.
from .matmul import report_variant as _matmul_variant

_VARIANT_OF = {"matmul": _matmul_variant, "relu": elementwise.report_variant,
               "relu_backward": elementwise.report_variant, "bias_add": elementwise.report_variant,
               "bias_grad": reduction.report_variant, "softmax_cross_entropy": loss.report_variant,
               "sgd_update": optim.report_variant, "linear_cross_entropy": fused.report_variant,
               "linear_sgd": fused.report_variant}


def _report_variant(op: str, dtype: str, config, arch: int) -> tuple[rt.Variant, int]:
    from . import space

    cfg = space(op, dtype).resolve(config, contract.DTYPES[dtype].itemsize, arch)
    return _VARIANT_OF[op](op, dtype, cfg, arch)


def compile_reports(op: str, dtype: str, configs, arch: int) -> list[dict]:
    """Builds every config's variant with nvcc in one call per source file and
    returns ptxas's numbers per config. All configs are checked against the
    space before anything is compiled."""
    built = [_report_variant(op, dtype, c, arch) for c in configs]
    return compile_variants([v for v, _ in built], [s for _, s in built], arch)


def compile_report(op: str, dtype: str, config=None, arch: int = 90) -> dict:
    return compile_reports(op, dtype, [config], arch)[0]


def resource_report(op: str, dtype: str, config=None) -> dict | None:
    """Resources of the kernel the last call of `op` with this config launched on this GPU
    (its layout, epilogue and vector width included), or None before any such call."""
    import torch

    from . import space

    arch, _ = rt.device_props(torch.cuda.current_device())
    cfg = space(op, dtype).resolve(config, contract.DTYPES[dtype].itemsize, arch)
    return rt.resource_report(rt.tag(op, dtype, cfg))


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)a?'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_MANGLED = re.compile(r"_Z(\d+)")
_INT_ARG = re.compile(r"L[a-z](n?\d+)E")


def _name_expr(mangled: str) -> str:
    """`_Z20relu_backward_kernelILi2ELi4ELi4ELi128EEvPK...` -> `relu_backward_kernel<2,4,4,128>`.

    Read off the Itanium mangling itself rather than through a demangler: every kernel here is a
    function template of integer arguments, each mangled `L<type><value>E` (`n` for a minus), and
    c++filt / cu++filt differ between machines in how they print them (the H200's image gave
    names nothing here matched) or are missing."""
    m = _MANGLED.match(mangled)
    if m is None:
        return mangled
    length, at = int(m.group(1)), m.end()
    name, rest = mangled[at:at + length], mangled[at + length:]
    if not rest.startswith("I"):
        return name
    args, pos = [], 1
    while (arg := _INT_ARG.match(rest, pos)) is not None:
        args.append(arg.group(1).replace("n", "-"))
        pos = arg.end()
    return f"{name}<{','.join(args)}>"


def compile_variants(variants: list[rt.Variant], dynamic_smem: list[int], arch: int) -> list[dict]:
    """Compiles many variants in one nvcc call (one translation unit per
    source file) and returns, per variant, the ptxas resource numbers."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH: offline compile reports need the CUDA toolkit")
    by_source: dict[str, list[int]] = {}
    for i, v in enumerate(variants):
        by_source.setdefault(v.source, []).append(i)
    results: list[dict | None] = [None] * len(variants)
    for src, idx in by_source.items():
        unique = list(dict.fromkeys(variants[i].name_expr for i in idx))
        refs = ",\n    ".join(f"(void*)&{e}" for e in unique)
        tu = f'#include "{src}"\n\n// Taking the addresses instantiates the kernels.\nvoid* const kernel_refs[] = {{\n    {refs}\n}};\n'
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "variants.cu")
            with open(path, "w") as f:
                f.write(tu)
            t0 = time.perf_counter()
            sm = f"{arch}{variants[idx[0]].sm_suffix}"  # one source, one target (matmul_wgmma.cu: sm_90a)
            proc = subprocess.run(
                [nvcc, "-std=c++17", "-cubin", f"-gencode=arch=compute_{sm},code=sm_{sm}", "--resource-usage",
                 f"-I{rt.HERE}",
                 "-o", os.path.join(tmp, "variants.cubin"), path],
                capture_output=True, text=True)
            seconds = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {src} on sm_{arch}:\n{log[-4000:]}")
        parsed = _parse_ptxas(log)
        per = seconds / len(unique)
        for i in idx:
            info = parsed.get(variants[i].name_expr)
            if info is None:
                raise RuntimeError(f"no ptxas report for {variants[i].name_expr} on sm_{arch}:\n{log[-4000:]}")
            results[i] = {
                "registers": info["registers"],
                "smem_bytes": info["static_smem"] + dynamic_smem[i],
                "spill_bytes": info["spill_bytes"],
                "compile_s": per,
            }
    return results  # type: ignore[return-value]


def _parse_ptxas(log: str) -> dict[str, dict]:
    blocks: list[tuple[str, list[str]]] = []
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            blocks.append((m.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
    names = [_name_expr(b[0]) for b in blocks]
    out = {}
    for expr, (_, lines) in zip(names, blocks):
        text = "\n".join(lines)
        spill = _PTXAS_SPILL.search(text)
        used = _PTXAS_USED.search(text)
        smem = _PTXAS_SMEM.search(text)
        out[expr] = {
            "registers": int(used.group(1)) if used else 0,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else 0,
            "static_smem": int(smem.group(1)) if smem else 0,
        }
    return out
