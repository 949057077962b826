"""The trainer as a user gets it: a built wheel run from another directory, the setup script, git status."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"autotune", "kernels_core", "kernels_cuda", "kernels_triton", "trainer"}


def _copy_of_the_source(dest: Path) -> Path:
    """The checkout without what builds and runs leave in it, so building writes nothing into it."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "experiments", "tests"))
    return dest


@pytest.mark.slow  # builds a wheel and a virtual environment
def test_wheel_installs_a_trainer_that_runs_from_any_directory(tmp_path):
    src = _copy_of_the_source(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("kernel_lab-*.whl"))
    # MNIST's four gzip files are 11 MB of it; everything else is code.
    assert wheel.stat().st_size < 13 * 2**20
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == PACKAGES  # no top-level `experiments`
    assert {f"trainer/mnist/{spec}-ubyte.gz" for spec in
            ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1")} <= set(names)

    # torch and the rest come from this interpreter's site-packages, the lab only from the wheel. A
    # path file, not --system-site-packages: from inside a virtual environment that flag gives the
    # base interpreter's packages, not this one's. Its lines only extend sys.path, so the path files
    # there (an editable install of the lab) are not read.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "parent_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('trainer').origin)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(venv)), where.stdout
    run = subprocess.run([python, "-m", "trainer.run", "--backend", "torch", "--steps", "3", "--train-subset", "256",
                          "--no-progress"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "test accuracy" in run.stdout
    outputs = sorted(p.name for p in (elsewhere / "experiments" / "runs").iterdir())
    assert len(outputs) == 2 and outputs[0].endswith("_torch_h1024.csv") and outputs[1].endswith(".json")
    assert not list((venv / "lib").glob("python*/site-packages/experiments")), "wrote into site-packages"


def _stub_python(bin_dir: Path, missing: list[str], log: Path) -> Path:
    """A python3 on which importing one of `missing` fails and `-m pip` only logs what it was asked."""
    stub = bin_dir / "python3"
    cases = "|".join(f'"import {m}"' for m in missing)
    stub.write_text(f"""#!/bin/sh
if [ "$1" = "-m" ]; then echo "$@" >> {log}; exit 0; fi
case "$2" in {cases}) exit 1;; esac
exit 0
""")
    stub.chmod(0o755)
    return stub


def test_setup_on_a_cpu_machine_neither_installs_nor_mentions_cupy(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("tr", "dirname"):  # what setup.sh runs besides python; no nvidia-smi: no GPU
        (bin_dir / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "pip.log"
    stub = _stub_python(bin_dir, ["tqdm", "cupy"], log)  # a CPU machine has no CuPy, and needs none
    result = subprocess.run([shutil.which("bash"), str(REPO / "scripts" / "setup.sh")], capture_output=True,
                            text=True, env={"PATH": str(bin_dir), "PYTHON": str(stub)}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["setup:", "installing", "what", "is", "missing:", "tqdm"]
    assert log.read_text().splitlines() == ["-m pip install -q -e .[dev]"]


def test_run_outputs_are_ignored_by_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout (a copy of the tree)")
    outputs = ["experiments/sm_75/trials.csv", "experiments/cpu/best.json", "experiments/runs/x_torch_h64.csv",
               "experiments/logs/sm_90/worker-0.log", "experiments/tuning.db", "experiments/tuning.db-journal"]
    kept = ["experiments/results/h200/kernels.csv", "experiments/FINDINGS.md", "experiments/compare.py"]
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *outputs, *kept],
                             capture_output=True, text=True).stdout.split()
    assert ignored == outputs
