"""A throwaway PostgreSQL server for the sharing tests and experiments.stress_sharing.

The server's own binaries (Debian's `postgresql` package: /usr/lib/postgresql/<N>/bin, or
on PATH) run on a unix socket in a temporary folder, as an unprivileged user when we are
root (postgres refuses root), with durability off: it lives as long as the test session.
Its URL names the psycopg (3) driver, which SQLAlchemy 2.1 also takes for a bare
postgresql://; one database per test or round.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import itertools
import os
import shutil
import subprocess
import tempfile

import pytest

_count = itertools.count()


def _binaries() -> str | None:
    """The folder holding initdb and pg_ctl, newest version first."""
    on_path = shutil.which("pg_ctl")
    candidates = ([os.path.dirname(on_path)] if on_path else []) + sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    return next((d for d in candidates if os.path.exists(os.path.join(d, "initdb"))), None)


class LocalServer:
    def __init__(self, folder: str):
        self.folder = folder  # holds the server's unix socket

    def new_database(self) -> str:
        import psycopg

        name = f"t{os.getpid()}_{next(_count)}"
        with psycopg.connect(host=self.folder, user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@/{name}?host={self.folder}"


@contextlib.contextmanager
def local_server():
    """Yields a LocalServer; raises RuntimeError with one line saying why none can start."""
    if importlib.util.find_spec("psycopg") is None:
        raise RuntimeError("no PostgreSQL driver: pip install 'psycopg[binary]'")
    bin_dir = _binaries()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL server binaries (Debian: apt-get install postgresql)")
    folder = tempfile.mkdtemp(prefix="pg")  # short: a socket path has at most 107 characters
    run_as = {}
    if os.geteuid() == 0:
        os.chown(folder, 65534, 65534)
        run_as = {"user": 65534, "group": 65534, "extra_groups": []}  # nobody: postgres refuses root
    pg_ctl = [os.path.join(bin_dir, "pg_ctl"), "-D", os.path.join(folder, "data")]
    try:
        for cmd in ([os.path.join(bin_dir, "initdb"), "-D", os.path.join(folder, "data"), "-U", "postgres",
                     "--auth=trust", "--no-sync", "-E", "UTF8"],
                    pg_ctl + ["-l", os.path.join(folder, "log"), "-w", "start", "-o",
                              f"-k {folder} -c listen_addresses='' -c fsync=off -c synchronous_commit=off "
                              "-c full_page_writes=off -c max_connections=200"]):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **run_as)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise RuntimeError(f"PostgreSQL did not start: {exc}") from None
            if done.returncode:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"PostgreSQL did not start: {os.path.basename(cmd[0])}: {tail[0]}")
        yield LocalServer(folder)
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(pg_ctl + ["-m", "immediate", "stop"], capture_output=True, timeout=60, **run_as)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server():
    try:
        with local_server() as server:
            yield server
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request, tmp_path) -> str:
    """A new, empty Optuna storage of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tuning.db'}"
    return request.getfixturevalue("postgres_server").new_database()
