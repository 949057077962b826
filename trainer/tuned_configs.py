"""Which kernel config each call of the step uses, and where it came from.

The tuner stores winning configs per (op, backend, dtype, shape key) for a
target GPU. A run uses `--tuned-configs`, else the tuner's <out>/<target>/best.json,
else the store shipped for its GPU (kernels_core.store.choose_store), and says
which in one line. The trainer asks the store for the exact shape of every call it
makes and takes what comes back: the tuned config, the nearest tuned shape's,
or the op's default. Every choice is recorded, so the run can print (and
save) a table of them before training starts.

A config file that fails the store's validation is refused: running on
silently different kernels would make the numbers lie. `--allow-default-configs`
turns the refusal into a warning and a run on defaults.
"""
from __future__ import annotations

import sys
from pathlib import Path

from kernels_core.shapes import parse_shape_key
from kernels_core.store import ConfigStore, StoreChoice, StoreError, choose_store, load_store
from kernels_core.targets import local_gpu
from kernels_core.contract import FUSED_OPS, check_block_holds_row
from kernels_core.space import Space
from trainer.config import Config


class ConfigStoreRefused(RuntimeError):
    """The config store file is invalid and defaults were not allowed."""


def target_name(target: str) -> str:
    """"auto" is the local GPU's target, or "cpu" (the Triton interpreter) without one."""
    if target != "auto":
        return target
    local = local_gpu()
    return local[0] if local else "cpu"


def run_store(config: Config) -> StoreChoice:
    """`--tuned-configs` ("none": defaults), else kernels_core.store.choose_store's: the tuner's
    <out>/<target>/best.json, else the store shipped for this GPU."""
    if config.tuned_configs == "none":
        return StoreChoice(None, "none", "configs: defaults (--tuned-configs none)")
    if config.tuned_configs is not None:
        path = Path(config.tuned_configs)
        return StoreChoice(path, "given", f"configs: {path} (--tuned-configs)")
    local = local_gpu()
    return choose_store(config.out, target_name(config.target), local[1] if local else None)


def open_store(config: Config) -> tuple[ConfigStore | None, str]:
    """(the validated store the run uses or None for defaults everywhere, where it came from: "none",
    or the choice's kind and path), its choice printed as one line."""
    try:
        choice = run_store(config)
    except StoreError as e:  # a shipped store that cannot be read
        return _refused(config, e), "none"
    print(choice.note, file=sys.stderr)
    if choice.path is None:
        return None, "none"
    try:
        local = local_gpu()
        if local and target_name(config.target) != local[0]:
            # Configs are checked against their target's limits: another GPU's may not fit this one.
            raise StoreError(f"--target {config.target} is not this GPU ({local[0]}); its configs may not "
                             f"run here. Use --target auto, or tune for {local[0]}")
        return load_store(choice.path, target_name(config.target)), f"{choice.kind}: {choice.path}"
    except (StoreError, OSError) as e:
        return _refused(config, e), "none"


def _refused(config: Config, e: Exception) -> None:
    if not config.allow_default_configs:
        raise ConfigStoreRefused(
            f"config store refused: {e}\n"
            "(fix or re-tune it, or pass --allow-default-configs to run on default configs)"
        ) from e
    print(f"warning: config store refused: {e}; "
          "running on default configs (--allow-default-configs)", file=sys.stderr)
    return None


def as_fused(op: str, key: str, matmul_config: dict, space: Space, elt: int, arch: int) -> dict | None:
    """A matmul config as fused `op` runs it on the GEMM `key`: tunables outside the op's space
    take the op's default value; None if the result is still invalid there."""
    default = space.default_for(arch)
    config = {name: v if (v := matmul_config.get(name)) in space.params[name] else default[name]
              for name in space.params}
    if space.violated(config, elt, arch):
        return None
    if op == "linear_cross_entropy":
        try:
            check_block_holds_row(config, parse_shape_key(key)[0][1])
        except ValueError:
            return None
    return config


class CallConfigs:
    """Config per (op, shape key), looked up once and remembered for the table.

    A fused op (linear_cross_entropy, linear_sgd) is a GEMM with another
    epilogue: where the store has no config of its own for the call, it runs
    on the tuned matmul config of the same GEMM (source "matmul:<source>"),
    each tunable the fused op's space lacks set to the op's default value
    (linear_sgd has SPLIT_K = 1 only), provided the result is valid there.
    """

    def __init__(self, store, backend: str, dtype: str, default_of=None, valid_for=None, origin: str = "none",
                 precision_of=None):
        self.store, self.backend, self.dtype = store, backend, dtype
        self.origin = origin  # where the store came from: "none", or "<kind>: <path>" (open_store)
        self._default_of = default_of  # op -> the config the kernel uses when given None
        self._valid_for = valid_for  # (op, key, config) -> the config as the op's space allows it, or None
        self._precision_of = precision_of  # (op, config) -> the lower precision it computes at, or None
        self.chosen: dict[tuple[str, str], tuple[dict | None, str]] = {}

    def get(self, op: str, key: str) -> dict | None:
        if (op, key) not in self.chosen:
            found = self.store.lookup(op, self.backend, self.dtype, key) if self.store else (None, "default")
            if found[0] is None and op in FUSED_OPS and self.store and self._valid_for:
                borrowed, source = self.store.lookup("matmul", self.backend, self.dtype, key)
                borrowed = self._valid_for(op, key, borrowed) if borrowed is not None else None
                if borrowed is not None:
                    found = (borrowed, f"matmul:{source}")
            self.chosen[(op, key)] = found
            lower = self._precision_of(op, found[0]) if self._precision_of and found[0] is not None else None
            if lower:  # a store tuned with --lower-precision: said once per call, as it runs
                print(f"warning: {op} {key} runs a config of the store that computes in {lower}, below "
                      f"{self.dtype}: {' '.join(f'{k}={v}' for k, v in sorted(found[0].items()))}", file=sys.stderr)
        return self.chosen[(op, key)][0]

    def sources(self) -> str:
        """One word for the summary: tuned, nearest, default, matmul or mixed."""
        kinds = {source.split(":")[0] for _, source in self.chosen.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def table(self) -> str:
        rows = [("op", "shape", "source", "config")]
        for (op, key), (cfg, source) in self.chosen.items():
            if cfg is None and self._default_of is not None:
                cfg = self._default_of(op)
            rows.append((op, key, source, "-" if cfg is None else " ".join(f"{k}={v}" for k, v in sorted(cfg.items()))))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)
