"""What the tuner writes for a person to read: one prefix on every error line, and progress bars
only where a person watches.

Imports nothing heavy: autotune.search reports a Ctrl-C through it while torch is still loading.
"""
from __future__ import annotations

import sys

PREFIX = "autotune"
INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def error(message: object) -> None:
    """One line on stderr, whatever the message holds: a storage's or a compiler's text can run
    over several."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    print(f"{PREFIX}: error: {' | '.join(lines)}", file=sys.stderr)


def interrupted() -> int:
    print(f"{PREFIX}: interrupted", file=sys.stderr)
    return INTERRUPTED


def bar(**kwargs):
    """A tqdm bar on stderr, drawn only on a terminal: redrawn with carriage returns, a bar is
    noise in a log file or a pipe. A disabled bar counts nothing (tqdm's `n` stays 0)."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, disable=not sys.stderr.isatty(), **kwargs)
