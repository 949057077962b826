"""trials.csv: one row per trial, appended and flushed as each trial ends.

The header is the union of what the file already has and what this run
writes (new tunables add columns; the file is rewritten once to widen it), so
pandas.read_csv reads every run's rows as they are.

Several searches may share one file (one --out, or the search and a
--compile-only run). Every change to it happens under an exclusive flock on
the file itself; widening writes a new file and renames it over the old one,
so a process that finds, once it holds the lock, that the path names another
file than the one it locked reopens the new one. A crash or a full disk can
leave the last row cut off: it is moved to <name>.partial (saying so), so the
next row starts on a line boundary and the file stays readable.
"""
from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from kernels_core.store import temp_beside
from kernels_core.provenance import COLUMNS as PROVENANCE

LEADING = ("utc", "target", "device", "op", "backend", "dtype", "shape")
TRAILING = (
    "status", "error", "time_ms", "time_p20_ms", "time_p80_ms", "metric", "tflops", "gbps", "pct_of_peak",
    "speedup_vs_default", "speedup_vs_torch", "default_ms", "torch_ms", "compile_s", "registers",
    "smem_bytes", "spill_bytes", "rel_err", "default_rel_err", "trial", "study", "sampler", "gpu",
)
# Text is UTF-8; any other byte a cut or a foreign writer left round-trips unchanged.
ENCODING, ERRORS = "utf-8", "surrogateescape"


class TrialsCsvError(ValueError):
    """A file this tuner will not append to; the message names it."""


def columns(tunables: list[str]) -> list[str]:
    head = list(LEADING) + [t for t in tunables if t not in LEADING and t not in TRAILING]
    tail = list(TRAILING) + [p for p in PROVENANCE if p not in LEADING]
    return head + tail


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _line(cells: list[str]) -> bytes:
    text = io.StringIO()
    csv.writer(text).writerow(cells)
    return text.getvalue().encode(ENCODING, ERRORS)


def _complete_end(data: bytes) -> int:
    """Where the last whole record of `data` ends. A record is whole once its line ends
    outside quotes, where its count of '"' is even (CSV doubles the ones it escapes)."""
    pos, begin, last = 0, 0, None

    def lines():
        nonlocal pos
        while pos < len(data):
            stop = data.find(b"\n", pos)
            stop = len(data) if stop < 0 else stop + 1
            line, pos = data[pos:stop], stop
            yield line.decode(ENCODING, ERRORS)

    records = csv.reader(lines())
    while True:
        try:
            next(records)
        except StopIteration:
            break
        except csv.Error:  # e.g. a NUL byte: a cut-off write may leave one, at the end
            if pos < len(data):
                raise
        last, begin = begin, pos
    if last is None:
        return 0
    raw = data[last:]
    return len(data) if raw.endswith(b"\n") and raw.count(b'"') % 2 == 0 else last


class TrialsCsv:
    def __init__(self, path: Path, wanted: list[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wanted = list(wanted)
        self.columns: list[str] = []  # the file's header, a superset of `wanted`
        self._thread_lock = threading.Lock()  # flock excludes other processes, not this one's threads
        self._file = None  # the file as locked, opened for reading and appending
        self._end: int | None = None  # where the last whole record ends; None: not read since opened
        with self._locked():
            pass

    @contextmanager
    def _locked(self):
        """Hold the file at self.path exclusively, checked whole to its end, header wide enough."""
        with self._thread_lock:
            while not self._lock_current():
                pass
            try:
                yield
            finally:
                fcntl.flock(self._file, fcntl.LOCK_UN)

    def _lock_current(self) -> bool:
        if self._file is None:
            self._file, self._end = open(self.path, "a+b"), None
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            try:
                named = os.stat(self.path)
            except FileNotFoundError:  # deleted under us: start a new one
                named = None
            held = os.fstat(self._file.fileno())
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                if self._end is not None:
                    if held.st_size != self._end:  # other processes appended, or one died mid-row
                        self._end = self._keep_whole(self._end, self._read(self._end))
                    return True
                if self._read_whole():
                    return True
        except BaseException:
            self.close()  # closing drops the lock
            raise
        self.close()  # the file was replaced (widened) or deleted: lock the one there now
        return False

    def _read(self, start: int) -> bytes:
        return os.pread(self._file.fileno(), os.fstat(self._file.fileno()).st_size - start, start)

    def _read_whole(self) -> bool:
        """Check the header and the end; widen the header if it lacks a wanted column
        (False: the file was replaced, lock the new one)."""
        data = self._read(0)
        newline = data.find(b"\n")
        prefix = ",".join(LEADING)
        if newline < 0:  # empty, or a header cut off while being written: no row can follow it
            if not prefix.startswith(data.decode(ENCODING, ERRORS)[:len(prefix)]):
                raise self._foreign("its first line never ends")
            self._file.truncate(0)
            self.columns = list(self.wanted)
            self._file.write(_line(self.columns))
            self._file.flush()
            self._end = os.fstat(self._file.fileno()).st_size
            return True
        try:
            header = next(csv.reader([data[:newline + 1].decode(ENCODING)]))
        except (UnicodeDecodeError, csv.Error) as exc:
            raise self._foreign(f"its first line is not CSV text: {exc}") from None
        if header[:len(LEADING)] != list(LEADING) or not {"status", "trial", "study"} <= set(header):
            raise self._foreign(f"its header does not start {prefix} or lacks status, trial, study")
        self.columns = header
        end = self._keep_whole(newline + 1, data[newline + 1:])
        missing = [c for c in self.wanted if c not in header]
        if missing:
            self._widen(header + missing, data[newline + 1:end])
            return False
        self._end = end
        return True

    def _foreign(self, why: str) -> TrialsCsvError:
        return TrialsCsvError(f"{self.path}: not a trials CSV of this tuner ({why}); move it aside or "
                              "choose another --out")

    def _keep_whole(self, start: int, data: bytes) -> int:
        """Where the file's whole rows end, the bytes from `start` being `data`; a cut-off
        last row is set aside."""
        try:
            whole = _complete_end(data)
        except csv.Error as exc:
            raise self._foreign(f"a row after byte {start} is not CSV: {exc}") from None
        if whole < len(data):
            self._set_aside(data[whole:], start + whole)
        return start + whole

    def _set_aside(self, piece: bytes, at: int) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "ab") as f:
            f.write(piece if piece.endswith(b"\n") else piece + b"\n")
        self._file.truncate(at)
        print(f"autotune: warning: {self.path} ended in a cut-off row ({len(piece)} bytes; a crash or a "
              f"full disk); moved it to {partial}", file=sys.stderr)

    def _widen(self, wider: list[str], body: bytes) -> None:
        with temp_beside(self.path) as (f, tmp):
            f.write(_line(wider))
            for fields in csv.reader(io.StringIO(body.decode(ENCODING, ERRORS), newline="")):
                f.write(_line(fields + [""] * (len(wider) - len(fields))))
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def keys(self) -> set[tuple[str, str]]:
        """(study, trial) of every row already in the file."""
        with self._locked():
            data = os.pread(self._file.fileno(), self._end, 0)
        rows = csv.DictReader(io.StringIO(data.decode(ENCODING, ERRORS), newline=""))
        return {(r.get("study", ""), r.get("trial", "")) for r in rows}

    def append(self, row: dict) -> None:
        with self._locked():
            line = _line([_cell(row.get(c)) for c in self.columns])
            self._file.write(line)
            self._file.flush()
            self._end += len(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
