"""Ctrl-C while a command is still loading its libraries (torch takes a second or more).

A KeyboardInterrupt raised then can land in torch's own import of numpy, which swallows it and
leaves numpy half-imported, to fail later; so while a command loads, SIGINT ends the process at
once with one line and the shell's code for it, 130. Nothing is written yet. Imports nothing heavy.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def _interrupted(signum, frame):
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)


@contextlib.contextmanager
def ctrl_c_ends_the_command(command: bool):
    """`command`: this process is the command being started, not a program importing it, which
    keeps its own Ctrl-C; so does a shell's background job (SIGINT ignored)."""
    active = command and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if active:
        signal.signal(signal.SIGINT, _interrupted)
    try:
        yield
    finally:
        if active:
            signal.signal(signal.SIGINT, signal.default_int_handler)
