"""torch.compile of the torch backend's step on the CPU (inductor's C++ backend): the same first steps as eager.

The GPU variants (inductor's Triton kernels, the whole step in a CUDA graph) are in test_trainer_gpu.py; here
the wiring is checked where it is cheap: the model with its loss and the SGD step both compile (neither falls
back to eager), and the compiled step trains as the eager one does. Inductor compiles C++ here: ~20 s with its
on-disk cache warm, up to ~75 s cold on two busy cores, hence `slow`.
"""
import pytest
import torch
from torch._dynamo.utils import counters

from experiments.compare import TRACKING, tracking_failure
from trainer.config import Config
from trainer.torch_backend import TorchBackend

STEPS = TRACKING[0][0]  # the steps over which the trainer tests hold two fp32 runs to 1e-4
# Odd sizes, so no shape lines up with a vector width by luck; momentum on, so the buffers are exercised; a
# large step, so a wrong update moves the next loss far beyond 1e-4 (twice the update: ~4e-2 at step 2,
# against ~1e-7 between eager and compiled). Both tests share the shapes, so the second hits inductor's cache.
HIDDEN, BATCH, LR = 37, 19, 0.5
CPU = torch.device("cpu")


def _config(rng, **kw) -> Config:
    return Config(hidden=HIDDEN, layers=2, lr=LR, seed=int(torch.randint(2**31, (1,), generator=rng)),
                  progress=False, **kw)


def _batches(rng, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(BATCH, 784, generator=rng), torch.randint(0, 10, (BATCH,), generator=rng)) for _ in range(n)]


def _compiled_graphs() -> int:
    # A graph for the model with its loss (its backward comes with it) and one for the SGD update: with fewer,
    # a part runs eagerly (dynamo skips fused optimizers, for one, and code past its recompile limit).
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # inductor compiles C++
def test_compiled_model_and_sgd_step_train_like_eager(rng):
    config, batches = _config(rng), _batches(rng, STEPS)
    eager_backend = TorchBackend(config, CPU)
    eager = [eager_backend.step(x, y).item() for x, y in batches]
    counters.clear()
    compiled_backend = TorchBackend(Config(**{**vars(config), "compile": "default"}), CPU)
    compiled = [compiled_backend.step(x, y).item() for x, y in batches]
    assert _compiled_graphs() >= 2, dict(counters["stats"])
    assert (failure := tracking_failure(compiled, eager)) is None, failure


@pytest.mark.slow  # inductor compiles C++: 21 CPU s with its cache cold (a fresh machine)
def test_each_compiled_backend_compiles_afresh(rng):
    """compare trains many compiled backends in one process; dynamo keeps its graphs per code object, and past
    its recompile limit it would run the step eagerly without a word. Limit 1: the second backend shows it."""
    (x, y), = _batches(rng, 1)
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(2):
            counters.clear()
            TorchBackend(_config(rng, compile="default"), CPU).step(x, y)
            assert _compiled_graphs() >= 2, dict(counters["stats"])
