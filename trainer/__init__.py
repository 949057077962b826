"""MNIST MLP trainer over three backends: torch, and the lab's triton and cuda kernels.

`train(config)` runs one training and returns a `Summary`; `step_time(config)`
times one training step for benchmarks. `python -m trainer.run` is the CLI.
"""
from trainer.config import Config, PRESETS
from trainer.train import Diverged, Summary, step_time, train

__all__ = ["Config", "PRESETS", "Diverged", "Summary", "step_time", "train"]
