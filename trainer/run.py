"""Command line: `python -m trainer.run --backend triton --epochs 10`.

Prints progress and per-epoch lines, then the summary; the per-step CSV and
the summary JSON land in <out>/runs/. Exits non-zero with a one-line reason
when the data, the config store, the device, the outputs, the memory, the
labels or the loss is wrong, and with 130 on Ctrl-C (the steps so far kept).
"""
from __future__ import annotations

import sys

import torch

from kernels_core.contract import LabelError
from kernels_core.cli import INTERRUPTED
from trainer.build import NeedsGpu
from trainer.config import from_args
from trainer.tuned_configs import ConfigStoreRefused
from trainer.data import MnistDataError
from trainer.train import Diverged, RunError, train


def _out_of_memory(e: BaseException) -> bool:
    # The CPU allocator raises a plain RuntimeError (errno 12, ENOMEM); CUDA's has its own type.
    return isinstance(e, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(e)


def main(argv: list[str] | None = None) -> int:
    try:
        summary = train(from_args(argv))
    except (MnistDataError, ConfigStoreRefused, NeedsGpu, Diverged, RunError, LabelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(str(e) or "interrupted", file=sys.stderr)
        return INTERRUPTED
    except RuntimeError as e:
        if not _out_of_memory(e):
            raise
        print(f"error: out of memory ({str(e).splitlines()[0][:200]}); try a smaller --hidden, --layers "
              "or --batch-size", file=sys.stderr)
        return 1
    to_98 = f"{summary.seconds_to_98:.2f}s" if summary.seconds_to_98 is not None else "not reached"
    print(f"{summary.backend} H={summary.hidden} L={summary.layers} B={summary.batch_size} {summary.dtype}: "
          f"test accuracy {summary.test_accuracy:.2%} after {summary.steps} steps, "
          f"train {summary.train_seconds:.2f}s (to 98%: {to_98}), median step {summary.median_step_us:.1f} µs, "
          f"configs {summary.config_source} (store: {summary.config_store})")
    print(f"wrote {summary.csv} and {summary.csv[:-4]}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
