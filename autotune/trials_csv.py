"""trials.csv: one row per trial, appended and flushed as each trial ends.

The header is the union of what the file already has and what this run
writes (new tunables add columns; the file is rewritten once to widen it), so
pandas.read_csv reads every run's rows as they are.
"""
from __future__ import annotations

import csv
import json
import os
import tempfile
import threading
from pathlib import Path

from kernels_core.provenance import COLUMNS as PROVENANCE

LEADING = ("utc", "target", "device", "op", "backend", "dtype", "shape")
TRAILING = (
    "status", "error", "time_ms", "time_p20_ms", "time_p80_ms", "metric", "tflops", "gbps", "pct_of_peak",
    "speedup_vs_default", "speedup_vs_torch", "default_ms", "torch_ms", "compile_s", "registers",
    "smem_bytes", "spill_bytes", "rel_err", "trial", "study", "reused_from", "sampler", "gpu",
)


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


class TrialsCsv:
    def __init__(self, path: Path, wanted: list[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        existing = self._header()
        if existing is None:
            self.columns = list(wanted)
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self.columns)
        else:
            self.columns = existing + [c for c in wanted if c not in existing]
            if len(self.columns) > len(existing):
                self._widen()
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)

    def _header(self) -> list[str] | None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return None
        with open(self.path, newline="") as f:
            return next(csv.reader(f))

    def _widen(self) -> None:
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def keys(self) -> set[tuple[str, str]]:
        """(study, trial) of every row already in the file."""
        with open(self.path, newline="") as f:
            return {(r.get("study", ""), r.get("trial", "")) for r in csv.DictReader(f)}

    def append(self, row: dict) -> None:
        with self._lock:
            self._writer.writerow([_cell(row.get(c)) for c in self.columns])
            self._file.flush()

    def close(self) -> None:
        self._file.close()
