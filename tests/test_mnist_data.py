"""The MNIST loader: the packaged files load, and broken copies are refused by name."""
from __future__ import annotations

import gzip
import shutil
import struct
import tracemalloc

import pytest
import torch

from trainer.data import DEFAULT_DIR, MEAN, SPECS, STD, DeviceBatches, MnistDataError, load_mnist, read_idx, read_mnist


def test_vendored_files_load_with_expected_counts_and_shapes():
    arrays = read_mnist(DEFAULT_DIR)
    assert arrays["train_images"].shape == (60000, 28, 28)
    assert arrays["train_labels"].shape == (60000,)
    assert arrays["test_images"].shape == (10000, 28, 28)
    assert arrays["test_labels"].shape == (10000,)
    assert set(arrays["test_labels"].tolist()) == set(range(10))

    data = load_mnist(DEFAULT_DIR, torch.device("cpu"), torch.float32)
    assert data.train_x.shape == (60000, 784) and data.test_x.shape == (10000, 784)
    assert data.train_y.dtype == torch.int64
    # Normalized with MNIST's statistics: the training set comes out near zero mean, unit std.
    assert abs(data.train_x.mean().item()) < 0.01 and abs(data.train_x.std().item() - 1) < 0.01
    # Each pixel as fp32 arithmetic normalizes its byte, then rounded once to the compute dtype.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        data = load_mnist(DEFAULT_DIR, torch.device("cpu"), dtype, train_subset=300)
        for x, images in ((data.train_x, arrays["train_images"][:300]), (data.test_x, arrays["test_images"])):
            pixels = torch.tensor(images.reshape(len(images), -1), dtype=torch.float32)
            assert x.dtype == dtype and torch.equal(x, ((pixels / 255.0 - MEAN) / STD).to(dtype))
        assert torch.equal(data.test_y, torch.tensor(arrays["test_labels"], dtype=torch.int64))


def _copy_with(tmp_path, name, raw=None, gz=None):
    """A data dir with the vendored files, one of them replaced (or removed if both are None)."""
    for spec in SPECS.values():
        if spec.name != name:
            shutil.copy(DEFAULT_DIR / f"{spec.name}.gz", tmp_path / f"{spec.name}.gz")
    target = tmp_path / f"{name}.gz"
    if raw is not None:
        target.write_bytes(gzip.compress(raw, compresslevel=1))
    elif gz is not None:
        target.write_bytes(gz)
    return target


def _raw(name):
    return gzip.decompress((DEFAULT_DIR / f"{name}.gz").read_bytes())


LABELS = "t10k-labels-idx1-ubyte"
IMAGES = "t10k-images-idx3-ubyte"


def _refused(tmp_path, path, *words):
    with pytest.raises(MnistDataError) as err:
        read_mnist(tmp_path)
    message = str(err.value)
    assert str(path) in message, message
    for word in words:
        assert word in message, message


def test_missing_file_is_named(tmp_path):
    path = _copy_with(tmp_path, LABELS)
    _refused(tmp_path, path, "missing")


def test_truncated_gzip_is_refused(tmp_path):
    gz = (DEFAULT_DIR / f"{IMAGES}.gz").read_bytes()
    path = _copy_with(tmp_path, IMAGES, gz=gz[: len(gz) // 2])
    _refused(tmp_path, path, "truncated")


def test_truncated_contents_are_refused(tmp_path):
    path = _copy_with(tmp_path, IMAGES, raw=_raw(IMAGES)[:-784])
    _refused(tmp_path, path, "truncated", "7839232", "7840016")


def test_wrong_magic_is_refused(tmp_path):
    raw = _raw(IMAGES)
    path = _copy_with(tmp_path, IMAGES, raw=struct.pack(">I", 2049) + raw[4:])
    _refused(tmp_path, path, "wrong magic number 2049", "expected 2051")


def test_checksum_mismatch_is_refused(tmp_path):
    raw = bytearray(_raw(LABELS))
    raw[-1] = (raw[-1] + 1) % 10  # still a valid label: only the checksum can tell
    path = _copy_with(tmp_path, LABELS, raw=bytes(raw))
    _refused(tmp_path, path, "checksum mismatch", SPECS["test_labels"].md5)


def test_batches_follow_a_seeded_permutation_per_epoch():
    x = torch.arange(20, dtype=torch.float32).view(10, 2)
    y = torch.arange(10)

    def epoch(b):
        b.new_epoch()
        return torch.cat([b.next()[1] for _ in range(b.steps_per_epoch)])

    a, b = DeviceBatches(x, y, 3, seed=7), DeviceBatches(x, y, 3, seed=7)
    first = epoch(a)
    assert torch.equal(first, epoch(b))  # same seed, same order
    assert len(set(first.tolist())) == 9  # 3 full batches, no repeats; the partial batch is dropped
    assert not torch.equal(first, epoch(a))  # the next epoch reshuffles
    assert not torch.equal(first, epoch(DeviceBatches(x, y, 3, seed=8)))
    # The slot counts steps within the epoch and the rows travel with their labels.
    a.new_epoch()
    xs, ys, slot = a.next()
    assert slot.item() == 0 and torch.equal(xs[:, 0], 2 * ys.float())


def test_gzip_bomb_is_refused_without_inflating_it(tmp_path):
    # A valid label header followed by 64 MiB of zeros: 64 KB on disk. Decompressing it whole
    # would hold 64 MiB; reading stops one byte past the 10,008 bytes the header announces.
    spec = SPECS["test_labels"]
    path = tmp_path / f"{spec.name}.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(struct.pack(">II", spec.magic, spec.count))
        zeros = bytes(1 << 20)
        for _ in range(64):
            f.write(zeros)
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(MnistDataError) as err:
            read_idx(path, spec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(err.value) == f"{path}: longer than the 10008 bytes its header announces (decompression stopped there)"
    assert peak < 4 << 20, f"{peak} bytes allocated while reading a 10 KB file"


def test_one_byte_too_many_is_refused(tmp_path):
    path = _copy_with(tmp_path, LABELS, raw=_raw(LABELS) + b"\0")
    _refused(tmp_path, path, "longer than the 10008 bytes")
