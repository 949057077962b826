"""MNIST from the vendored IDX files, checked byte for byte, kept on the device.

The four gzip files under trainer/mnist/ (package data: an installed trainer
finds them too) are the original distribution. Before a single pixel is used,
each is decompressed and checked against what the README promises (magic
number, count, dimensions, size and MD5 of the uncompressed bytes), so a
truncated download or a swapped file fails loudly, naming the file and the
problem, instead of training on garbage. The header is read first and fixes
the size, and no more than one byte past it is ever decompressed, so a small
file that inflates to gigabytes costs no more memory than the real one.

Batches are gathered on the device from a device-resident copy of the
training set, through an epoch permutation and a step counter that also live
on the device: a training step then needs nothing from the host and can be
captured in a CUDA graph with its data gather included.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_DIR = Path(__file__).resolve().parent / "mnist"
MEAN, STD = 0.1307, 0.3081


class MnistDataError(ValueError):
    """A data file is missing or is not the file the README describes."""


@dataclass(frozen=True)
class IdxSpec:
    name: str  # uncompressed name; the file on disk is name + ".gz"
    magic: int
    count: int
    dims: tuple[int, ...]  # per-item dimensions after the count
    size: int
    md5: str


SPECS = {
    "train_images": IdxSpec("train-images-idx3-ubyte", 2051, 60000, (28, 28), 47040016, "6bbc9ace898e44ae57da46a324031adb"),
    "train_labels": IdxSpec("train-labels-idx1-ubyte", 2049, 60000, (), 60008, "a25bea736e30d166cdddb491f175f624"),
    "test_images": IdxSpec("t10k-images-idx3-ubyte", 2051, 10000, (28, 28), 7840016, "2646ac647ad5339dbf082846283269ea"),
    "test_labels": IdxSpec("t10k-labels-idx1-ubyte", 2049, 10000, (), 10008, "27ae3e4e09519cfbb04c329615203637"),
}


def read_idx(path: Path, spec: IdxSpec) -> np.ndarray:
    """The checked contents of one gzip'd IDX file, as uint8 [count, *dims]."""
    if not path.is_file():
        raise MnistDataError(f"{path}: missing (expected the gzip of {spec.name}; see {DEFAULT_DIR / 'README.md'})")
    header = 4 * (2 + len(spec.dims))
    try:
        with gzip.open(path, "rb") as f:
            head = f.read(header)
            if len(head) < header:
                raise MnistDataError(f"{path}: truncated: {len(head)} bytes uncompressed, "
                                     f"shorter than the {header}-byte header")
            magic, count, *dims = struct.unpack(f">{2 + len(spec.dims)}I", head)
            if magic != spec.magic:
                raise MnistDataError(f"{path}: wrong magic number {magic}, expected {spec.magic} for {spec.name}")
            if count != spec.count or tuple(dims) != spec.dims:
                raise MnistDataError(
                    f"{path}: header says {count} items of {tuple(dims)}, expected {spec.count} of {spec.dims}"
                )
            # The header's counts fix the size; one byte more tells a longer stream, unread beyond it.
            body = f.read(spec.size - header + 1)
    except EOFError as e:
        raise MnistDataError(f"{path}: truncated gzip stream ({e})") from e
    except (OSError, zlib.error) as e:
        raise MnistDataError(f"{path}: not a valid gzip file ({e})") from e

    size = header + len(body)
    if size < spec.size:
        raise MnistDataError(f"{path}: truncated: {size} bytes uncompressed, expected {spec.size}")
    if size > spec.size:
        raise MnistDataError(f"{path}: longer than the {spec.size} bytes its header announces "
                             "(decompression stopped there)")
    md5 = hashlib.md5(head)
    md5.update(body)
    digest = md5.hexdigest()
    if digest != spec.md5:
        raise MnistDataError(f"{path}: checksum mismatch: MD5 of the uncompressed bytes is {digest}, expected {spec.md5}")
    return np.frombuffer(body, dtype=np.uint8).reshape(spec.count, *spec.dims)


@functools.lru_cache(maxsize=4)
def _read_all(data_dir: Path, stamp: tuple) -> dict[str, np.ndarray]:
    # `stamp` (sizes and mtimes) only keys the cache: a changed file is re-read and re-checked.
    return {key: read_idx(data_dir / f"{spec.name}.gz", spec) for key, spec in SPECS.items()}


def read_mnist(data_dir: str | Path = DEFAULT_DIR) -> dict[str, np.ndarray]:
    """All four arrays (train/test images and labels), checked; cached per directory."""
    data_dir = Path(data_dir).resolve()
    stamp = []
    for spec in SPECS.values():
        path = data_dir / f"{spec.name}.gz"
        st = path.stat() if path.is_file() else None
        stamp.append((st.st_size, st.st_mtime_ns) if st else None)
    return _read_all(data_dir, tuple(stamp))


@dataclass(frozen=True)
class Mnist:
    """Normalized images [N, 784] in the compute dtype and int64 labels, on one device."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_mnist(data_dir: str | Path, device: torch.device, dtype: torch.dtype, train_subset: int = 0) -> Mnist:
    """Load once to the device; `train_subset` > 0 keeps only the first N training images."""
    arrays = read_mnist(data_dir)

    # A pixel's value normalized in fp32, then in the compute dtype so no step casts its inputs: one
    # entry per byte value, gathered on the device (converting 47M pixels on the host took seconds).
    table = ((torch.arange(256, dtype=torch.float32) / 255.0 - MEAN) / STD).to(device=device, dtype=dtype)

    def images(a: np.ndarray) -> torch.Tensor:
        return table[torch.tensor(a.reshape(len(a), -1)).to(device).int()]  # a copy: `a` is read-only

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a).to(device).long()

    n = train_subset or len(arrays["train_labels"])
    return Mnist(
        images(arrays["train_images"][:n]), labels(arrays["train_labels"][:n]),
        images(arrays["test_images"]), labels(arrays["test_labels"]),
    )


class DeviceBatches:
    """Batches drawn on the device through a seeded per-epoch permutation.

    `next()` reads the position from a device counter and advances it, so the
    call can sit inside a captured CUDA graph and still walk the epoch. The
    permutation comes from a torch.Generator on the data's device seeded once,
    so every backend on that device sees the same order. The last partial
    batch of an epoch is dropped: every step has the same shape.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int, seed: int):
        if batch > len(x):
            raise ValueError(f"batch size {batch} is larger than the training set ({len(x)} images)")
        self.x, self.y, self.batch = x, y, batch
        self.steps_per_epoch = len(x) // batch
        device = x.device
        self._gen = torch.Generator(device=device).manual_seed(seed)
        # The identity until the first epoch, so warm-up steps read valid rows.
        self.perm = torch.arange(len(x), device=device)
        self.pos = torch.zeros((), dtype=torch.int64, device=device)
        self._batches = self.perm[:self.steps_per_epoch * batch].view(self.steps_per_epoch, batch)

    @property
    def epoch_batches(self) -> torch.Tensor:
        """(steps_per_epoch, batch) int64: the epoch's batches as rows of the permutation (a view, so
        it follows each new epoch's draw)."""
        return self._batches

    def new_epoch(self) -> None:
        self.perm.copy_(torch.randperm(len(self.x), generator=self._gen, device=self.x.device))
        self.pos.zero_()

    def next_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slot): the batch's row indices into x and y, and its step index within the epoch
        (a device scalar). A step that gathers its batch itself (the fused step) takes these."""
        # Wrapping keeps timing loops that run past an epoch inside the permutation.
        slot = self.pos.remainder(self.steps_per_epoch)
        # The epoch's batches as the rows of a matrix: one gather picks the slot's, where index
        # arithmetic would cost two more kernels per step.
        rows = self._batches.index_select(0, slot.view(1)).view(self.batch)
        self.pos.add_(1)
        return rows, slot

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, slot): the batch and its step index within the epoch (a device scalar)."""
        rows, slot = self.next_rows()
        return self.x.index_select(0, rows), self.y.index_select(0, rows), slot
