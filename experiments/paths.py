"""Where the experiments keep what they measure: experiments/results/<device>/, one folder per
device ("h200", "cpu", ...: kernels_core.provenance.device_slug), each file named for what it holds."""
from __future__ import annotations

from pathlib import Path

from kernels_core.provenance import device_slug

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir(device: str | None = None) -> Path:
    """The results folder of `device`, this machine's by default."""
    return RESULTS / (device or device_slug())


def write_results(rows: list[dict], name: str) -> Path:
    """`rows` as this machine's results file `name` (replacing it), said on stdout."""
    import pandas as pd

    out = results_dir() / name
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out, index=False)
    print(f"rows: {out}")
    return out


def add_results(rows: list[dict], name: str) -> Path:
    """`rows` added after this machine's results file `name`'s earlier rows (columns matched by
    name), said on stdout."""
    import pandas as pd

    out = results_dir() / name
    out.parent.mkdir(parents=True, exist_ok=True)
    earlier = pd.read_csv(out) if out.exists() else pd.DataFrame()
    pd.concat([earlier, pd.DataFrame(rows)]).to_csv(out, index=False)
    print(f"rows: {out}")
    return out
