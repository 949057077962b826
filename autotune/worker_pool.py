"""The parent's handle on one worker subprocess: start, ask, time out, restart."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from kernels_core.provenance import REPO

STARTUP_TIMEOUT_S = 600.0  # importing torch + a backend on a cold node can be slow


class WorkerStartError(RuntimeError):
    pass


def visible_gpus() -> list[str]:
    """GPU ids to pin workers to, as CUDA_VISIBLE_DEVICES values."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def worker_env(gpu: str | None, *, interpret: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = gpu or ""  # "" hides every GPU from compile-only and host runs
    env["PYTHONUNBUFFERED"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
        # One thread (torch's and the interpreter's BLAS): workers share the host's cores with each
        # other and the search, and an OpenMP team with a thread preempted waits out a scheduler
        # tick at its barrier. On 2 cores beside two busy processes, a call of 0.1 ms timed 16 ms.
        env["OMP_NUM_THREADS"] = "1"
    return env


class WorkerProcess:
    def __init__(self, name: str, env: dict[str, str], log_path: Path):
        self.name, self.env, self.log_path = name, env, log_path
        self.proc: subprocess.Popen | None = None
        self._buffer, self._eof, self._ready = b"", False, False
        self.restarts = 0

    def start(self) -> None:
        """Starts the process without waiting for it: its imports (torch's take seconds) run while
        the caller gets on with its own work; the first request waits for it to be ready."""
        if self.proc is None:
            self._spawn()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"=== worker {self.name} started {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "autotune.worker"], cwd=REPO, env=self.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True,  # its own group: a timeout kills compiler children too
            )
        self._buffer, self._eof, self._ready = b"", False, False

    def _await_ready(self) -> None:
        if self._read_line(STARTUP_TIMEOUT_S) is None:
            code = self._kill()
            raise WorkerStartError(f"worker {self.name} did not start (exit code {code}); "
                                   f"its log {self.log_path} ends with: {self.log_tail()}")
        self._ready = True

    def wait_ready(self) -> None:
        """Returns once the process (started now if it is not running) takes requests."""
        self.start()
        if not self._ready:
            self._await_ready()

    def request(self, message: dict, timeout: float) -> dict:
        """The worker's answer; a hang or a crash becomes an answer too, and the
        next request starts a fresh worker."""
        self.wait_ready()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died between requests; reading reports how
        line = self._read_line(timeout)
        if line is None:
            alive = not self._eof
            code = self._kill()
            self.restarts += 1
            if alive:
                return {"ok": False, "status": "timeout",
                        "error": f"no answer within {timeout:g} s; worker killed and restarted"}
            how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            return {"ok": False, "status": "launch_error",
                    "error": f"worker process died ({how}); its log ends: {self.log_tail() or '(empty)'}"}
        try:
            answer = json.loads(line)
        except ValueError:  # not the protocol: something in the worker wrote to its channel
            self._kill()
            self.restarts += 1
            return {"ok": False, "status": "launch_error",
                    "error": f"worker answered {line[:200]!r}, not JSON; worker restarted"}
        if answer.get("fatal"):
            self._kill()
            self.restarts += 1
            answer["error"] = f"{answer.get('error', '')} (CUDA context lost; worker restarted)"
        return answer

    def _read_line(self, timeout: float) -> bytes | None:
        """One protocol line, or None on timeout or EOF (then self._eof is set)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self._eof = True
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _kill(self) -> int | None:
        if self.proc is None:
            return None
        try:  # the group too: a crashed worker may leave compilers (nvcc, ptxas) running
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except (OSError, AttributeError):
                pass
        self.proc = None
        return code

    def interrupt(self) -> None:
        """Kill the process only (its pipes stay with the thread reading them)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 6) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        kept = [t.strip() for t in text.splitlines() if t.strip() and not t.startswith("=== worker")]
        return " | ".join(kept[-lines:])

    def ask_to_exit(self) -> None:
        """Tells the process to exit, without waiting: a pool's processes then end side by side (each
        takes a second or so to release its CUDA context)."""
        if self.proc is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(b'{"cmd": "exit"}\n')
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        if self.proc is None:
            return
        if not self._ready:  # started ahead and never used: no need to wait for its imports
            self._kill()
            return
        self.ask_to_exit()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._kill()
