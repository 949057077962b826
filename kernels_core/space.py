"""A kernel's tunables as data: the values to try, the rules that prune, the costs.

In the style of Kernel Tuner: a dict of lists of tunable values, plus
restrictions written as Python expressions over those names. Two more
expressions say what a config costs the hardware (threads per block, shared
memory bytes per block); the tuner checks them against a target's limits, the
kernels check them against the local GPU at launch (and the CUDA twin takes the
dynamic shared memory it asks for from the same expression). Expressions may
also use `elt` (bytes per input element) and `arch` (the compute capability as
an integer, 75 for sm_75).

Some tunables choose the arithmetic, not only its schedule: an fp32 matmul may
multiply on TF32 tensor cores. A space says which of its values compute below
the dtype's own precision (`lower_precision`: the tuner tries them only when
asked, and judges them at that precision) and which reach the dtype's
precision by lower-precision arithmetic (`emulated`: the tuner admits them
only where their error is at most the default config's on the same inputs).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Mapping


@dataclass(frozen=True)
class Space:
    """Tunables of one kernel as data: values to try, rules that prune, costs."""

    params: Mapping[str, tuple[int, ...]]
    default: Mapping[str, int]
    restrictions: tuple[str, ...] = ()
    threads: str = "32 * num_warps"
    smem_bytes: str = "0"
    notes: str = ""
    # Defaults for older GPUs, as overrides of `default`: {80: {...}} applies below sm_80.
    defaults_below: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    # Values computing below the dtype's precision, with that precision's name: {"TF32": {1: "tf32"}}.
    lower_precision: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    # Values that emulate the dtype's precision with lower-precision arithmetic: {"TF32": (3,)}.
    emulated: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # Tunables whose values pick another kernel or code path ("TF32", "WGMMA"): the tuner's first
    # draws of a study try each combination of them with few valid configs (the CUDA fp32 wgmma
    # kernel's 22 of 9,386 at sm_90), which drawing configs alike would leave out of a search.
    families: tuple[str, ...] = ()
    # Tunables that split one off another, each with the one whose value it takes where a config
    # lacks it ({"BR0": "BR"}): a config written before such a tunable existed ran it at that value,
    # not at a constant default.
    inherits: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        # Launch paths check their config on every call: compile the rules once and
        # remember verdicts, so a check costs a dict lookup, not a dozen evals.
        # A rule may say why after a `#` ("arch >= 80  # bf16 tensor cores start at sm_80"): the
        # reason is part of the message of every config it rejects.
        rules = [(rule.partition("#")[0].strip(), rule.partition("#")[2].strip()) for rule in self.restrictions]
        object.__setattr__(self, "_rules", tuple((expr, why, compile(expr, expr, "eval")) for expr, why in rules))
        object.__setattr__(self, "_cost_code", (compile(self.threads, "threads", "eval"),
                                                compile(self.smem_bytes, "smem_bytes", "eval")))
        object.__setattr__(self, "_verdicts", {})
        object.__setattr__(self, "_costs", {})
        object.__setattr__(self, "_valid", {})  # (elt, arch) -> configs(): the walk, once per space
        if set(self.default) != set(self.params):
            raise ValueError(f"default {dict(self.default)} must set exactly {sorted(self.params)}")
        for overrides in (self.default, *self.defaults_below.values()):
            for name, value in overrides.items():
                if value not in self.params.get(name, ()):
                    raise ValueError(f"default {name}={value} is outside the space {dict(self.params)}")
        if self.precision_of(self.default) or self.is_emulated(self.default):
            raise ValueError(f"default {dict(self.default)} must compute at the dtype's own precision")
        if not set(self.families) <= set(self.params):
            raise ValueError(f"families {list(self.families)} must be tunables of the space {sorted(self.params)}")
        for name, source in self.inherits.items():
            if {name, source} - set(self.params) or self.default[name] != self.default[source]:
                raise ValueError(f"inherits: {name} from {source} needs both in the space, with one default")
        for name, values in (*self.lower_precision.items(), *self.emulated.items()):
            if not set(values) <= set(self.params.get(name, ())):
                raise ValueError(f"{name}: precision values {sorted(values)} are outside the space {dict(self.params)}")

    def precision_of(self, config: Mapping[str, int]) -> str | None:
        """The lower precision `config` computes at (its first value that names one), or None."""
        for name, values in self.lower_precision.items():
            if config.get(name) in values:
                return values[config[name]]
        return None

    def is_emulated(self, config: Mapping[str, int]) -> bool:
        """Whether `config` reaches the dtype's precision through lower-precision arithmetic."""
        return any(config.get(name) in values for name, values in self.emulated.items())

    def _env(self, config: Mapping[str, int], elt: int, arch: int) -> dict:
        return {**config, "elt": elt, "arch": arch}

    @staticmethod
    def _key(config: Mapping[str, int], elt: int, arch: int) -> tuple:
        # The type is part of the key: True == 1 and 1.0 == 1, but neither is a valid tunable.
        return tuple(sorted((k, type(v), v) for k, v in config.items())), elt, arch

    def cost(self, config: Mapping[str, int], elt: int, arch: int = 90) -> dict[str, int]:
        key = self._key(config, elt, arch)
        if key not in self._costs:
            env = self._env(config, elt, arch)
            threads, smem = (int(eval(code, {}, env)) for code in self._cost_code)
            self._costs[key] = {"threads": threads, "smem_bytes": smem}
        return dict(self._costs[key])

    def violated(self, config: Mapping[str, int], elt: int, arch: int = 90) -> str | None:
        """The first rule the config breaks, or None. Never raises."""
        try:
            key = self._key(config, elt, arch)
            return self._verdicts[key]
        except TypeError:  # unhashable values: judged below, never remembered
            return self._judge(config, elt, arch)
        except KeyError:
            verdict = self._verdicts[key] = self._judge(config, elt, arch)
            return verdict

    def _judge(self, config: Mapping[str, int], elt: int, arch: int) -> str | None:
        unknown = set(config) - set(self.params)
        if unknown:
            return f"unknown tunable(s) {sorted(unknown)}; known: {sorted(self.params)}"
        for name, values in self.params.items():
            if name not in config:
                return f"missing tunable {name}"
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{name}={value!r} is not an integer"
            if value not in values:
                return f"{name}={value} is outside the space {list(values)}"
        env = self._env(config, elt, arch)
        for rule, why, code in self._rules:
            if not eval(code, {}, env):
                return f"restriction `{rule}` fails" + (f": {why}" if why else "")
        return None

    def check(self, config: Mapping[str, int], elt: int, arch: int = 90) -> dict[str, int]:
        problem = self.violated(config, elt, arch)
        if problem:
            raise ValueError(f"config: {problem} (config={dict(config)})")
        return dict(config)

    def with_defaults(self, config: Mapping[str, int]) -> dict[str, int]:
        """`config` with every tunable it lacks at the space's default: a config written before a
        tunable existed (in a store, in a study) ran what that default runs (a new tunable's
        default is the kernel as it was: TF32 = 0, say), or, for a tunable split off another
        (`inherits`), at that one's value."""
        return self._inherit({**{k: v for k, v in self.default.items() if k not in config}, **config}, config)

    def _inherit(self, filled: dict[str, int], given: Mapping[str, int]) -> dict[str, int]:
        for name, source in self.inherits.items():
            if name not in given and source in filled:
                filled[name] = filled[source]
        return filled

    def default_for(self, arch: int) -> dict[str, int]:
        """The config a kernel runs when given none, on a GPU of this arch."""
        base = dict(self.default)
        for below, overrides in sorted(self.defaults_below.items(), reverse=True):
            if arch < below:
                base.update(overrides)
        return base

    def resolve(self, config: Mapping[str, int] | None, elt: int, arch: int = 90) -> dict[str, int]:
        """The arch's default updated with the user's values, then checked."""
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config: expected a dict of tunables or None, got {type(config).__name__}")
        return self.check(self._inherit({**self.default_for(arch), **(config or {})}, config or {}), elt, arch)

    def size(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n

    def configs(self, elt: int, arch: int = 90) -> Iterator[dict[str, int]]:
        """Every config that passes the restrictions, in the order of the product of the params.

        Found depth first, a tunable at a time, the tunables that most rules name first: a rule is
        judged as soon as the values chosen so far decide it (a rule that needs a tunable not yet
        chosen raises NameError, and waits), so a subtree one rule refuses is never walked. A space
        whose rules hold for one kernel or another (`not (TF32 == 0) or ...`) is then walked kernel
        by kernel, not over the product of both kernels' tunables. The walk runs once per (elt, arch):
        a search opens a study per call, and a benchmark looks configs up per case, of one space."""
        if (elt, arch) not in self._valid:
            self._valid[elt, arch] = self._walk(elt, arch)
        for config in self._valid[elt, arch]:
            yield dict(config)

    def _walk(self, elt: int, arch: int) -> list[dict[str, int]]:
        names = list(self.params)
        rules = [code for _, _, code in self._rules]
        named = [sum(name in code.co_names for code in rules) for name in names]
        order = sorted(range(len(names)), key=lambda i: -named[i])
        found = []

        def walk(depth: int, env: dict, pending: list) -> None:
            if depth == len(order):  # a rule still waiting names something no tunable is: let it raise
                if all(eval(code, {}, env) for code in pending):
                    found.append(dict(env))
                return
            name = names[order[depth]]
            for value in self.params[name]:
                env[name] = value
                left = []
                for code in pending:
                    try:
                        if not eval(code, {}, env):
                            break
                    except NameError:
                        left.append(code)
                else:
                    walk(depth + 1, env, left)
            del env[name]

        walk(0, {"elt": elt, "arch": arch}, rules)
        index = {name: {v: i for i, v in enumerate(values)} for name, values in self.params.items()}
        found.sort(key=lambda c: [index[n][c[n]] for n in names])
        return [{n: config[n] for n in names} for config in found]
