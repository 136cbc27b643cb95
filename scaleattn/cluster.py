"""Dask clusters for scaleattn jobs: an embedded LocalCluster, a remote scheduler, or GPU workers; progress.

The embedded cluster binds to localhost only. ``scheduler="tcp://host:8786"`` (or ``DASK_SCHEDULER_ADDRESS``)
joins an existing cluster; ``gpus=N`` starts a dask-cuda LocalCUDACluster with one worker per GPU.
Progress is driven by the job's own futures (``distributed.progress`` fails with a non-default client).
"""
from __future__ import annotations

import contextlib
import os
import sys


class ClusterError(RuntimeError):
    """The Dask cluster could not be reached or has no workers within the configured time (one-line message)."""


def default_workers() -> int:
    """One worker process per core available to this process (cgroup and affinity limits honoured)."""
    from dask.system import CPU_COUNT

    return max(1, CPU_COUNT)


def tls_security(ca_file: str | None = None, cert: str | None = None, key: str | None = None):
    """``distributed.Security`` for TLS from PEM files (the CLI's ``--tls-ca-file/--tls-cert/--tls-key``).

    One certificate serves every role (client, scheduler, workers of an embedded cluster) and encryption is
    required. Returns None when no file is given, so the dask config (``distributed.comm.tls.*``) applies.

    Raises
    ------
    ValueError
        Only some of the three files given. ``FileNotFoundError``: a file does not exist.
    """
    files = {"--tls-ca-file": ca_file, "--tls-cert": cert, "--tls-key": key}
    if not any(files.values()):
        return None
    missing = [k for k, v in files.items() if not v]
    if missing:
        raise ValueError(f"TLS needs all of --tls-ca-file, --tls-cert and --tls-key (missing {', '.join(missing)})")
    for k, v in files.items():
        if not os.path.isfile(v):
            raise FileNotFoundError(f"{k}: no such file {v!r}")
    from distributed import Security

    return Security(require_encryption=True, tls_ca_file=ca_file,
                    tls_client_cert=cert, tls_client_key=key, tls_scheduler_cert=cert, tls_scheduler_key=key,
                    tls_worker_cert=cert, tls_worker_key=key)


@contextlib.contextmanager
def connect(scheduler: str | None = None, workers: int | None = None, threads_per_worker: int = 1,
            gpus: int | None = None, security=None, quiet: bool = False, scheduler_timeout: float | None = None,
            worker_timeout: float | None = None):
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
        TLS settings (:func:`tls_security`; otherwise taken from the dask config, ``distributed.comm.tls.*``).
        With ``require_encryption`` the embedded cluster speaks ``tls://`` too.
    scheduler_timeout : float, optional
        Seconds to keep trying to reach ``scheduler`` (default: the dask config ``distributed.comm.timeouts.connect``,
        30 s): a scheduler that starts after this process (a Kubernetes job's pods start in any order) is waited for.
    worker_timeout : float, optional
        With ``scheduler``: seconds to wait for the first worker to join (default: do not wait here).

    Raises
    ------
    ClusterError
        The scheduler was not reached within ``scheduler_timeout``, or no worker joined within ``worker_timeout``.

    The embedded cluster's scheduler, workers and dashboard listen on 127.0.0.1 only.
    """
    from distributed import Client, LocalCluster

    from .memory import release_large_buffers

    release_large_buffers()  # this process and the embedded cluster's workers (set before they spawn)

    scheduler = scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")
    if scheduler and (workers or gpus):
        raise ValueError("--workers/--gpus shape an embedded cluster; with --scheduler the cluster has its own workers")
    kwargs = {} if security is None else {"security": security}
    with contextlib.ExitStack() as stack:  # closes whatever was started, also when a later step fails
        if scheduler:
            timeout = {} if scheduler_timeout is None else {"timeout": scheduler_timeout}
            try:
                client = stack.enter_context(Client(scheduler, **timeout, **kwargs))
            except OSError as e:  # distributed raises OSError (TimeoutError) after the connect timeout
                raise ClusterError(f"could not reach the Dask scheduler at {scheduler}"
                                   + (f" within {scheduler_timeout:g} s (--scheduler-timeout)" if timeout else "")
                                   + f": {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            if worker_timeout is not None:
                try:
                    client.wait_for_workers(1, timeout=worker_timeout)
                except TimeoutError:
                    raise ClusterError(f"no Dask worker joined the scheduler at {scheduler} within {worker_timeout:g} s"
                                       " (--worker-timeout): are the worker pods Pending (no node with the requested"
                                       " CPUs, memory or GPUs) or failing?") from None
        else:
            # port 0: a free port, so jobs side by side never collide on 8787 (None would still bind 8787)
            common = dict(dashboard_address="127.0.0.1:0", **kwargs)
            if gpus:
                try:
                    from dask_cuda import LocalCUDACluster
                except ImportError:
                    raise RuntimeError("--gpus needs dask-cuda and cupy: pip install 'scaleattn[gpu]'") from None
                cluster = LocalCUDACluster(n_workers=gpus, threads_per_worker=threads_per_worker, ip="127.0.0.1",
                                           **common)
            else:
                cluster = LocalCluster(n_workers=workers or default_workers(), threads_per_worker=threads_per_worker,
                                       processes=True, host="127.0.0.1", **common)
            stack.enter_context(cluster)
            client = stack.enter_context(Client(cluster, **kwargs))
        if not quiet:
            link = getattr(client, "dashboard_link", None)
            print(f"dask: {len(client.scheduler_info().get('workers', {}))} workers, dashboard {link}", file=sys.stderr)
        yield client


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except Exception:
        return False


def _console():
    """Progress goes to stderr so that ``--json`` output on stdout stays clean."""
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True):
    """Yield ``advance(n=1)`` for a rich progress bar of ``total`` steps (stderr, or a notebook cell); a no-op
    when not ``enabled``. In a terminal the bar is live; when stderr is not a terminal, its final state is
    printed once at the end."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=False, console=_console()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


@contextlib.contextmanager
def status(description: str, enabled: bool = True):
    """A spinner with elapsed time for a step that runs on this node (solve, head search); prints
    ``description: done in X s`` when it ends. A no-op when not ``enabled``."""
    if not enabled:
        yield
        return
    import time

    t0 = time.perf_counter()
    console = _console()
    if _in_notebook():
        yield
    else:
        with console.status(f"[bold]{description}[/bold] ..."):
            yield
    console.print(f"[bold]{description}[/bold]: done in {time.perf_counter() - t0:.2f} s")


def notebook_progress(futures, description: str = ""):
    """Dask's progress widget (``distributed.diagnostics.progressbar.ProgressWidget``) for ``futures``,
    bound to the futures' own client: its scheduler address and event loop, never ``default_client()``
    (DESIGN §6). Displayed in the current notebook cell; it updates while the cell blocks because it
    listens on the client's loop thread. Returns the widget object (``.status`` becomes "finished")."""
    from distributed.diagnostics.progressbar import ProgressWidget

    client = futures[0].client
    bar = ProgressWidget(list(futures), scheduler=client.scheduler.address, complete=True)
    bar.bar.description = description
    try:
        from IPython.display import display

        display(bar.widget)
    except ImportError:  # pragma: no cover - only without IPython
        pass
    client.loop.add_callback(bar.listen)
    return bar


def wait_with_progress(futures, description: str, enabled: bool = True) -> None:
    """Wait for ``futures`` (of this job's client), showing progress; a task's exception is re-raised here.

    Terminal: a rich bar on stderr advanced as each future finishes. Notebook (IPython kernel with
    ipywidgets): the Dask progress widget on the futures' own client (:func:`notebook_progress`) plus a
    one-line summary. ``enabled=False`` waits silently.
    """
    import time

    from distributed import as_completed

    futures = list(futures)
    widget = None
    if enabled and futures and _in_notebook():
        try:
            widget = notebook_progress(futures, description)
        except ImportError:  # no ipywidgets: fall back to rich, which renders in notebooks too
            widget = None
    t0 = time.perf_counter()
    with progress_bar(len(futures), description, enabled and widget is None) as advance:
        for fut in as_completed(futures):
            if fut.status == "error":
                fut.result()  # re-raise the task's exception here, with its own type and message
            advance()
    if widget is not None:
        deadline = time.monotonic() + 5.0  # let the widget draw its final state before the cell moves on
        while getattr(widget, "status", None) != "finished" and time.monotonic() < deadline:
            time.sleep(0.02)
        print(f"{description}: {len(futures)}/{len(futures)} tasks in {time.perf_counter() - t0:.2f} s")
