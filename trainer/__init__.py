"""MNIST MLP trainer over three backends: torch, and the lab's triton and cuda kernels.

`train(config)` runs one training and returns a `Summary`; `step_time(config)`
times one training step for benchmarks. `python -m trainer.run` is the CLI.
"""
import sys

from kernels_core.cli import ctrl_c_ends_the_command

# `python -m trainer.run` imports this package, and torch with it, before the command's own code
# runs; Python documents sys.argv[0] as "-m" until it has found that module.
with ctrl_c_ends_the_command(sys.argv[:1] == ["-m"]):
    from trainer.config import Config, PRESETS
    from trainer.train import Diverged, Summary, step_time, train

__all__ = ["Config", "PRESETS", "Diverged", "Summary", "step_time", "train"]
