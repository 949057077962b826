"""The training run: `train(config) -> Summary` and `step_time(config) -> Timing`.

A run is a sequence of segments of steps; a segment ends at each epoch's end
(and every `eval_every` steps). Only at a segment's end does the host wait
for the device: it then reads the segment's losses and step times, writes
them to the run's CSV, stops on a NaN loss, and measures test accuracy.

Test accuracy is measured by one plain-torch evaluator from each backend's
weights, in the run's dtype, so backends differ only in how they trained.
`train_seconds` counts training steps only (not warm-up/compilation, which is
`setup_seconds`, nor evaluation); `seconds_to_98` is train_seconds at the
first evaluation reaching 98% test accuracy.
"""
from __future__ import annotations

import csv
import datetime as dt
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from kernels_core.provenance import provenance
from kernels_core.timing import Timing, bench, bench_graph
from kernels_core.contract import DTYPES, check_labels
from trainer.build import call_configs, make_backend, pick_device
from trainer.config import Config
from trainer.data import DeviceBatches, Mnist, load_mnist
from trainer.stepper import Stepper, StepTimer
from trainer.tuned_configs import CallConfigs
from kernels_core.mlp import MNIST_CLASSES, MNIST_IN, persistent_call

TARGET_ACCURACY = 0.98


class Diverged(RuntimeError):
    """The loss became NaN (or infinite); the message names the step."""


class RunError(RuntimeError):
    """The run cannot start (outputs, memory); the message names the flag to change."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training; the steps before it are in the run's CSV, which the message names."""


@dataclass
class Summary:
    backend: str
    hidden: int
    layers: int
    batch_size: int
    dtype: str
    steps: int
    epochs: float  # epochs run, a fraction for a --steps run (whose config records epochs as null)
    test_accuracy: float
    train_seconds: float
    setup_seconds: float
    seconds_to_98: float | None
    median_step_us: float
    final_loss: float
    graph: bool
    compile: str | None
    fused: bool | None  # cuda/triton: the fused step (None for torch)
    persistent: bool | None  # triton: the persistent kernel ran the steps (None for torch)
    ops_per_step: int | None  # GPU operations of one step (kernels, memsets, copies); None on a CPU
    config_source: str  # tuned, nearest, default, matmul or mixed (CallConfigs.sources); n/a for torch
    config_store: str  # the store's origin: "none", or "<yours|shipped|given>: <path>" (n/a for torch)
    csv: str
    provenance: dict = field(default_factory=dict)

    def as_row(self) -> dict:
        """Flat dict (provenance columns inlined) for a CSV or a DataFrame row."""
        row = asdict(self)
        return {**{k: v for k, v in row.items() if k != "provenance"}, **row["provenance"]}


@torch.no_grad()
def accuracy(weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, y: torch.Tensor) -> float:
    h = x
    for i, (w, b) in enumerate(weights):
        h = torch.addmm(b.to(x.dtype), h, w.to(x.dtype))
        if i < len(weights) - 1:
            h = torch.relu(h)
    return (h.argmax(1) == y).float().mean().item()


def _uses_graph(config: Config, device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return config.torch_graph if config.backend == "torch" else config.graph


def _eval_every(config: Config, steps_per_epoch: int) -> int:
    if config.eval_every:
        return config.eval_every
    # --steps runs may be shorter than an epoch: evaluate ten times along the way.
    return max(1, math.ceil(config.steps / 10)) if config.steps else steps_per_epoch


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # not Linux: an allocation that fails still ends in one line (trainer.run)


def check_fits(config: Config, device: torch.device) -> None:
    """Refuses a model whose fp32 state alone exceeds the device's free memory.

    A lower bound: weights, gradients, the warm-up snapshot and (with momentum)
    the momentum buffers, 4 bytes each per parameter, nothing else. On a CPU
    this must be checked before allocating: Linux hands out more memory than
    it has, and touching it ends in the OOM killer rather than an error.
    """
    h = config.hidden
    params = (MNIST_IN + 1) * h + (config.layers - 1) * (h + 1) * h + (h + 1) * MNIST_CLASSES
    need = params * 4 * (3 + (config.momentum > 0))
    free = _available_bytes(device)
    if free is not None and need > free:
        raise RunError(f"--hidden {h} --layers {config.layers} does not fit: its {params:,} parameters need at least "
                       f"{need / 2**30:.1f} GiB (fp32 weights, gradients, momentum, a snapshot), "
                       f"{device.type} has {free / 2**30:.1f} GiB free")


class Built(NamedTuple):
    """What a run trains with: the model on its device, its data, and its step."""

    device: torch.device
    data: Mnist
    backend: object  # trainer.build.make_backend's: TorchBackend or OpsMLP
    configs: CallConfigs | None  # the kernel configs of cuda/triton, None for torch
    batches: DeviceBatches
    stepper: Stepper


def build(config: Config) -> Built:
    """Everything `config` trains with, ready for its first step (no step taken)."""
    device = pick_device(config)
    check_fits(config, device)
    data = load_mnist(config.data_dir, device, DTYPES[config.dtype], config.train_subset)
    batches = DeviceBatches(data.train_x, data.train_y, config.batch_size, config.seed)
    losses = torch.zeros(batches.steps_per_epoch, dtype=torch.float32, device=device)
    if config.persistent:
        from trainer.persistent import PersistentMLP, runs_persistent  # Triton, which other runs may not need

    if config.persistent and runs_persistent(config, device):
        from trainer.torch_backend import initial_mlp

        _, configs = call_configs(config, device)
        call = persistent_call(config.hidden, config.layers, config.batch_size, config.dtype, config.momentum)
        backend = PersistentMLP(initial_mlp(config.hidden, config.layers, config.seed), config, batches, losses,
                                kernel_config=configs.get(call.op, call.key))
    else:
        backend, configs = make_backend(config, device)
    return Built(device, data, backend, configs, batches, Stepper(backend, batches, losses, pdl=config.pdl))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runs_dir(config: Config) -> Path:
    """<out>/runs, made and shown writable before minutes of setup are spent."""
    runs = Path(config.out) / "runs"
    try:
        runs.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=runs):
            pass
    except OSError as e:
        raise RunError(f"--out {config.out}: cannot write {runs} ({e.strerror or e})") from e
    return runs


def _run_path(runs: Path, config: Config) -> Path:
    stem = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}_{config.backend}_h{config.hidden}"
    path, n = runs / f"{stem}.csv", 1
    while path.exists():  # two runs in one second keep both files
        n += 1
        path = runs / f"{stem}-{n}.csv"
    return path


def _rows_in(csv_path: Path) -> int:
    """The whole rows a run's CSV holds (a full disk may have cut the last one short)."""
    try:
        with open(csv_path, newline="") as written:
            return max(0, sum(1 for line in written if line.endswith("\n")) - 1)  # less the header
    except OSError:
        return 0


def train(config: Config) -> Summary:
    # torch's fp32 matmuls take TF32 only when asked (--tf32); the flag is the process's, so it is put back.
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = config.tf32
    try:
        return _train(config)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _train(config: Config) -> Summary:
    runs = _runs_dir(config)
    device, data, backend, configs, batches, stepper = build(config)
    spe = batches.steps_per_epoch
    total = config.steps or config.epochs * spe
    eval_every = _eval_every(config, spe)
    persistent = hasattr(backend, "run")  # --persistent auto may have picked the fused step
    graph = _uses_graph(config, device) and not persistent

    t0 = time.perf_counter()
    stepper.prepare(capture=graph)
    _sync(device)
    setup_seconds = time.perf_counter() - t0
    if configs is not None:
        print(f"kernel configs ({config.backend}, {config.dtype}):\n{configs.table()}", file=sys.stderr)
    if persistent:
        print(backend.describe(), file=sys.stderr)

    csv_path = _run_path(runs, config)
    timer = StepTimer(device)
    step, train_seconds, to_98, acc = 0, 0.0, None, float("nan")
    all_times: list[float] = []
    last_loss = float("nan")
    try:
        with open(csv_path, "w", newline="") as f, tqdm(total=total, disable=not config.progress,
                                                        desc=f"{config.backend} h{config.hidden}") as bar:
            out = csv.writer(f)
            out.writerow(["step", "epoch", "loss", "step_time_us"])

            def record(begin: int, end: int) -> tuple[list[float], list[float]]:
                """Writes slots [begin, end) of this epoch to the CSV; after a device sync."""
                # A label the loss kernels could not use makes the loss NaN: say so, not "lower the lr".
                check_labels(device)
                losses = stepper.losses[begin:end].tolist()
                times = timer.read_us(begin, end)
                for i, (loss, us) in enumerate(zip(losses, times)):
                    out.writerow([step + i + 1, epoch, f"{loss:.7g}", f"{us:.2f}"])
                    if not math.isfinite(loss):
                        f.flush()
                        raise Diverged(f"loss became {loss} at step {step + i + 1} (epoch {epoch}); "
                                       f"run stopped, steps so far in {csv_path}. Try a lower --lr.")
                f.flush()  # on disk at once: a crash or a full disk later loses none of them
                return losses, times

            # Ctrl-C from here on names the CSV and how many steps it holds, wherever it lands: in a
            # step loop (whose issued steps are written first), or between them (a segment's rows, the
            # test-set accuracy, a new epoch). The count is the CSV's own, read back once it is flushed.
            try:
                epoch = 0
                while step < total:
                    epoch += 1
                    batches.new_epoch()
                    epoch_steps, epoch_losses, epoch_seconds = min(spe, total - step), [], 0.0
                    begin = 0
                    while begin < epoch_steps:
                        end = min(epoch_steps, begin + eval_every - (step % eval_every))
                        _sync(device)
                        t = time.perf_counter()
                        done = begin  # slots whose step has been issued completely
                        first = begin  # the first slot of the timed group in flight
                        try:
                            if persistent:  # the whole segment in one launch, timed as one group
                                timer.start(begin)
                                backend.run(end - begin)
                                timer.stop(begin, end - begin)
                                done = first = end
                                bar.update(end - begin)
                            for slot in range(done, end):
                                if slot == first:
                                    timer.start(first)
                                stepper()
                                done = slot + 1
                                bar.update()
                                if done - first == StepTimer.GROUP or done == end:
                                    timer.stop(first, done - first)
                                    first = done
                            _sync(device)
                        except KeyboardInterrupt:
                            if done > first:  # the group in flight, cut short
                                timer.stop(first, done - first)
                            _sync(device)
                            record(begin, done)
                            raise
                        seconds = time.perf_counter() - t
                        train_seconds += seconds
                        epoch_seconds += seconds

                        losses, times = record(begin, end)
                        step += end - begin
                        epoch_losses += losses
                        all_times += times
                        last_loss = losses[-1]
                        acc = accuracy(backend.weights(), data.test_x, data.test_y)
                        if to_98 is None and acc >= TARGET_ACCURACY:
                            to_98 = train_seconds
                        begin = end
                    bar.write(f"epoch {epoch}: train loss {statistics.fmean(epoch_losses):.4f}  "
                              f"test acc {acc:.2%}  {epoch_seconds:.2f}s")
            except KeyboardInterrupt:
                f.flush()
                raise Interrupted(f"interrupted at step {_rows_in(csv_path)}; "
                                  f"the steps so far are in {csv_path}") from None
    except OSError as e:  # a full disk: the rows flushed before it stay, and the line says where
        raise RunError(f"cannot write the run's outputs ({e.strerror or e}); the steps so far, "
                       f"{_rows_in(csv_path)} of them, are in {csv_path}") from None

    summary = Summary(
        backend=config.backend, hidden=config.hidden, layers=config.layers, batch_size=config.batch_size,
        dtype=config.dtype, steps=step, epochs=round(step / spe, 3), test_accuracy=acc,
        train_seconds=train_seconds, setup_seconds=setup_seconds, seconds_to_98=to_98,
        median_step_us=statistics.median(all_times), final_loss=last_loss, graph=graph,
        compile=config.compile, fused=config.fuse if config.backend != "torch" else None,
        persistent=persistent if config.backend != "torch" else None,
        ops_per_step=stepper.ops_per_step, config_source=configs.sources() if configs else "n/a",
        config_store=configs.origin if configs else "n/a",
        csv=str(csv_path), provenance=provenance(),
    )
    # A --steps run ran steps, not the default epochs its config still holds.
    ran = {**asdict(config), "epochs": None} if config.steps is not None else asdict(config)
    summary_path = csv_path.with_suffix(".json")
    try:
        summary_path.write_text(json.dumps({"summary": asdict(summary), "config": ran,
                                            "kernel_configs": configs.table() if configs else None}, indent=2))
    except OSError as e:
        raise RunError(f"cannot write {summary_path} ({e.strerror or e}); the run's {step} steps are in "
                       f"{csv_path}") from None
    return summary


def step_time(config: Config, reps: int = 200) -> Timing:
    """Median time of one whole training step (data gather included), as trained.

    A graphed step is timed as graph replays with the lab's `bench_graph`;
    an eager one with `bench`. Both warm up first, so compilation is excluded.
    """
    built = build(config)
    device, stepper = built.device, built.stepper
    if _uses_graph(config, device):
        return bench_graph(stepper.eager, steps=reps)
    return bench(stepper.eager, device=device, warmup=3, reps=reps, flush_l2=False, max_seconds=10.0)
