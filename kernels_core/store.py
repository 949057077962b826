"""Tuned configs as data: best.json, read strictly, looked up by shape, written atomically.

A store file holds the winners of one target:

    {"target": "sm_90", "format": 1, "entries": [
        {"op": "matmul", "backend": "triton", "dtype": "fp16", "shape": "128x1024x784:nn",
         "config": {"BLOCK_M": 64, ...}, "time_ms": 0.012, ...}, ...]}

Everything is validated on load, before a config can reach a compiler: a bad
file raises StoreError naming the file, the entry and the problem.

Stores of the GPUs the lab tuned ship with the package (kernels_core/tuned/<gpu>.json; each
entry's provenance names the machine that timed it). `choose_store` says which store a run
uses: the user's own, else the one shipped for their GPU, else one shipped for another GPU of
the same target (with a warning), else none (default configs).
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from kernels_core import backends
from kernels_core.targets import TARGETS, Target, local_gpu
from kernels_core.shapes import FUSED_LAYOUT, LAYOUTS, OP_RANK, parse_shape_key
from kernels_core.contract import DTYPES, TUNED_OPS
from kernels_core.space import Space

FORMAT = 1
TOP_KEYS = {"target", "format", "entries"}
REQUIRED = ("op", "backend", "dtype", "shape", "config")
OPTIONAL = {
    "time_ms": float, "time_p20_ms": float, "time_p80_ms": float, "default_ms": float, "torch_ms": float,
    "speedup_vs_default": float, "speedup_vs_torch": float, "trials": int, "failures": dict,
    "study": str, "trial": int, "provenance": dict,
}

Key = tuple[str, str, str, str]  # op, backend, dtype, shape key
SHIPPED = Path(__file__).resolve().parent / "tuned"
TUNE = "python -m autotune.search"


class StoreError(ValueError):
    pass


def store_path(out, target: str) -> Path:
    """Where the tuner writes, and the trainer looks for, a target's winners: <out>/<target>/best.json."""
    return Path(out) / target / "best.json"


@dataclass(frozen=True)
class StoreChoice:
    """The store a run uses (None: default configs) and the line that tells the user which."""

    path: Path | None
    kind: str  # "yours", "given" (--tuned-configs), "shipped", "none"
    note: str

    @property
    def warning(self) -> bool:
        """A store shipped for another GPU: its configs run here but were timed elsewhere."""
        return self.note.startswith("warning:")


def tuned_on(data: dict) -> str | None:
    """The device that timed most of a store's entries (their provenance), or None if none says."""
    devices = Counter(e.get("provenance", {}).get("device") for e in data.get("entries", []) if isinstance(e, dict))
    devices.pop(None, None)
    return devices.most_common(1)[0][0] if devices else None


def choose_store(out, target: str, device: str | None) -> StoreChoice:
    """Which store a run for `target` on the GPU named `device` (None: no GPU) uses, in order:
    <out>/<target>/best.json, the store shipped for `device`, a store shipped for another GPU of
    `target` (its configs fit the target's limits but were timed elsewhere: a warning), none."""
    own = store_path(out, target)
    if own.exists():
        return StoreChoice(own, "yours", f"configs: {own} (tuned here)")
    others = []
    for path in sorted(SHIPPED.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path}: the shipped store cannot be read: {exc}") from None
        if data.get("target") != target:
            continue
        tuned = tuned_on(data)
        if device is not None and tuned == device:
            return StoreChoice(path, "shipped", f"configs: {path}, shipped for {device} (no {own}: {TUNE} "
                                                "writes it)")
        others.append((path, tuned))
    if device is not None and others:
        path, other = others[0]
        return StoreChoice(path, "shipped", f"warning: no store is shipped for {device}: using {path}, tuned on "
                                            f"{other}, another {target} GPU, whose configs run here but may not be "
                                            f"the fastest ({TUNE} tunes them for this one)")
    return StoreChoice(None, "none", f"configs: defaults (no {own}, and no store is shipped for "
                                     f"{device or target}: {TUNE} writes one)")


def choose_local_store(out) -> StoreChoice:
    """choose_store for this machine's GPU (the cpu target without one)."""
    local = local_gpu()
    return choose_store(out, local[0] if local else "cpu", local[1] if local else None)


class ConfigStore:
    def __init__(self, target: str, entries: Mapping[Key, dict] | None = None):
        self.target = target
        self.entries: dict[Key, dict] = dict(entries or {})

    def lookup(self, op: str, backend: str, dtype: str, shape: str) -> tuple[dict | None, str]:
        """(config, source): source is "tuned", "nearest:<shape>" or "default" (config None)."""
        entry = self.entries.get((op, backend, dtype, shape))
        if entry is not None:
            return dict(entry["config"]), "tuned"
        dims, layout = parse_shape_key(shape)
        best = None
        for (o, b, d, s), candidate in sorted(self.entries.items()):
            if (o, b, d) != (op, backend, dtype):
                continue
            other, other_layout = parse_shape_key(s)
            if other_layout != layout or len(other) != len(dims):
                continue
            distance = sum((math.log(x) - math.log(y)) ** 2 for x, y in zip(dims, other))
            if best is None or distance < best[0]:
                best = (distance, s, candidate)
        if best is None:
            return None, "default"
        return dict(best[2]["config"]), f"nearest:{best[1]}"

    def put(self, entry: dict) -> None:
        self.entries[(entry["op"], entry["backend"], entry["dtype"], entry["shape"])] = dict(entry)

    def merge(self, other: "ConfigStore") -> "ConfigStore":
        """A new store: this one's entries, replaced by `other`'s where both have one."""
        if other.target != self.target:
            raise StoreError(f"cannot merge a {other.target} store into a {self.target} store")
        return ConfigStore(self.target, {**self.entries, **other.entries})

    def to_json(self) -> dict:
        return {"target": self.target, "format": FORMAT,
                "entries": [self.entries[k] for k in sorted(self.entries)]}


def _target_name(target: str | Target) -> str:
    return target.name if isinstance(target, Target) else target


def load_store(path, target: str | Target, *,
               space_of: Callable[[str, str, str], Space] = backends.space) -> ConfigStore:
    """Read and validate `path`; raises StoreError on any problem."""
    path = Path(path)
    target = _target_name(target)
    if target not in TARGETS:
        raise StoreError(f"{path}: target {target!r} is unknown; known: {', '.join(TARGETS)}")
    try:
        data = json.loads(path.read_text(), parse_constant=_reject_constant)
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise StoreError(f"{path}: not valid JSON: {exc}") from None
    except RecursionError:
        raise StoreError(f"{path}: not a config store: its JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object with keys {sorted(TOP_KEYS)}")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise StoreError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    if data.get("target") != target:
        raise StoreError(f"{path}: written for target {data.get('target')!r}, but this run targets {target!r}")
    if data.get("format", FORMAT) != FORMAT:
        raise StoreError(f"{path}: format {data.get('format')!r}; this tuner reads format {FORMAT}")
    if not isinstance(data.get("entries"), list):
        raise StoreError(f"{path}: 'entries' must be a list")
    store = ConfigStore(target)
    for i, entry in enumerate(data["entries"]):
        where = f"{path}: entry {i}"
        if isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in REQUIRED[:4]):
            where += " (" + ":".join(entry[k] for k in REQUIRED[:4]) + ")"
        problem = _entry_problem(entry, TARGETS[target], space_of)
        if problem:
            raise StoreError(f"{where}: {problem}")
        space = space_of(entry["backend"], entry["op"], entry["dtype"])
        entry = {**entry, "config": space.with_defaults(entry["config"])}
        key = tuple(entry[k] for k in REQUIRED[:4])
        if key in store.entries:
            raise StoreError(f"{where}: a second entry for the same op, backend, dtype and shape")
        store.put(entry)
    return store


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _entry_problem(entry, target: Target, space_of) -> str | None:
    if not isinstance(entry, dict):
        return "expected a JSON object"
    unknown = set(entry) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        return f"unknown key(s) {sorted(unknown)}; allowed: {sorted(set(REQUIRED) | set(OPTIONAL))}"
    missing = [k for k in REQUIRED if k not in entry]
    if missing:
        return f"missing key(s) {missing}"
    op, backend, dtype, shape, config = (entry[k] for k in REQUIRED)
    if op not in TUNED_OPS:
        return f"unknown op {op!r}; known: {', '.join(TUNED_OPS)}"
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}"
    try:
        known_backends = backends.registry()
    except backends.BackendError as exc:
        return str(exc)
    if backend not in known_backends:
        return f"unknown backend {backend!r}; known: {', '.join(known_backends)}"
    try:
        dims, layout = parse_shape_key(shape) if isinstance(shape, str) else ((), "")
    except ValueError as exc:
        return str(exc)
    if len(dims) != OP_RANK[op]:
        return f"shape {shape!r}: {op} shapes have {OP_RANK[op]} dimension(s)"
    if op in FUSED_LAYOUT:
        if layout != FUSED_LAYOUT[op]:
            return f"shape {shape!r}: {op}'s shapes have layout {FUSED_LAYOUT[op]!r}"
    elif (layout not in LAYOUTS) if op == "matmul" else layout:
        return f"shape {shape!r}: layout must be one of {LAYOUTS} for matmul, absent otherwise"
    for name, kind in OPTIONAL.items():
        value = entry.get(name)
        if value is None:
            continue
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else (
            isinstance(value, kind) and not isinstance(value, bool))
        if not ok:
            return f"{name}={value!r} is not a {kind.__name__}"
    if not isinstance(config, dict):
        return f"config must be an object of integer tunables, got {type(config).__name__}"
    for name, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int):
            return f"config: {name}={value!r} is not an integer"
    try:
        space = space_of(backend, op, dtype)
    except Exception as exc:  # a backend that cannot say its space cannot vouch for the config
        return f"cannot get the {backend} space of {op} {dtype}: {type(exc).__name__}: {exc}"
    problem = target.target_violation(space, space.with_defaults(config), DTYPES[dtype].itemsize)
    return f"config {config}: {problem}" if problem else None


@contextmanager
def temp_beside(path: Path) -> Iterator[tuple]:
    """(binary file, its path): a new file next to `path`, for the caller to fill and rename
    over it. Created with the umask's permissions, as `path` itself would be (mkstemp's are
    0600); removed if the caller did not move it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f, tmp
    finally:
        tmp.unlink(missing_ok=True)


def save_store(path, store: ConfigStore) -> None:
    """Write atomically: readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with temp_beside(path) as (f, tmp):
        f.write((json.dumps(store.to_json(), indent=1, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)


def merge_into_store(path, target: str | Target, entries: Iterable[dict], *, lock) -> None:
    """Put `entries` into the store at `path` (a new one if there is none), each replacing the
    entry of its op, backend, dtype and shape. Read, merged and written under an exclusive flock on
    the file `lock`: two processes on this host merging at once would otherwise both read the old
    file, and the later rename would drop the other's entries."""
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        store = load_store(path, target) if Path(path).exists() else ConfigStore(_target_name(target))
        for entry in entries:
            store.put(entry)
        save_store(path, store)
