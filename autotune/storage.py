"""The Optuna storage the studies share: opening it, naming it and its failures in messages,
and telling which of its trials are still alive.

Optuna numbers trials under a row lock and, for processes on other hosts that die, keeps a
heartbeat table with `fail_stale_trials`. Kept here is what it cannot do:
- A heartbeat outside `Study.optimize`, which alone runs Optuna's: Heartbeat.
- Same-host deaths found at once by pid rather than after the grace period, so a killed
  search resumes without waiting: the trial's owner (owner_dead).
"""
from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import optuna
import sqlalchemy.event
import sqlalchemy.exc
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState
from sqlalchemy.engine import make_url

from autotune.errors import SearchError
from autotune.samplers import config_key

HEARTBEAT_S, GRACE_S = 30, 120


def _host_id() -> str:
    """This host as its processes see it: containers sharing a hostname differ in pid
    namespace, and a reboot changes the boot id (pids start over)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(path).read_text().strip()[:8] if "boot" in path else str(os.stat(path).st_ino))
        except OSError:
            pass
    return "/".join(parts)


HOST = _host_id()
OWNER = f"{HOST}:{os.getpid()}"

# Optuna expects its heartbeat inside Study.optimize; Heartbeat keeps it outside on purpose.
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")

# What a storage that is unreachable, corrupt or not a database raises while the search runs.
STORAGE_ERRORS = (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError)


def open_storage(url: str, *, one_connection: bool = False) -> optuna.storages.RDBStorage:
    """The Optuna storage at `url`, or a SearchError that says what is wrong with --storage.
    one_connection: the process keeps one connection to a database server open (a second only while
    two of its threads need one at once, or one storage call of Optuna's opens another inside it),
    as each compile process does: PostgreSQL serves 100 at once by default, and a host's search
    holds its own pool's and one for each compile process."""
    try:
        return _connect(url, {"pool_size": 1, "max_overflow": 1} if one_connection else {})
    except (*STORAGE_ERRORS, ImportError, RuntimeError, OSError, ValueError) as exc:
        # ImportError: no driver for the URL; RuntimeError: a schema of another Optuna version
        raise SearchError(f"--storage {shown_url(url)}: cannot open it: {storage_problem(exc)}") from None


def _connect(url: str, pool: dict) -> optuna.storages.RDBStorage:
    sqlite = url.startswith("sqlite:///")
    kwargs = {} if sqlite else dict(pool)  # a file has no server to run out of connections
    if sqlite:
        Path(url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": 120}  # writers from other processes wait, not fail
    for attempt in range(3):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S,
                                                 grace_period=GRACE_S)
            if sqlite:
                sqlalchemy.event.listen(storage.engine, "connect", _sqlite_fast_commits)
                storage.engine.dispose()  # the connections opened already lack it
            return storage
        except sqlalchemy.exc.DBAPIError as exc:
            # Processes that open a new storage at once race to create its tables and
            # version row; the loser finds them made and opens the storage as it now is.
            racing = isinstance(exc, sqlalchemy.exc.IntegrityError) or "already exists" in str(exc)
            if not racing or attempt == 2:
                raise
            time.sleep(0.5)


def _sqlite_fast_commits(connection, _record) -> None:
    """Write-ahead log, synced at checkpoints rather than at every commit: a trial's few commits
    took longer than timing its kernel. A killed process still loses nothing (the log is in the
    OS's hands); a power cut may lose the last commits, never the database. Readers and the one
    writer no longer block each other, so processes sharing the file wait less too."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def shown_url(url: str) -> str:
    """The storage URL with its password hidden, for messages and the summary."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        # Not parseable, yet it may still hold user:password@host: hide what lies between the user
        # part's first ':' and the last '@'.
        return re.sub(r"^([^:/@]*://)?([^:/@]*):.*@", r"\1\2:***@", url)


def storage_problem(exc: BaseException) -> str:
    """What went wrong, in one line: SQLAlchemy adds the SQL and a link on further lines, and
    Optuna's wrappers keep what failed in their cause."""
    cause = exc.__cause__
    if isinstance(exc, optuna.exceptions.StorageInternalError) and cause is not None:
        return storage_problem(cause)
    first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return f"{first} ({cause})" if isinstance(exc, ImportError) and cause is not None else first


def owner_dead(owner: str | None) -> bool:
    host, _, pid = (owner or "").rpartition(":")
    if host != HOST or not pid.isdigit():
        return False  # another machine's trial: its heartbeat decides
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def reap_dead(study: optuna.Study) -> None:
    """Fail the trials left RUNNING by dead processes: on this host by pid, on others by a
    heartbeat older than the grace period. Their configs go back to the sampler; an outcome
    written just before the death never reached a CSV, so measuring it again repeats nothing.

    A trial killed between `ask` and its owner's first write has neither owner nor
    heartbeat: it stays RUNNING, but without a config it holds no claim (StudyRunner)."""
    optuna.storages.fail_stale_trials(study)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if owner_dead(trial.user_attrs.get("owner")):
            try:
                study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            except UpdateFinishedTrialError:
                pass  # another process reaped it first


def counts_toward_budget(trial: optuna.trial.FrozenTrial) -> bool:
    """A finished trial that measured its config: an outcome other than `invalid`, not a copy."""
    return (trial.state in (TrialState.COMPLETE, TrialState.PRUNED) and "reused_from" not in trial.user_attrs
            and trial.user_attrs.get("status") not in (None, "invalid"))


def measured_elsewhere(storage: optuna.storages.BaseStorage, name: str, key: str,
                       complete=lambda config: config) -> dict[tuple, tuple[str, optuna.trial.FrozenTrial]]:
    """Config -> ("study#trial", trial) of the trials that measured it in the storage's other
    studies of the same target/op/backend/dtype/shape `key` (other --study-prefix values), each
    config `complete`d (Space.with_defaults: trials from before a tunable existed)."""
    found = {}
    for other in optuna.get_all_study_names(storage):
        if other != name and other.endswith(key):
            for t in optuna.load_study(study_name=other, storage=storage).get_trials(deepcopy=False):
                if counts_toward_budget(t):
                    found.setdefault(config_key(complete(t.user_attrs["config"])), (f"{other}#{t.number}", t))
    return found


class Heartbeat:
    """Keeps in-flight trials alive in the storage, so other machines can tell
    a slow trial from a dead one. Its own lock: a runner busy with a slow
    sampler must not starve it past the grace period."""

    def __init__(self, storage: optuna.storages.RDBStorage):
        self.storage = storage
        self.ids: dict[tuple[str, int], int] = {}  # (study, trial number) -> trial id
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, trial: optuna.Trial) -> None:
        # The trial's id as Optuna's Trial holds it (a private attribute, as of Optuna 5.1): looked up
        # by study and number, it cost two reads of the storage a trial.
        with self._lock:
            self.ids[(trial.study.study_name, trial.number)] = trial._trial_id
        self.storage.record_heartbeat(trial._trial_id)

    def discard(self, trial: optuna.Trial) -> None:
        with self._lock:
            self.ids.pop((trial.study.study_name, trial.number), None)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                ids = list(self.ids.values())
            for trial_id in ids:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception as exc:  # noqa: BLE001 - a storage hiccup must not end the heartbeat
                    print(f"autotune: heartbeat of trial {trial_id} not recorded: {exc}", file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()
