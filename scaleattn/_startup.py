"""Ctrl-C before and after the ``scaleattn`` command runs (the package root imports it first).

Importing scaleattn (numpy, zarr, dask: a second or more on a busy machine) comes before
:func:`scaleattn.cli.main` can catch anything: a Ctrl-C there printed a traceback through the import machinery,
where the command says one line and exits 130 once it runs. In a process that runs the command (its console
script, ``python -m scaleattn`` or ``python -m scaleattn.cli``, told from the interpreter's own command line, not
from ``sys.argv``, which the Dask workers' start-up rewrites), this module's import makes a Ctrl-C print
:data:`STARTING` and end the process with 130 until :func:`release`, which ``main`` calls as it starts; when it
returns, ``main`` hands the interpreter's exit (closing clients, joining threads) to :func:`leave_on_interrupt`
again. A program or notebook that imports scaleattn keeps Python's own KeyboardInterrupt.
"""
from __future__ import annotations

import os
import signal
import sys

__all__ = ["STARTING", "EXIT_INTERRUPTED", "is_the_command", "leave_on_interrupt", "release"]

#: the exit code of the command ended by Ctrl-C (128 + SIGINT)
EXIT_INTERRUPTED = 130
#: what the command says when Ctrl-C comes before it parsed its options
STARTING = "scaleattn: interrupted while starting; nothing was done"
#: the modules ``python -m`` runs the command from
MODULES = ("scaleattn", "scaleattn.cli")

_installed = []  # the handler this module installed, while it is installed


def _target(orig_argv: list[str]) -> str | None:
    """What the interpreter was told to run: ``-m MODULE``, a script's path, or None (``-c``, standard input)."""
    words = iter(orig_argv[1:])
    for word in words:
        if word == "-" or not word.startswith("-"):
            return None if word == "-" else word
        if word.startswith("--"):
            if word[2:] == "check-hash-based-pycs":  # (the one long option with a value of its own)
                next(words, "")
            continue
        for k, flag in enumerate(word[1:], 2):  # (short options go together: -Bm MODULE, -Ximporttime)
            if flag in "mcXW":  # the rest of the word, or the next word, is its value
                value = word[k:] or next(words, "")
                if flag in "mc":
                    return f"-m {value}" if flag == "m" else None
                break
    return None


def is_the_command(orig_argv: list[str] | None = None) -> bool:
    """Whether this process runs the ``scaleattn`` command: ``python -m scaleattn[.cli]`` or a script named
    ``scaleattn`` (the console script; on Windows with ``.exe`` or ``-script.py``), read from
    ``orig_argv`` (default :data:`sys.orig_argv`)."""
    target = _target(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    if not target:
        return False
    if target.startswith("-m "):
        return target[3:] in MODULES
    name = os.path.basename(target)
    return name.removesuffix(".exe").removesuffix("-script.pyw").removesuffix("-script.py") == "scaleattn"


def leave_on_interrupt(line: str) -> None:
    """From now on Ctrl-C prints ``line`` on stderr and ends the process at once with code 130 (nothing of the
    command is under way to clean up: before it starts, after it returned). Only where Python's own handler is
    in place (a SIGINT the shell ignores stays ignored), in the main thread."""
    if signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, *_installed):
        return

    def leave(signum, frame):
        for stream in (sys.stdout, sys.stderr):  # what the command printed (a pipe buffers it) goes out first
            try:
                stream.flush()
            except Exception:  # (closed, detached, or the interrupted code was writing to it)
                pass
        try:
            os.write(2, (line + "\n").encode(errors="replace"))
        except OSError:
            pass
        os._exit(EXIT_INTERRUPTED)

    try:
        signal.signal(signal.SIGINT, leave)
    except ValueError:  # not the main thread
        return
    _installed[:] = [leave]


def release() -> None:
    """Give Ctrl-C back to Python (KeyboardInterrupt), if :func:`leave_on_interrupt` took it."""
    if _installed and signal.getsignal(signal.SIGINT) is _installed[0]:
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:  # not the main thread: the handler stays
            return
    _installed.clear()


if is_the_command():
    leave_on_interrupt(STARTING)
