"""Fault injection the test suite drives through environment variables, for the two points that an injected
callback cannot reach (layer L0); unset, they do nothing.

- ``SCALEATTN_TEST_TASK_DELAY=SECONDS``: every statistics task sleeps that long first (to interrupt a build). It
  reaches the Dask workers of any cluster, the worker pods of a Kubernetes cluster included (their image has
  none of the test suite).
- ``SCALEATTN_TEST_READ_FAILURES=K``: the first K dataset reads of each process raise ``ConnectionError`` (a
  flaky store), raised inside the read where a store's own failure is told from bad data, to exercise the retry
  policy.

The test suite's other hooks (a solve that fails, a build stopped after K row groups, a pause at import or at
the command's exit) are installed by the tests themselves (``tests/inject``), not called from here.
"""
from __future__ import annotations

import os
import time

__all__ = ["before_task", "before_read"]


def before_task() -> None:
    """Called at the start of every statistics task."""
    delay = float(os.environ.get("SCALEATTN_TEST_TASK_DELAY", 0) or 0)
    if delay:
        time.sleep(delay)


_reads = [0]


def before_read(url: str) -> None:
    """Called before every dataset read (:meth:`scaleattn.data._dataset.Dataset.read`)."""
    k = os.environ.get("SCALEATTN_TEST_READ_FAILURES")
    if k and _reads[0] < int(k):
        _reads[0] += 1
        raise ConnectionError(f"injected failure {_reads[0]} of {k} reading {url}")
