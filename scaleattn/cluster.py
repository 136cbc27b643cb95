"""Dask clusters for scaleattn jobs: an embedded LocalCluster, a remote scheduler, or GPU workers; progress.

The embedded cluster binds to localhost only. ``scheduler="tcp://host:8786"`` (or ``DASK_SCHEDULER_ADDRESS``)
joins an existing cluster; ``gpus=N`` starts a dask-cuda LocalCUDACluster with one worker per GPU.
Progress is driven by the job's own futures (``distributed.progress`` fails with a non-default client).
"""
from __future__ import annotations

import contextlib
import os
import sys


def default_workers() -> int:
    """One worker process per core."""
    return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def connect(scheduler: str | None = None, workers: int | None = None, threads_per_worker: int = 1,
            gpus: int | None = None, security=None, quiet: bool = False, dashboard: bool = True):
    """Yield a ``distributed.Client`` for one job and close what this call started.

    Parameters
    ----------
    scheduler : str, optional
        Address of a running scheduler; default ``$DASK_SCHEDULER_ADDRESS``; when neither is set an embedded
        cluster is started.
    workers : int, optional
        Worker processes of the embedded cluster (default one per core).
    threads_per_worker : int
        Threads per worker (BLAS threads too); the default 1 keeps one core per worker.
    gpus : int, optional
        Start a dask-cuda LocalCUDACluster with this many GPUs (needs the ``gpu`` extra).
    security : distributed.Security, optional
        TLS settings (otherwise taken from the dask config, ``distributed.comm.tls.*``).
    """
    from distributed import Client, LocalCluster

    scheduler = scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")
    kwargs = {} if security is None else {"security": security}
    if scheduler:
        client = Client(scheduler, **kwargs)
        cluster = None
    else:
        common = dict(dashboard_address="127.0.0.1:0" if dashboard else None, **kwargs)
        if gpus:
            try:
                from dask_cuda import LocalCUDACluster
            except ImportError:
                raise RuntimeError("--gpus needs dask-cuda and cupy: pip install 'scaleattn[gpu]'") from None
            cluster = LocalCUDACluster(n_workers=gpus, threads_per_worker=threads_per_worker, ip="127.0.0.1", **common)
        else:
            cluster = LocalCluster(n_workers=workers or default_workers(), threads_per_worker=threads_per_worker,
                                   processes=True, host="127.0.0.1", **common)
        client = Client(cluster, **kwargs)
    if not quiet:
        link = getattr(client, "dashboard_link", None)
        print(f"dask: {len(client.scheduler_info().get('workers', {}))} workers, dashboard {link}", file=sys.stderr)
    try:
        yield client
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except Exception:
        return False


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True):
    """Yield ``advance()`` for a rich progress bar (terminal or notebook); a no-op when not enabled."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def wait_with_progress(futures, description: str, enabled: bool = True) -> None:
    """Wait for ``futures`` (of this job's client), advancing a bar as each finishes; errors are raised."""
    from distributed import as_completed

    with progress_bar(len(futures), description, enabled) as advance:
        for fut in as_completed(futures):
            if fut.status == "error":
                fut.result()  # re-raise the task's exception here, with its own type and message
            advance()
