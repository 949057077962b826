"""Which module implements a backend name.

The two twins are built in; more (a test backend, an experiment) are added
without code changes through AUTOTUNE_BACKENDS="name=module,name2=module2",
which worker subprocesses inherit.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

from kernels_core.space import Space

BUILTIN = {"cuda": "kernels_cuda", "triton": "kernels_triton"}


class BackendError(RuntimeError):
    pass


def registry() -> dict[str, str]:
    names = dict(BUILTIN)
    for item in filter(None, (s.strip() for s in os.environ.get("AUTOTUNE_BACKENDS", "").split(","))):
        name, sep, module = item.partition("=")
        if not sep or not name.strip() or not module.strip():
            raise BackendError(f"AUTOTUNE_BACKENDS: {item!r} is not name=module")
        names[name.strip()] = module.strip()
    return names


def load(name: str) -> ModuleType:
    names = registry()
    if name not in names:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(names)} "
                           "(add one with AUTOTUNE_BACKENDS=name=module)")
    try:
        return importlib.import_module(names[name])
    except Exception as exc:  # any import failure makes the backend unusable; say why
        raise BackendError(f"backend {name!r} (module {names[name]}) failed to import: "
                           f"{type(exc).__name__}: {exc}") from exc


def space(backend: str, op: str, dtype: str) -> Space:
    return load(backend).space(op, dtype)
