"""Is an address a Dask scheduler that answers? The check a client makes before it connects (layer L3, below
:mod:`scaleattn.distributed.cluster`): a definite answer (refused, a host name that does not resolve, a TLS
certificate not accepted, another service on the port) ends the wait at once in one line, and a port not
reachable yet (a scheduler still starting, a proxy in front of one) is retried until ``scheduler_timeout``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ..errors import ClusterError, ParameterError

__all__ = ["reach_scheduler", "first_line", "HANDSHAKE_TIMEOUT_S", "POLL_S"]

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
