"""Fault injection for the test suite (layer L0), driven by environment variables so that it reaches Dask
worker processes and CLI subprocesses. Library code calls these hooks at fixed points; unset, they do nothing.

- ``SCALEATTN_TEST_TASK_DELAY=SECONDS``: every statistics task sleeps that long first (to interrupt a build).
- ``SCALEATTN_TEST_STOP_AFTER_GROUPS=K``: the client process exits with code 75, without cleanup, once K row
  groups have been computed and checkpointed in this run, as a crash would.
- ``SCALEATTN_TEST_READ_FAILURES=K``: the first K dataset reads of each process raise ``ConnectionError``
  (a flaky store), to exercise the retry policy.
"""
from __future__ import annotations

import os
import time

__all__ = ["before_task", "before_read", "stop_after_groups", "crash"]

#: exit code of a process stopped by :func:`crash`
CRASH_EXIT = 75


def before_task() -> None:
    """Called at the start of every statistics task."""
    delay = float(os.environ.get("SCALEATTN_TEST_TASK_DELAY", 0) or 0)
    if delay:
        time.sleep(delay)


_reads = [0]


def before_read(url: str) -> None:
    """Called before every dataset read (:meth:`scaleattn.dataset.Dataset.read`)."""
    k = os.environ.get("SCALEATTN_TEST_READ_FAILURES")
    if k and _reads[0] < int(k):
        _reads[0] += 1
        raise ConnectionError(f"injected failure {_reads[0]} of {k} reading {url}")


def stop_after_groups() -> int | None:
    """K of ``SCALEATTN_TEST_STOP_AFTER_GROUPS``, or None when unset."""
    v = os.environ.get("SCALEATTN_TEST_STOP_AFTER_GROUPS")
    return int(v) if v else None


def crash() -> None:
    """End this process at once (code 75): no cleanup handlers, no finally blocks."""
    os._exit(CRASH_EXIT)
