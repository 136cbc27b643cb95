"""Ctrl-C before and after the ``scaleattn`` command runs (the package root imports it first).

Importing scaleattn (numpy, zarr, dask: a second or more on a busy machine) comes before
:func:`scaleattn.cli.main` can catch anything: a Ctrl-C there printed a traceback through the import machinery,
where the command says one line and exits 130 once it runs. In a process that runs the command (its console
script, ``python -m scaleattn`` or ``python -m scaleattn.cli``, told from the interpreter's own command line, not
from ``sys.argv``, which the Dask workers' start-up rewrites), this module's import makes a Ctrl-C print
:data:`STARTING` and end the process with 130 until :func:`release`, which ``main`` calls as it starts; when it
returns, ``main`` hands the interpreter's exit (closing clients, joining threads) to :func:`leave_on_interrupt`
again and records its exit code (:func:`exit_with`): the last of the interpreter's exit handlers flushes the
standard streams and ends the process with that code, since Python's own finalisation that would follow (module
teardown, a second or less for numpy, dask and zarr) runs with SIGINT reset to the system's default, where a
Ctrl-C killed the process by the signal itself with no line. A program or notebook that imports scaleattn keeps
Python's own KeyboardInterrupt and its own exit.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys

__all__ = ["STARTING", "EXIT_INTERRUPTED", "is_the_command", "leave_on_interrupt", "release", "exit_with"]

#: the exit code of the command ended by Ctrl-C (128 + SIGINT)
EXIT_INTERRUPTED = 130
#: what the command says when Ctrl-C comes before it parsed its options
STARTING = "scaleattn: interrupted while starting; nothing was done"
#: the modules ``python -m`` runs the command from
MODULES = ("scaleattn", "scaleattn.cli")

_installed = []  # the handler this module installed, while it is installed
_exit_code = []  # the command's exit code, once main returned in the scaleattn program


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


def _flush() -> None:
    """What the command printed (a pipe buffers it) goes out."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # (closed, detached, its reader gone, or the interrupted code was writing to it)
            pass


def leave_on_interrupt(line: str) -> None:
    """From now on Ctrl-C prints ``line`` on stderr (nothing where it is empty: the command said its line) and
    ends the process at once with code 130 (nothing of the command is under way to clean up: before it starts,
    after it returned). Only where Python's own handler or this module's is in place (a SIGINT the shell ignores
    stays ignored), in the main thread."""
    if signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, *_installed):
        return

    def leave(signum, frame):
        _flush()
        try:
            if line:
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


def exit_with(code: int) -> None:
    """The scaleattn program's ``main`` returned ``code``: once the interpreter's exit handlers (closing Dask
    clients, stopping multiprocessing's helpers) ran, the process ends with it, without Python's finalisation."""
    _exit_code[:] = [code]


def _last() -> None:
    """The last exit handler (registered first): flush the standard streams and logging, then leave with the
    recorded code; Python's finalisation after it resets SIGINT to the default (death by the signal, no line)."""
    if not _exit_code:  # (main did not return: an import failed, say; Python's exit says what it has to)
        return
    if "logging" in sys.modules:  # (its own exit handler may come after this one)
        try:
            sys.modules["logging"].shutdown()
        except Exception:
            pass
    _flush()
    os._exit(_exit_code[0])


if is_the_command():
    leave_on_interrupt(STARTING)
    atexit.register(_last)
