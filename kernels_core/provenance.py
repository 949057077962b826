"""Where a number came from: the columns every CSV row of the lab carries."""
from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
COLUMNS = (
    "utc", "device", "cc", "sm_count", "driver", "cuda", "python", "torch", "triton", "cupy", "optuna", "commit",
)
# Read back as written: a commit such as 359785e11863 is a float to pandas (inf), a version 13.0 a number.
AS_TEXT = {c: str for c in COLUMNS if c != "sm_count"}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _cupy_version() -> str:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        v = _version(dist)
        if v:
            return v
    return ""


def git_commit() -> str:
    """HEAD of this checkout; SOURCE_COMMIT wins, for copies of the tree without .git. An installed
    copy (site-packages) is no checkout, even inside one's .venv: the package's version, so said."""
    if os.environ.get("SOURCE_COMMIT"):
        return os.environ["SOURCE_COMMIT"]
    if not (REPO / ".git").exists():
        version = _version("kernel-lab")
        return f"kernel-lab {version}, installed (no git checkout)" if version else "no git checkout, no SOURCE_COMMIT"
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return f"{commit}-dirty" if commit and dirty else (commit or "unknown")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


@functools.lru_cache(maxsize=None)
def _static() -> dict[str, str]:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device, cc, sms = props.name, f"{props.major}.{props.minor}", str(props.multi_processor_count)
    else:
        device, cc, sms = f"cpu ({platform.processor() or platform.machine()})", "", ""
    return {
        "device": device,
        "cc": cc,
        "sm_count": sms,
        "driver": _driver_version() if torch.cuda.is_available() else "",
        "cuda": torch.version.cuda or "",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cupy": _cupy_version(),
        "optuna": _version("optuna"),
        "commit": git_commit(),
    }


def utc_now() -> str:
    """The current time as every CSV of the lab writes it: 2026-11-30T21:59:15Z."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance() -> dict[str, str]:
    """Device, versions and commit, plus the current UTC time."""
    return {"utc": utc_now(), **_static()}


def device_slug() -> str:
    """Short name for file names: 'h200', 'cpu', ..."""
    name = _static()["device"].lower()
    if name.startswith("cpu"):
        return "cpu"
    for word in name.replace("nvidia", "").split():
        if any(ch.isdigit() for ch in word):
            return word.replace("/", "-")
    return name.split()[-1]
