"""Dask clusters for scaleattn jobs: an embedded LocalCluster, a remote scheduler, or GPU workers.

The embedded cluster binds to localhost only and, by default, speaks TLS with ephemeral credentials made for
this job (``distributed.Security.temporary()``: a fresh key and certificate held only in the memory of this
process and its workers), so another local account can neither submit work to it nor read its traffic; its
dashboard listens on 127.0.0.1. Worker logs (task tracebacks) stay out of the terminal unless ``debug``.
``scheduler="tcp://host:8786"`` (or ``DASK_SCHEDULER_ADDRESS``) joins an existing cluster, whose security is
its own (docs/security.md); ``gpus=N`` starts a dask-cuda LocalCUDACluster with one worker per GPU.

Before a client connects to a remote scheduler, :func:`reach_scheduler` checks that the address is a Dask
scheduler that answers: a definite answer (refused, a host name that does not resolve, a TLS certificate not
accepted, another service on the port) ends the wait at once in one line, and a port not reachable yet (a
scheduler still starting, a proxy in front of one) is retried until ``scheduler_timeout``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from .._params import seconds
from ..display._progress import Reporter, as_reporter
from ..errors import ClusterError, InputNotFoundError, MissingDependencyError, ParameterError
from ..store._location import check_kind
from .memory import available_memory, worker_config

__all__ = ["connect", "tls_security", "default_workers", "check_workers", "embedded_security", "reach_scheduler",
           "first_line", "MAX_THREADS_PER_CORE", "HANDSHAKE_TIMEOUT_S", "POLL_S"]

#: the embedded cluster runs at most this many worker threads per core (more only thrashes, or hangs starting)
MAX_THREADS_PER_CORE = 4
#: memory a worker process needs before it holds any data (interpreter, numpy, distributed)
WORKER_BASE_BYTES = 150e6


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C (SIGINT) and SIGTERM while an embedded cluster starts, and raise one that came meanwhile once
    it stands (then in the caller's exit stack, it is closed in order). Raised mid-start, it left a half-started
    cluster whose atexit close failed (``AssertionError: Status.init``) and its workers behind.

    SIGINT also stays blocked in the threads started meanwhile (distributed's event loops, the nannies' threads)
    and so in the worker processes they spawn, from their first instruction on: a terminal's Ctrl-C goes to every
    process of the job, and a worker that took it while still importing printed a KeyboardInterrupt traceback.
    This process stops them. Only in the main thread (where signal handlers live), on POSIX."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    # started here, not by distributed's first queue in its event loop thread: starting it unblocks SIGINT in the
    # thread that starts it (the stdlib's own mask trick), which would reach the worker processes spawned after
    resource_tracker.ensure_running()
    got = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in held}
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (a pending one is recorded here)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(got):  # the handlers of this process take it now (KeyboardInterrupt, the CLI's 143)
            signal.raise_signal(s)


def default_workers() -> int:
    """One worker process per core available to this process (cgroup and affinity limits honoured)."""
    from dask.system import CPU_COUNT

    return max(1, CPU_COUNT)


def check_workers(workers: int | None, threads_per_worker: int = 1) -> None:
    """Refuse an embedded cluster this machine cannot run: more than :data:`MAX_THREADS_PER_CORE` worker
    threads per core, or more worker processes than its memory can start.

    Raises
    ------
    ParameterError
        Naming the option, the limit and the machine's cores and memory.
    """
    cores = default_workers()
    n = default_workers() if workers is None else int(workers)
    limit = MAX_THREADS_PER_CORE * cores
    if n * int(threads_per_worker) > limit:
        raise ParameterError(f"`workers={n}` x `threads_per_worker={threads_per_worker}`: at most {limit} worker"
                             f" threads on this machine ({MAX_THREADS_PER_CORE} per core, {cores} cores); to use more,"
                             " join a cluster with `scheduler`")
    have = available_memory()
    if n * WORKER_BASE_BYTES > have:
        most = max(1, int(have // WORKER_BASE_BYTES))
        raise ParameterError(f"`workers={n}`: this machine has memory for at most {most} worker processes"
                             f" ({have / 2**30:.1f} GiB available, about"
                             f" {WORKER_BASE_BYTES / 1e6:.0f} MB each before any data)")


def embedded_security(security=None):
    """The security of an embedded cluster: ``security`` when given (``False``: plain TCP), the dask config's
    TLS settings when it has them, else ephemeral TLS credentials (``Security.temporary()``)."""
    import dask
    from distributed import Security

    if security is False:
        return None
    if security is not None:
        return security
    if dask.config.get("distributed.comm.tls.ca-file", None) or dask.config.get(
            "distributed.comm.require-encryption", False):
        return Security()  # from the dask config
    try:
        return Security.temporary()
    except ImportError:
        raise MissingDependencyError.for_extra("the embedded cluster's TLS", "",
                                               "cryptography (a dependency of scaleattn)") from None


def tls_security(ca_file: str | None = None, cert: str | None = None, key: str | None = None):
    """``distributed.Security`` for TLS from PEM files (the CLI's ``--tls-ca-file/--tls-cert/--tls-key``).

    One certificate serves every role (client, scheduler, workers of an embedded cluster) and encryption is
    required. Returns None when no file is given, so the dask config (``distributed.comm.tls.*``) applies.

    Raises
    ------
    ParameterError
        Only some of the three files given, or a directory (or a path through a file) given as one.
    InputNotFoundError
        A file does not exist.
    """
    files = {"`ca_file`": ca_file, "`cert`": cert, "`key`": key}
    if not any(files.values()):
        return None
    missing = [k for k, v in files.items() if not v]
    if missing:
        raise ParameterError(f"TLS needs all of `ca_file`, `cert` and `key` (missing {', '.join(missing)})")
    for k, v in files.items():
        check_kind(v, k, "a PEM file", directory=False)
        if not os.path.isfile(v):
            raise InputNotFoundError(f"{k}: no such file {v!r}")
    from distributed import Security

    return Security(require_encryption=True, tls_ca_file=ca_file,
                    tls_client_cert=cert, tls_client_key=key, tls_scheduler_cert=cert, tls_scheduler_key=key,
                    tls_worker_cert=cert, tls_worker_key=key)


@contextlib.contextmanager
def connect(scheduler: str | None = None, workers: int | None = None, threads_per_worker: int = 1,
            gpus: int | None = None, security=None, quiet: bool = False, progress=None,
            scheduler_timeout: float | None = None, worker_timeout: float | None = None, debug: bool = False):
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
    security : distributed.Security or False, optional
        TLS settings (:func:`tls_security`; otherwise taken from the dask config, ``distributed.comm.tls.*``).
        The embedded cluster defaults to ephemeral TLS credentials (:func:`embedded_security`); ``False``
        starts it on plain TCP.
    quiet : bool
        Do not print the cluster lines (``starting a local Dask cluster (N workers) ...`` before it starts, then
        the workers, the start-up time and the dashboard link, which lives as long as this cluster).
    progress : Reporter, optional
        Where the cluster lines go (default :func:`~scaleattn.display._progress.as_reporter` of ``not quiet``: stderr,
        or the cell in a notebook); a transient spinner shows while the embedded cluster stops.
    scheduler_timeout : float, optional
        Seconds to keep trying to reach ``scheduler``, also while the connection is refused or its host name does
        not resolve: a scheduler that starts after this process (a Kubernetes job's pods start in any order) is
        waited for. Default: one try, so a refused connection or an unknown host fails at once (no answer at all:
        after the dask config ``distributed.comm.timeouts.connect``, 30 s). At most
        :data:`~scaleattn._params.MAX_SECONDS` (30 days), as ``worker_timeout``.
    worker_timeout : float, optional
        With ``scheduler``: seconds to wait for the first worker to join (default: do not wait here), and later
        for a worker while the cluster has none (default: the dask config's
        ``distributed.scheduler.no-workers-timeout``, else 60 s).
    debug : bool
        Let the embedded workers' logs (task tracebacks) through to the terminal.

    Yields
    ------
    distributed.Client

    Raises
    ------
    ParameterError
        ``workers``/``gpus`` together with a scheduler address, more workers than the machine can run
        (:func:`check_workers`), or ``scheduler`` not an address (or a ``tls://`` one without TLS settings).
    MissingDependencyError
        ``gpus`` without dask-cuda.
    ClusterError
        The scheduler was not reached (at once when refused or unknown, else within ``scheduler_timeout``), the
        port does not answer as a Dask scheduler, or no worker joined within ``worker_timeout``.

    The embedded cluster's scheduler, workers and dashboard listen on 127.0.0.1 only, over TLS with ephemeral
    credentials by default; its workers start with :func:`~scaleattn.distributed.memory.worker_config` (large
    freed buffers go back to the OS).

    See Also
    --------
    scaleattn.fit, scaleattn.certify_dataset, scaleattn.evaluate : the jobs that take its ``client``.

    Examples
    --------
    >>> with connect(workers=1, quiet=True) as client:  # an embedded cluster, stopped on leaving the block
    ...     len(client.scheduler_info()["workers"])
    1
    """
    import dask
    from distributed import Client, LocalCluster

    scheduler_timeout = seconds("scheduler_timeout", scheduler_timeout)
    worker_timeout = seconds("worker_timeout", worker_timeout)
    where = "`scheduler`" if scheduler else "$DASK_SCHEDULER_ADDRESS"
    scheduler = scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")
    if scheduler and (workers or gpus):
        raise ParameterError("`workers` and `gpus` shape an embedded cluster; with `scheduler` the cluster has its"
                             " own workers")
    reporter = progress if isinstance(progress, Reporter) else as_reporter(not quiet)
    if not scheduler and not gpus:
        check_workers(workers, threads_per_worker)
    if not scheduler:
        security = embedded_security(security)
    kwargs = {} if security in (None, False) else {"security": security}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:  # closes whatever was started, also when a later step fails
        if scheduler:
            reporter.line(f"connecting to the Dask scheduler {scheduler} ...")
            reach_scheduler(scheduler, where, security or None, scheduler_timeout)
            timeout = {} if scheduler_timeout is None else {"timeout": scheduler_timeout}
            try:
                client = stack.enter_context(Client(scheduler, **timeout, **kwargs))
            except (OSError, ValueError) as e:  # OSError (TimeoutError) after the connect timeout; tornado's
                if isinstance(e, ValueError) and "IOStream" not in str(e):  # ValueError: closed before TLS began
                    raise
                raise ClusterError(f"cannot reach the Dask scheduler at {scheduler}"
                                   + (f" within {scheduler_timeout:g} s (`scheduler_timeout`)" if timeout else "")
                                   + f": {first_line(e)}") from None
            if worker_timeout is not None:
                # the same bound once the job runs: a step whose cluster has had no worker for this long ends
                # (scaleattn.distributed.reduction.no_worker_timeout), as the scheduler of `scaleattn submit` does
                stack.enter_context(dask.config.set({"distributed.scheduler.no-workers-timeout": f"{worker_timeout}s"}))
                try:
                    client.wait_for_workers(1, timeout=worker_timeout)
                except TimeoutError:
                    raise ClusterError(f"no Dask worker joined the scheduler at {scheduler} within"
                                       f" {worker_timeout:g} s (`worker_timeout`): are the worker pods Pending (no"
                                       " node with the requested CPUs, memory or GPUs) or failing?") from None
        else:
            n = gpus or workers or default_workers()
            kind = "dask-cuda cluster" if gpus else "Dask cluster"
            reporter.line(f"starting a local {kind} ({n} {'GPU ' if gpus else ''}worker{'s' if n > 1 else ''}) ...")
            # port 0: a free port, so jobs side by side never collide on 8787 (None would still bind 8787)
            common = dict(dashboard_address="127.0.0.1:0", silence_logs=logging.WARNING if debug else logging.CRITICAL,
                          **kwargs)
            stack.enter_context(dask.config.set(worker_config()))
            with _signals_held():
                if gpus:
                    try:
                        from dask_cuda import LocalCUDACluster
                    except ImportError:
                        raise MissingDependencyError.for_extra("`gpus`", "gpu", "dask-cuda and CuPy") from None
                    cluster = LocalCUDACluster(n_workers=gpus, threads_per_worker=threads_per_worker, ip="127.0.0.1",
                                               **common)
                else:
                    cluster = LocalCluster(n_workers=workers or default_workers(),
                                           threads_per_worker=threads_per_worker, processes=True, host="127.0.0.1",
                                           **common)
                stack.enter_context(cluster)
                client = stack.enter_context(Client(cluster, **kwargs))
        link = getattr(client, "dashboard_link", None)
        n = len(client.scheduler_info().get("workers", {}))
        reporter.line(f"dask: {n} worker{'s' if n != 1 else ''} ready in {time.perf_counter() - t0:.1f} s, dashboard"
                      f" {link} (open while this job runs)")
        try:
            yield client
        finally:
            if not scheduler:  # stopping the worker processes takes a few seconds: say so in a terminal
                with reporter.status("stopping the local Dask cluster"):
                    stack.close()


# ---- is the address a Dask scheduler that answers? (the check before a client connects) --------------------
#: how long a port that accepted the connection has to answer the Dask handshake (a scheduler answers at once;
#: distributed itself waits forever, so another service on the port hung the job)
HANDSHAKE_TIMEOUT_S = 10.0
#: with --scheduler-timeout, the scheduler's port is tried at least this often (s) until it accepts: distributed's
#: own retries back off exponentially with full jitter, so a scheduler that came up 60 s after the runner was
#: reached 40 s later (the Kubernetes runner starts before its scheduler)
POLL_S = 1.0


def _connect_once(address: str, host: str, port: int, where: str, timeout: float, within: str = "") -> None:
    """One plain TCP connection to the scheduler's port, closed at once; its failure raises the ClusterError that
    names it (connection refused, a host name that does not resolve, no answer)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}{within}: the host name {host!r} does not"
                           f" resolve (a typo in {where}, or no such service yet?)") from None
    except ConnectionRefusedError:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}{within}: connection refused (nothing"
                           f" listens on port {port} of {host}: is the scheduler running, on that port?)") from None
    except TimeoutError:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}{within}: no answer within {timeout:g} s"
                           + ("" if within else " (distributed.comm.timeouts.connect; `scheduler_timeout` waits"
                                                " longer)")) from None
    except OSError as e:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}{within}: {e.strerror or e}") from None


def _wait_for_port(address: str, host: str, port: int, where: str, deadline: float, within: str) -> None:
    """Try the scheduler's TCP port until it accepts, until ``deadline`` (``time.monotonic()``), the pause between
    tries doubling from 50 ms to :data:`POLL_S`: the runner goes on within about a second of the scheduler's start.
    Raises the ClusterError of the last try (its cause named, and ``within``)."""
    pause = 0.05
    while True:
        left = deadline - time.monotonic()
        try:
            return _connect_once(address, host, port, where, max(min(left, HANDSHAKE_TIMEOUT_S), 0.05), within)
        except ClusterError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
        time.sleep(min(pause, left))
        pause = min(2 * pause, POLL_S)


def reach_scheduler(address: str, where: str, security, scheduler_timeout: float | None) -> None:
    """Check that ``address`` is a Dask scheduler before the client connects, so that a definite answer ends the
    wait at once: distributed retries a refused connection and a host name that does not resolve for its whole
    connect timeout (30 s), and waits forever for the handshake of a port that accepts and never answers. Over
    TCP (and TLS) each try is one connection and one handshake (:func:`_one_handshake`), so its error is the
    port's: distributed's connect also retries a closed connection within its timeout, and its last error then
    read as a port that never answered.

    Parameters
    ----------
    address : str
        The scheduler's address (``tcp://HOST:PORT``, ``tls://HOST:PORT``, ...).
    where : str
        How the caller names the address in errors (```scheduler```, ``--scheduler``, ``$DASK_SCHEDULER_ADDRESS``).
    security : distributed.Security or None
        The client's TLS settings.
    scheduler_timeout : float or None
        Seconds to keep trying a port that refuses or closes connections; None: one try.

    Raises
    ------
    ParameterError
        Not an address (``foo``, ``tcp://:x``), a ``tls://`` one without TLS settings, or a plain one with TLS
        settings that require encryption.
    ClusterError
        Another service answered the handshake (a banner, bytes that are not Dask's framing: at once, never
        retried); or, without ``scheduler_timeout``, the one try to connect failed (refused, a host name that does
        not resolve, no answer within distributed's connect timeout); with it, no connection within it (the cause
        named); or the port accepted but gave no Dask handshake within :data:`HANDSHAKE_TIMEOUT_S` more; or it
        closed the connection before the handshake (a proxy whose scheduler is not up: with ``scheduler_timeout``,
        retried until it ends, as a refused connection is; without it, at once).

    Examples
    --------
    >>> reach_scheduler("tcp://127.0.0.1:9", "`scheduler`", None, None)  # port 9 (discard): nothing listens
    Traceback (most recent call last):
    ...
    scaleattn.errors.ClusterError: cannot reach the Dask scheduler at tcp://127.0.0.1:9: connection refused ...
    """
    import dask
    from dask.utils import parse_timedelta
    from distributed import Security
    from distributed.comm import connect as comm_connect
    from distributed.comm import get_address_host_port
    from distributed.utils import LoopRunner, sync, wait_for

    try:
        host, port = get_address_host_port(address)
    except ValueError as e:
        raise ParameterError(f"{where} {address!r} is not a Dask scheduler address ({e}): expected tcp://HOST:PORT"
                             " or tls://HOST:PORT") from None
    args = (security or Security()).get_connection_args("client")
    if address.startswith("tls://") and args.get("ssl_context") is None:
        raise ParameterError(f"{where} {address}: a TLS address needs `security` (or the dask config"
                             " distributed.comm.tls.*)")
    if args.get("require_encryption") and not address.startswith(("tls://", "wss://")):
        raise ParameterError(f"{where} {address}: the TLS settings (`security`, or the dask config"
                             " distributed.comm.require-encryption) require encryption: a tls:// address")
    tcp = address.split("://")[0] in ("tcp", "tls", "ws", "wss") or "://" not in address  # (ucx: not TCP)
    if scheduler_timeout is None and tcp:  # one try: its failure is the answer (with the option, retried until it ends)
        _connect_once(address, host, port, where,
                      parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s"))
    # the port accepts (or distributed retries within --scheduler-timeout: not TCP); the handshake has its own bound
    retried = None if tcp else scheduler_timeout
    waited = (retried or 0) + HANDSHAKE_TIMEOUT_S
    deadline = time.monotonic() + (scheduler_timeout or 0)
    within = f" within {scheduler_timeout:g} s (`scheduler_timeout`)" if scheduler_timeout else ""

    async def handshake():
        try:
            if tcp:  # one try, its error as it came: distributed's connect retries a closed connection inside
                # its own timeout, so a TLS proxy that closed after a moment read as a port that never answered
                comm = await wait_for(_one_handshake(address, args), waited)
            else:
                comm = await wait_for(comm_connect(address, timeout=retried or HANDSHAKE_TIMEOUT_S, **args), waited)
        except ValueError as e:  # tornado will not start TLS on a connection already closed ("IOStream is not idle")
            raise _ClosedBeforeTLS(f"the connection was closed before the TLS handshake ({e})") from None
        await comm.close()

    runner = LoopRunner()
    runner.start()
    try:
        while True:
            if scheduler_timeout is not None and tcp:  # until the port accepts (distributed's retries back off)
                _wait_for_port(address, host, port, where, deadline, within)
            try:
                return sync(runner.loop, handshake)
            except _NotDask as e:  # it answered, with something else: no retry
                raise ClusterError(f"{host}:{port} ({where} {address}) answered the connection with {e}, not a Dask"
                                   " handshake: not a Dask scheduler (its dashboard port, 8787, or another service?)"
                                   ) from None
            except TimeoutError:  # (an OSError too) connected, and no handshake came back
                raise ClusterError(f"{host}:{port} ({where} {address}) accepted the connection but gave no Dask"
                                   f" handshake within {waited:g} s: not a Dask scheduler (its dashboard port, 8787,"
                                   " or another service?)") from None
            except OSError as e:
                refused = _tls_refused(e)
                if refused:  # distributed's "never retry": a certificate one end does not accept
                    raise ClusterError(f"cannot reach the Dask scheduler at {address}{within}: {refused}") from None
                if not tcp:
                    raise ClusterError(f"cannot reach the Dask scheduler at {address}{within}: {first_line(e)}"
                                       ) from None
                # accepted, then closed: a proxy in front of a scheduler not up yet (a service mesh's sidecar).
                # Without scheduler_timeout this one try is the answer: the client's own try would race the same
                # close (and raise tornado's raw ValueError when it loses)
                if scheduler_timeout is not None:
                    left = deadline - time.monotonic()
                    if left > 0:
                        time.sleep(min(POLL_S, left))
                        continue
                    _connect_once(address, host, port, where, HANDSHAKE_TIMEOUT_S, within)  # names the cause, if one
                plain = " a TLS scheduler addressed as tcp://," if address.startswith("tcp://") else ""
                raise ClusterError(f"cannot reach the Dask scheduler at {address}{within}: port {port} of {host}"
                                   " accepts connections but closes them before the Dask handshake (a proxy whose"
                                   f" scheduler is not up,{plain} or not a Dask scheduler)") from None
    finally:
        runner.stop()


async def _one_handshake(address: str, args: dict):
    """One connection to ``address`` (TCP, and TLS for ``tls://``) and the Dask handshake on it, as
    ``distributed.comm.connect`` makes them but without its retries; returns the open comm. Whatever the reply
    raises other than an OSError (a closed connection) is :class:`_NotDask`, so only the connect's own errors
    (tornado's ValueError among them) come out as they are."""
    from distributed.comm.core import parse_address
    from distributed.comm.registry import get_backend

    scheme, loc = parse_address(address)
    comm = await get_backend(scheme).get_connector().connect(loc, **args)
    log = logging.getLogger("distributed.protocol.core")  # it logs bytes it cannot decode with a traceback:
    quiet = log.disabled  # here they are another service's answer, said in one line below
    log.disabled = True
    reply = asyncio.ensure_future(comm.read())
    try:
        # a scheduler writes its handshake first: wait for it a moment before writing ours, so that a TLS alert sent
        # right after the TLS handshake (TLS 1.3: the scheduler refused our certificate) is not lost to the reset our
        # bytes would cause on a connection it had closed (it then read as a closing proxy)
        await asyncio.wait([reply], timeout=_READ_FIRST_S)
        if not reply.done() or reply.exception() is None:  # (a proxy may wait for the client's bytes first)
            with contextlib.suppress(OSError):  # closed meanwhile: the reply says why
                await comm.write(comm.handshake_info())
        try:
            msg = await reply
        except Exception as e:  # bytes that are not Dask's framing read as a frame length (an HTTP or SSH banner):
            if isinstance(e, OSError):  # numpy's MemoryError, struct.error, msgpack's ValueError, TypeError, ...
                raise
            raise _NotDask(f"bytes that are not Dask's ({type(e).__name__})") from None
        if not isinstance(msg, dict):
            raise _NotDask(f"a message of type {type(msg).__name__}")
    except BaseException:
        reply.cancel()
        comm.abort()
        raise
    finally:
        log.disabled = quiet
    return comm


#: how long :func:`_one_handshake` waits for the scheduler's handshake before writing its own
_READ_FIRST_S = 0.5


class _NotDask(Exception):
    """The port answered the Dask handshake with something else (not an OSError: never retried)."""


class _ClosedBeforeTLS(ConnectionError):
    """A ``tls://`` port accepted and closed before the TLS handshake began (tornado's ValueError, as an OSError)."""


def _tls_refused(e: BaseException) -> str | None:
    """Why a TLS handshake was refused, for distributed's never-retried error (``FatalCommClosedError``: a
    certificate one end does not accept), or None: another error, or a TLS connection closed before its handshake
    (``SSLEOFError``: a proxy whose scheduler is not up, retried as a closed connection is)."""
    import ssl

    from distributed.comm.core import FatalCommClosedError

    if not isinstance(e, FatalCommClosedError) or isinstance(e.__cause__, ssl.SSLEOFError):
        return None
    return str(e) or f"the TLS handshake failed: {first_line(e.__cause__ or e)}"


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
