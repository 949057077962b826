"""Everything a run depends on, in one dataclass (nanoGPT style).

The defaults are the default protocol (kernels_core/mlp.py): 784-1024-1024-10
for 10 epochs at batch 128 with SGD (lr 0.05, momentum 0.9). With the torch
backend on a CPU (seed 0) that run passed 98% test accuracy after epoch 4 and
ended at 98.50%, leaving margin for the other backends, which compute the same
step in other roundings.

`PRESETS` are the other protocols as bundles of overrides; a preset is applied
first and flags given explicitly on the command line win over it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from kernels_core.backends import BUILTIN
from kernels_core.cli import OneLineParser, whole_number
from kernels_core.contract import MAX_DIM
from kernels_core.dependent_launch import MODES as DEPENDENT_MODES
from kernels_core.mlp import DEFAULT, PROTOCOLS
from kernels_core.targets import TARGETS
from trainer.data import DEFAULT_DIR, SPECS

BACKENDS = ("torch", *BUILTIN)  # the PyTorch baseline and the kernel twins
FP32_TINY, FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max  # smallest normal, largest
MOMENTUM_BELOW = 1 - 2**-25  # fp32 rounds this and anything above it to 1: no decay
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest
PERSISTENT_MODES = ("on", "auto")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor captures its own CUDA graphs


@dataclass
class Config:
    backend: str = "torch"
    hidden: int = DEFAULT.hidden
    layers: int = DEFAULT.layers  # hidden layers; the net has layers + 1 matmuls
    batch_size: int = DEFAULT.batch_size
    epochs: int = 10
    steps: int | None = None  # overrides epochs: train exactly this many steps
    lr: float = DEFAULT.lr
    momentum: float = DEFAULT.momentum
    weight_decay: float = 0.0
    dtype: str = DEFAULT.dtype  # fp16/bf16: low-precision matmuls, fp32 master weights
    seed: int = 0
    tuned_configs: str | None = None  # store for cuda/triton; None: <out>/<target>/best.json if it exists; "none": defaults
    target: str = "auto"
    allow_default_configs: bool = False
    data_dir: str = str(DEFAULT_DIR)
    train_subset: int = 0  # > 0: train on the first N images only (quick runs)
    out: str = "experiments"
    graph: bool = True  # cuda/triton: capture the whole step in one CUDA graph
    fuse: bool = True  # cuda/triton: the fused step (loss, ReLU backward, bias grad, SGD in GEMM epilogues)
    pdl: str | None = None  # cuda/triton, sm_90+: the step's GEMMs as programmatic dependent launches, early or exit
    persistent: str | None = None  # cuda/triton: "on", each segment of steps in one launch of the persistent
    # training kernel; "auto", that where the model's state fits the GPU's L2, the fused step elsewhere
    compile: str | None = None  # torch backend: torch.compile mode for the model with its loss and the SGD step
    torch_graph: bool = False  # torch backend: whole-step CUDA graph (data gather included)
    tf32: bool = False  # torch backend, fp32: matmuls on TF32 tensor cores (allow_tf32), a lower precision
    eval_every: int = 0  # steps between test evaluations; 0: end of each epoch
    progress: bool = True

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"--dtype {self.dtype!r} is not one of fp32, fp16, bf16")
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise ValueError(f"--compile {self.compile!r} is not one of {', '.join(COMPILE_MODES)}")
        if self.compile in CUDAGRAPH_MODES and self.torch_graph:
            raise ValueError(f"--compile {self.compile} already uses CUDA graphs; drop --torch-graph")
        if (self.compile or self.torch_graph) and self.backend != "torch":
            raise ValueError("--compile and --torch-graph apply to the torch backend only")
        if self.tf32 and (self.backend != "torch" or self.dtype != "fp32"):
            raise ValueError("--tf32 applies to fp32 runs of the torch backend (the cuda and triton backends take "
                             "TF32 from their configs' TF32 tunable)")
        if not self.fuse and self.backend == "torch":
            raise ValueError("--no-fuse applies to the cuda and triton backends only")
        if self.pdl is not None and self.pdl not in DEPENDENT_MODES:
            raise ValueError(f"--pdl {self.pdl!r} is not one of {', '.join(DEPENDENT_MODES)}")
        if self.pdl and self.backend == "torch":
            raise ValueError("--pdl applies to the cuda and triton backends only")
        if self.persistent not in (None, *PERSISTENT_MODES):
            raise ValueError(f"--persistent {self.persistent!r} is not one of {', '.join(PERSISTENT_MODES)}")
        if self.persistent and self.backend == "torch":
            raise ValueError("--persistent applies to the cuda and triton backends only")
        if self.persistent and (self.pdl or not self.fuse):
            raise ValueError("--persistent runs whole steps in one kernel; --pdl and --no-fuse choose among the "
                             "step's kernels, which it does not launch")
        if not self.graph and self.backend == "torch":
            raise ValueError("--no-graph applies to the cuda and triton backends only (the torch backend's "
                             "step is graphed by --torch-graph)")
        if self.torch_graph and not _has_gpu():
            raise ValueError("--torch-graph captures the step in a CUDA graph, which needs a GPU; there is none here")
        if not self.out.strip():
            raise ValueError(f"--out must name a folder, got {self.out!r}")
        for name in ("hidden", "batch_size"):
            if not 1 <= getattr(self, name) <= MAX_DIM:
                raise ValueError(f"{_flag(name)} must be from 1 to {MAX_DIM}, got {getattr(self, name)}")
        if self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.steps is None and self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: each epoch's end), got {self.eval_every}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed must be a whole number from 0 to 2**64 - 1, got {self.seed}")
        # Checked here, once, for every backend: torch.optim.SGD lets NaN through and raises on a
        # negative lr, the kernel backends would train on anything, and both apply the values in
        # fp32: torch refuses one past fp32's largest (with a traceback from deep in the step), and
        # one below its smallest normal is 0 or loses its precision. NaN fails every comparison.
        fp32 = "fp32's normal range: the step applies it in fp32"
        if not FP32_TINY <= self.lr <= FP32_MAX:
            raise ValueError(f"--lr must be from {FP32_TINY:.3g} to {FP32_MAX:.3g} ({fp32}), got {self.lr}")
        if not (self.momentum == 0 or FP32_TINY <= self.momentum < MOMENTUM_BELOW):
            raise ValueError(f"--momentum must be 0 or from {FP32_TINY:.3g} to {1 - 2**-24:.8g} ({fp32}, where "
                             f"anything closer to 1 is 1), got {self.momentum}")
        if not (self.weight_decay == 0 or FP32_TINY <= self.weight_decay <= FP32_MAX):
            raise ValueError(f"--weight-decay must be 0 or from {FP32_TINY:.3g} to {FP32_MAX:.3g} ({fp32}), "
                             f"got {self.weight_decay}")
        images = SPECS["train_images"].count
        if not 0 <= self.train_subset <= images:
            raise ValueError(f"--train-subset must be from 1 to {images} (the training set's size), "
                             f"got {self.train_subset}")
        if self.batch_size > (self.train_subset or images):
            raise ValueError(f"--batch-size {self.batch_size} is larger than the training set "
                             f"({self.train_subset or images} images)")
        if self.target != "auto" and self.target not in TARGETS:
            raise ValueError(f"--target {self.target!r} is not auto or one of {', '.join(TARGETS)}")
        if self.backend == "torch" and (self.tuned_configs is not None or self.allow_default_configs
                                        or self.target != "auto"):
            raise ValueError("--tuned-configs, --allow-default-configs and --target choose kernel configs of the "
                             "cuda/triton backends; the torch backend has none")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _has_gpu() -> bool:
    return torch.cuda.is_available()


PRESETS: dict[str, dict] = {name: protocol.settings() for name, protocol in PROTOCOLS.items() if name != "default"}


def parser() -> argparse.ArgumentParser:
    d = Config()
    p = OneLineParser(prog="python -m trainer.run", description="Train an MLP on MNIST on one backend.")
    # Flags default to None so that only flags given explicitly override a preset.
    p.add_argument("--preset", choices=sorted(PRESETS), help="named bundle of settings; explicit flags win")
    p.add_argument("--backend", choices=BACKENDS,
                   help=f"default {d.backend}; cuda needs an NVIDIA GPU; triton without a GPU runs in the Triton "
                        "interpreter, about 9.5 s per step at the default size (use e.g. --hidden 32 --steps 30)")
    p.add_argument("--hidden", type=int, help=f"hidden width H (default {d.hidden})")
    p.add_argument("--layers", type=int, help=f"hidden layers L (default {d.layers})")
    p.add_argument("--batch-size", type=int, help=f"default {d.batch_size}")
    run_len = p.add_mutually_exclusive_group()
    run_len.add_argument("--epochs", type=int, help=f"default {d.epochs}")
    run_len.add_argument("--steps", type=int, help="train exactly this many steps (>= 1) instead of whole epochs")
    normal = f"{FP32_TINY:.3g} to {FP32_MAX:.3g}, fp32's normal range"
    p.add_argument("--lr", type=float, help=f"{normal} (default {d.lr})")
    p.add_argument("--momentum", type=float, help=f"0, or {FP32_TINY:.3g} to {1 - 2**-24:.8g}, fp32's largest below 1 "
                                                  f"(default {d.momentum})")
    p.add_argument("--weight-decay", type=float, help=f"0, or {normal} (default {d.weight_decay})")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help=f"default {d.dtype}")
    p.add_argument("--seed", type=int, help=f"0 to 2**64 - 1, the seeds torch's generators take (default {d.seed})")
    p.add_argument("--tuned-configs", help="tuned config store (JSON) for the cuda/triton kernels "
                                     "(default <out>/<target>/best.json if it exists; 'none': default configs)")
    p.add_argument("--target", help=f"cuda/triton: target the configs were tuned for, auto or one of "
                                    f"{', '.join(TARGETS)} (default {d.target}: the local GPU, cpu without one)")
    p.add_argument("--allow-default-configs", action="store_const", const=True,
                   help="if the config store is invalid, warn and run on default configs")
    p.add_argument("--data-dir", help="directory of the MNIST IDX .gz files (default: the copy installed "
                                      "with the trainer, trainer/mnist)")
    # 0, the field's "all", is what leaving the flag out means.
    p.add_argument("--train-subset", type=whole_number(1, SPECS["train_images"].count, "the training set's size"),
                   help=f"train on the first N images only, 1..{SPECS['train_images'].count} (default: all)")
    p.add_argument("--out", help=f"output root; runs go to <out>/runs/ (default {d.out})")
    p.add_argument("--no-graph", dest="graph", action="store_const", const=False,
                   help="cuda/triton: launch eagerly instead of replaying one CUDA graph per step")
    p.add_argument("--no-fuse", dest="fuse", action="store_const", const=False,
                   help="cuda/triton: one kernel per op (matmul, loss, relu_backward, bias_grad, sgd_update) "
                        "instead of the fused step, to see what fusion buys")
    p.add_argument("--pdl", choices=tuple(DEPENDENT_MODES),
                   help="cuda/triton, sm_90 or newer: launch the step's GEMMs as programmatic dependent launches, "
                        "each placed on the GPU once every block of the one before has started (early) or as "
                        "they exit (exit)")
    p.add_argument("--persistent", nargs="?", const="on", choices=PERSISTENT_MODES,
                   help="cuda/triton: train each segment of steps (to the next evaluation) in one launch of the "
                        "persistent training kernel, its phases separated by grid barriers; refused where the "
                        "model's weights, momentum and one step's activations do not fit the GPU's L2 cache. "
                        "auto: that where they fit, the fused step elsewhere (the run says which)")
    p.add_argument("--compile", choices=COMPILE_MODES,
                   help="torch backend: torch.compile the model with its loss and the SGD step in this mode")
    p.add_argument("--torch-graph", action="store_const", const=True,
                   help="torch backend: capture the whole step (forward, backward, SGD) in a CUDA graph")
    p.add_argument("--tf32", action="store_const", const=True,
                   help="torch backend, fp32: matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32), "
                        "about 1e-3 relative error per product")
    p.add_argument("--eval-every", type=int, help="steps between test evaluations (default: every epoch)")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                   help="no progress bar (the default when stderr is not a terminal, e.g. a log file)")
    return p


def from_args(argv: list[str] | None = None) -> Config:
    args = vars(parser().parse_args(argv))
    preset = args.pop("preset")
    given = {k: v for k, v in args.items() if v is not None}
    values = dict(PRESETS[preset]) if preset else {}
    if "epochs" in given:  # --epochs on top of a --steps preset means whole epochs
        values.pop("steps", None)
    values.update(given)
    # A bar redrawn with carriage returns is noise in a captured log.
    values.setdefault("progress", sys.stderr.isatty())
    try:
        return Config(**values)
    except ValueError as e:
        parser().error(str(e))  # exits 2, as for any bad flag
