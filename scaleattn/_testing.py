"""Fault injection for the test suite (layer L0), driven by environment variables so that it reaches Dask
worker processes and CLI subprocesses. Library code calls these hooks at fixed points; unset, they do nothing.

- ``SCALEATTN_TEST_TASK_DELAY=SECONDS``: every statistics task sleeps that long first (to interrupt a build).
- ``SCALEATTN_TEST_TASK_KILL=SIGNAL[@G]``: every statistics task in a worker process (of row group G and later)
  ends it with that signal first (``KILL``, as the kernel's OOM killer does), as a worker past its memory would.
- ``SCALEATTN_TEST_TASK_MEMORY=BYTES``: every statistics task in a worker process allocates (and touches) that
  many bytes first, to push its worker past its Dask memory limit.
- ``SCALEATTN_TEST_STOP_AFTER_GROUPS=K``: the client process exits with code 75, without cleanup, once K row
  groups have been computed and checkpointed in this run, as a crash would.
- ``SCALEATTN_TEST_READ_FAILURES=K``: the first K dataset reads of each process raise ``ConnectionError``
  (a flaky store), to exercise the retry policy.
- ``SCALEATTN_TEST_SOLVE_FAILURE=1``: the solve step of a fit raises ``RuntimeError`` as it starts (after the
  build), as a solver failure would.
- ``SCALEATTN_TEST_PAUSE=WHERE:FILE``: the process writes FILE and sleeps (up to a minute) at the point WHERE:
  ``import`` (as the package imports), ``report`` (a fit's report is printed, its cluster still up),
  ``teardown`` (as a command's embedded cluster stops), ``exit`` (as the ``scaleattn`` command leaves
  ``main``), ``atexit`` (in the interpreter's exit handlers), ``finalize`` (in Python's finalisation, as this
  module's globals are cleared), so that a test can send a signal there once FILE exists.
"""
from __future__ import annotations

import atexit
import os
import time

__all__ = ["before_task", "before_read", "before_solve", "stop_after_groups", "crash", "pause"]

#: exit code of a process stopped by :func:`crash`
CRASH_EXIT = 75


def before_task(group: int = 0) -> None:
    """Called at the start of every statistics task (of row group ``group``)."""
    import multiprocessing

    on_worker = multiprocessing.parent_process() is not None  # (a worker process; never a test's own process)
    delay = float(os.environ.get("SCALEATTN_TEST_TASK_DELAY", 0) or 0)
    if delay:
        time.sleep(delay)
    kill, _, first = os.environ.get("SCALEATTN_TEST_TASK_KILL", "").partition("@")
    if kill and on_worker and group >= int(first or 0):
        import signal

        os.kill(os.getpid(), getattr(signal, f"SIG{kill}"))
        time.sleep(10)  # (the signal ends the process meanwhile)
    size = int(float(os.environ.get("SCALEATTN_TEST_TASK_MEMORY", 0) or 0))
    if size and on_worker:
        _held.append(bytearray(b"\1") * size)  # (touched: resident, as a group's arrays are)
        time.sleep(5)  # the nanny's memory monitor sees it


_held = []


_reads = [0]


def before_read(url: str) -> None:
    """Called before every dataset read (:meth:`scaleattn.data._dataset.Dataset.read`)."""
    k = os.environ.get("SCALEATTN_TEST_READ_FAILURES")
    if k and _reads[0] < int(k):
        _reads[0] += 1
        raise ConnectionError(f"injected failure {_reads[0]} of {k} reading {url}")


def before_solve() -> None:
    """Called as the solve step of a fit starts (:func:`scaleattn.pipeline.fit`)."""
    if os.environ.get("SCALEATTN_TEST_SOLVE_FAILURE"):
        raise RuntimeError("injected solver failure (SCALEATTN_TEST_SOLVE_FAILURE)")


def stop_after_groups() -> int | None:
    """K of ``SCALEATTN_TEST_STOP_AFTER_GROUPS``, or None when unset."""
    v = os.environ.get("SCALEATTN_TEST_STOP_AFTER_GROUPS")
    return int(v) if v else None


def pause(where: str) -> None:
    """Called at the points ``SCALEATTN_TEST_PAUSE=WHERE:FILE`` names (``import``, ``exit``)."""
    at, _, path = os.environ.get("SCALEATTN_TEST_PAUSE", "").partition(":")
    if at == where and path:
        with open(path, "w"):
            pass
        time.sleep(60)


def crash() -> None:
    """End this process at once (code 75): no cleanup handlers, no finally blocks."""
    os._exit(CRASH_EXIT)


class _PauseWhenDeleted:
    """Pauses at ``finalize``: deleted as Python's finalisation clears this module's globals (builtins and modules
    may be gone by then: it holds what it calls)."""

    def __init__(self):
        self.path = os.environ["SCALEATTN_TEST_PAUSE"].partition(":")[2]
        self.calls = (os.open, os.close, os.O_WRONLY | os.O_CREAT, time.sleep)

    def __del__(self):
        open_, close, flags, sleep = self.calls
        close(open_(self.path, flags))
        sleep(60)


if os.environ.get("SCALEATTN_TEST_PAUSE", "").startswith(("atexit:", "finalize:")):
    atexit.register(pause, "atexit")  # (registered after scaleattn._startup's: runs before it)
    if os.environ["SCALEATTN_TEST_PAUSE"].startswith("finalize:"):
        _deleted_last = _PauseWhenDeleted()
