"""Programmatic dependent launch (Hopper and newer): the next kernel starts while this one ends.

A training step at small widths is a chain of short kernels, each waiting for the last to finish
before its blocks are even placed on the SMs: launch, set-up and the drain of the previous kernel
add up to a few µs a link. With a programmatic dependent launch (PDL; sm_90+) a kernel may be
launched as soon as every block of the kernel before it on the stream has signalled
(`griddepcontrol.launch_dependents`), and it waits (`griddepcontrol.wait`) until that kernel has
finished and its writes are visible. A CUDA graph captured from such launches keeps those edges.

Within `dependent_launch(mode)` each twin launches the kernels that take part this way: every one
of them waits before its first access to global memory, so each kernel of the chain still sees
every write of the one before, and so, by induction, of all before. When the next kernel may be
placed is the mode:

    early  each block signals right after its wait: the next kernel's blocks are placed once every
           block of this one has started, and wait on the SMs beside this kernel's work
    exit   no signal: the next kernel's blocks are placed as this kernel's blocks exit, which hides
           the launch and the last writes' flush, and no more

Which pays depends on the width: on an H100 early took 11-12% off the seed step at H = 128 and
made the default step at H = 1024 14-29% slower; exit was never slower (experiments/FINDINGS.md,
"Dependent launches between the step's kernels").

A kernel that does not take part launches as usual, after the one before has finished; a kernel
of the chain launched after it waits for it, as it would for any. Outside the block, and for
kernels that do not take part, the launches and the compiled code are the same as without this
module.
"""
from __future__ import annotations

import contextlib
import threading

import torch

MIN_CAPABILITY = (9, 0)
# The kernels' code for each mode (Triton's PDL constexpr, the CUDA twin's DEPENDENT_LAUNCH): 0 is off.
MODES = {"early": 1, "exit": 2}
_state = threading.local()


@contextlib.contextmanager
def dependent_launch(mode: str | None = "early"):
    """Within it, the twins launch their chain kernels as programmatic dependent launches in `mode`
    (None: as usual)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"dependent launch mode {mode!r} is not one of {', '.join(MODES)}")
    before = code()
    _state.code = MODES[mode] if mode else 0
    try:
        yield
    finally:
        _state.code = before


def code() -> int:
    """The kernels' code of the mode in force: 0 outside `dependent_launch`."""
    return getattr(_state, "code", 0)


def check(device: torch.device) -> None:
    """Refuses, in one line, a device on which a dependent launch cannot run."""
    if device.type != "cuda":
        raise ValueError(f"programmatic dependent launch runs on a GPU (sm_90 or newer); the step runs on {device}")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise ValueError(f"programmatic dependent launch needs sm_90 or newer; {torch.cuda.get_device_name(device)} "
                         f"is sm_{cap[0]}{cap[1]}")
