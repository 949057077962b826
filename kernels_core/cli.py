"""What the lab's commands share: refusals in one line, whole-number flags, and Ctrl-C while a
command is still loading its libraries (torch takes a second or more).

A KeyboardInterrupt raised while loading can land in torch's own import of numpy, which swallows
it and leaves numpy half-imported, to fail later; so while a command loads, SIGINT ends the
process at once with one line and the shell's code for it, 130. Nothing is written yet. Imports
nothing heavy.
"""
from __future__ import annotations

import argparse
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


class OneLineParser(argparse.ArgumentParser):
    """Every refusal one line, exit 2 (argparse's own prints the usage block first)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):  # argparse lists choices, not the flags
            message += f"; {self.prog} --help lists the flags"
        self.refuse(message)

    def refuse(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def whole_number(low: int, high: int | None = None, what: str = ""):
    """An argparse type: a whole number from `low` to `high` (no bound when None); `what` says
    what the bounds are."""
    allowed = (f"from {low} to {high}" if high is not None else f">= {low}") + (f" ({what})" if what else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number {allowed}")
        return value
    return parse
