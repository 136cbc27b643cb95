"""Bounded waits of a runner joining a scheduler (``--scheduler-timeout``, ``--worker-timeout``) and the clean
stop on SIGTERM: one line each, the exit codes the Kubernetes job reports."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from scaleattn import cli
from scaleattn.distributed.cluster import connect
from scaleattn.errors import ClusterError
from tests.helpers import free_port


@pytest.mark.slow
def test_unreachable_scheduler_fails_after_the_scheduler_timeout():
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"cannot reach the Dask scheduler at tcp://127.0.0.1:9 within 2 s"
                                           r" \(`scheduler_timeout`\)") as info:
        with connect("tcp://127.0.0.1:9", scheduler_timeout=2, quiet=True):
            pass
    assert 1.5 <= time.monotonic() - t0 < 20
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_scheduler_that_starts_late_is_joined_within_seconds_of_its_start():
    """The Kubernetes runner starts before its scheduler. distributed's own connect retries back off exponentially
    with full jitter (0.01 s x 2^k), so a scheduler up after ~15 s was joined up to ~15 s later (one 60 s late was
    joined 40 s late in the manifests' run-time test); the runner polls the port at least once a second."""
    import socket
    import subprocess
    import sys
    import threading

    port = free_port()
    ready = []

    def watch():  # when the port first accepts: the scheduler is up (it answers the handshake at once)
        while not ready:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                ready.append(time.monotonic())
            except OSError:
                time.sleep(0.02)

    proc = subprocess.Popen(["bash", "-c", f"sleep 12; exec {sys.executable} -m distributed.cli.dask_scheduler"
                             f" --host 127.0.0.1 --port {port} --dashboard-address :0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with connect(f"tcp://127.0.0.1:{port}", scheduler_timeout=120, quiet=True) as client:
            joined = time.monotonic()
            assert client.scheduler_info()["address"].endswith(f":{port}")
        watcher.join(5)
        assert ready and joined - ready[0] < 3.0, f"joined {joined - ready[0]:.1f} s after the scheduler's port opened"
    finally:
        ready.append(None)
        proc.terminate()
        proc.wait(30)


def _serve(port: int, stop: list, handle):
    """Accept connections on ``port``, each handed to ``handle(conn)``, until ``stop`` is set; then free the port."""
    import socket

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        listener.settimeout(0.05)
        while not stop:
            try:
                conn = listener.accept()[0]
            except TimeoutError:
                continue
            handle(conn)


def _closing_proxy(port: int, stop: list, delay: float = 0.0):
    """Accept every connection on ``port`` and close it at once, or ``delay`` s later (a service mesh's sidecar, or
    a proxy in front of a scheduler that is not up yet) until ``stop`` is set; then free the port."""
    import threading

    _serve(port, stop, (lambda conn: threading.Timer(delay, conn.close).start()) if delay else
           (lambda conn: conn.close()))


@pytest.mark.slow
def test_a_proxy_that_closes_connections_is_waited_through_until_the_scheduler_answers():
    """A port that accepts and closes at once is a scheduler not reachable yet, not a refusal: the runner keeps
    trying for its ``scheduler_timeout`` (it failed on the first closed handshake), and says so when it ends."""
    import subprocess
    import sys
    import threading

    port = free_port()
    stop: list = []
    proxy = threading.Thread(target=_closing_proxy, args=(port, stop), daemon=True)
    proxy.start()
    time.sleep(0.2)  # (listening: a refused first try is another line)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=rf"at tcp://127\.0\.0\.1:{port}: port \d+ of 127\.0\.0\.1 accepts"
                                           r" connections but closes them before the Dask handshake"):  # one try
        with connect(f"tcp://127.0.0.1:{port}", quiet=True):
            pass
    assert time.monotonic() - t0 < 3
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=rf"cannot reach the Dask scheduler at tcp://127\.0\.0\.1:{port} within"
                                           r" 3 s \(`scheduler_timeout`\): port \d+ of 127\.0\.0\.1 accepts"
                                           r" connections but closes them before the Dask handshake"):
        with connect(f"tcp://127.0.0.1:{port}", scheduler_timeout=3, quiet=True):
            pass
    assert 2.5 <= time.monotonic() - t0 < 8

    procs = []

    def scheduler_later():  # the proxy closes connections for 4 s, then the scheduler takes its port
        time.sleep(4)
        stop.append(True)
        proxy.join()
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", str(port), "--dashboard-address", ":0"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    later = threading.Thread(target=scheduler_later, daemon=True)
    t0 = time.monotonic()
    later.start()
    try:
        with connect(f"tcp://127.0.0.1:{port}", scheduler_timeout=120, quiet=True) as client:
            assert client.scheduler_info()["address"].endswith(f":{port}")
        assert time.monotonic() - t0 >= 4
    finally:
        later.join(10)
        for proc in procs:
            proc.terminate()
            proc.wait(30)


@pytest.mark.slow
def test_a_tls_proxy_that_closes_connections_is_a_cluster_error_and_is_retried():
    """tornado refuses to start TLS on a connection the other end already closed (a ValueError, "IOStream is not
    idle"): it escaped as an internal error, with and without ``scheduler_timeout``, instead of the closing
    proxy's line (retried until the timeout, as for tcp://)."""
    import threading

    from distributed import Security

    port = free_port()
    stop: list = []
    proxy = threading.Thread(target=_closing_proxy, args=(port, stop), daemon=True)
    proxy.start()
    time.sleep(0.2)
    try:
        for _ in range(5):  # without scheduler_timeout the one try answers: the client never races the close
            with pytest.raises(ClusterError, match=rf"cannot reach the Dask scheduler at tls://127\.0\.0\.1:{port}:"
                                                   r" port \d+ of 127\.0\.0\.1 accepts connections but closes them"
                                                   r" before the Dask handshake") as e:
                with connect(f"tls://127.0.0.1:{port}", security=Security.temporary(), quiet=True):
                    pass
            assert "\n" not in str(e.value)
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=rf"at tls://127\.0\.0\.1:{port} within 3 s \(`scheduler_timeout`\):"
                                               r" port \d+ of 127\.0\.0\.1 accepts connections but closes them"):
            with connect(f"tls://127.0.0.1:{port}", security=Security.temporary(), scheduler_timeout=3, quiet=True):
                pass
        assert 2.5 <= time.monotonic() - t0 < 8
    finally:
        stop.append(True)
        proxy.join()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["tcp", "tls"])
def test_a_proxy_that_closes_connections_after_a_moment_is_retried_too(scheme):
    """A proxy that holds the connection a moment before closing it (TLS: after the client's hello) is the same
    closing proxy: distributed's connect retried it inside its own timeout, so a ``tls://`` one read, after 10 s
    and past ``scheduler_timeout``, as "not a Dask scheduler"."""
    import threading

    from distributed import Security

    port = free_port()
    stop: list = []
    proxy = threading.Thread(target=_closing_proxy, args=(port, stop, 0.3), daemon=True)
    proxy.start()
    time.sleep(0.2)
    security = Security.temporary() if scheme == "tls" else None
    closes = r"port \d+ of 127\.0\.0\.1 accepts connections but closes them before the Dask handshake"
    try:
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=rf"^cannot reach the Dask scheduler at {scheme}://127\.0\.0\.1:{port}: "
                                               + closes):
            with connect(f"{scheme}://127.0.0.1:{port}", security=security, quiet=True):
                pass
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=rf"at {scheme}://127\.0\.0\.1:{port} within 3 s"
                                               r" \(`scheduler_timeout`\): " + closes):
            with connect(f"{scheme}://127.0.0.1:{port}", security=security, scheduler_timeout=3, quiet=True):
                pass
        assert 2.5 <= time.monotonic() - t0 < 8
    finally:
        stop.append(True)
        proxy.join()


def test_a_connection_closed_under_the_client_before_tls_is_a_cluster_error(monkeypatch):
    """The scheduler's check passed and the client's own connection was closed before TLS began (a sidecar that
    lets one connection through, then closes): tornado's raw ValueError is the cluster's one line, not a crash."""
    import distributed

    from scaleattn.distributed import cluster

    def closed(*a, **k):
        raise ValueError("IOStream is not idle; cannot convert to SSL")

    monkeypatch.setattr(cluster, "reach_scheduler", lambda *a: None)
    monkeypatch.setattr(distributed, "Client", closed)
    with pytest.raises(ClusterError, match=r"^cannot reach the Dask scheduler at tcp://127\.0\.0\.1:1 within 2 s"
                                           r" \(`scheduler_timeout`\): IOStream is not idle"):
        with connect("tcp://127.0.0.1:1", scheduler_timeout=2, quiet=True):
            pass


@pytest.mark.slow
def test_a_tls_certificate_that_does_not_match_fails_at_once_with_a_scheduler_timeout():
    """distributed's own fatal answer (a TLS certificate the scheduler does not accept) is not a scheduler still
    starting: it was retried for the whole ``scheduler_timeout`` and then called a closing proxy."""
    from distributed import LocalCluster, Security

    with LocalCluster(n_workers=0, protocol="tls", security=Security.temporary(), host="127.0.0.1",
                      dashboard_address=None) as lc:
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=r"cannot reach the Dask scheduler at tls://127\.0\.0\.1:\d+ within 60 s"
                                               r" \(`scheduler_timeout`\): TLS certificate does not match") as info:
            with connect(lc.scheduler_address, security=Security.temporary(), scheduler_timeout=60, quiet=True):
                pass
        assert time.monotonic() - t0 < 20
        assert "\n" not in str(info.value)


@pytest.mark.slow
def test_no_worker_fails_after_the_worker_timeout():
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as lc:
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=r"no Dask worker joined the scheduler at tcp://127\.0\.0\.1:\d+ within"
                                               r" 1\.5 s \(`worker_timeout`\)") as info:
            with connect(lc.scheduler_address, worker_timeout=1.5, quiet=True):
                pass
        assert 1.4 <= time.monotonic() - t0 < 20
        assert "\n" not in str(info.value)
        lc.scale(1)
        with connect(lc.scheduler_address, worker_timeout=30, quiet=True) as client:  # a worker comes: no error
            assert len(client.scheduler_info()["workers"]) == 1


def test_cli_reports_a_cluster_error_in_one_line_exit_2(tmp_path, capsys):
    from scaleattn import generate

    generate.generate_mhla(str(tmp_path / "ds.zarr"), 2, 1, 4, 16, seed=0)
    rc = cli.main(["fit", str(tmp_path / "ds.zarr"), "--out", str(tmp_path / "run"), "--quiet",
                   "--scheduler", "tcp://127.0.0.1:9", "--scheduler-timeout", "1"])
    err = capsys.readouterr().err
    assert rc == 2  # our error (the cluster is not there), not a bug
    assert re.fullmatch(r"scaleattn fit: error: cannot reach the Dask scheduler at tcp://127\.0\.0\.1:9 within 1 s"
                        r" \(--scheduler-timeout\): .*\n", err), err


@pytest.mark.parametrize("value", ["0", "-3", "abc", "inf"])
def test_timeouts_must_be_positive_seconds(value, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "ds.zarr", "--out", "run", "--worker-timeout", value])
    assert info.value.code == 2 and "--worker-timeout" in capsys.readouterr().err


def test_sigterm_stops_a_command_cleanly(monkeypatch, capsys):
    seen = []

    def fake_fit(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # interrupted by the handler
            return 0
        finally:
            seen.append("cleaned up")  # context managers (the Dask client) unwind

    monkeypatch.setitem(cli.COMMANDS, "fit", fake_fit)
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    rc = cli.main(["fit", "ds.zarr", "--out", "run"])
    assert time.monotonic() - t0 < 5
    assert rc == 143 and seen == ["cleaned up"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scaleattn fit: stopped by SIGTERM") and "--resume" in err[0]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is only installed while a command runs


@pytest.fixture
def dataset(tmp_path):
    from scaleattn import generate

    generate.generate_mhla(str(tmp_path / "ds.zarr"), 2, 1, 4, 16, seed=0)
    return str(tmp_path / "ds.zarr")


@pytest.fixture
def silent_port():
    """A port that accepts connections and never says anything (another service, not a Dask scheduler)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def _fails_in_one_line(dataset, tmp_path, capsys, *options):
    t0 = time.monotonic()
    rc = cli.main(["fit", dataset, "--out", str(tmp_path / "run"), "--quiet", *options])
    err = capsys.readouterr().err
    assert rc == 2, err  # our error (no scheduler there), not a bug
    assert len(err.splitlines()) == 1 and err.startswith("scaleattn fit: error: "), err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()
    return err, time.monotonic() - t0


@pytest.mark.parametrize("address, says", [
    ("tcp://127.0.0.1:1", r"cannot reach the Dask scheduler at tcp://127\.0\.0\.1:1: connection refused \(nothing"
                          r" listens on port 1 of 127\.0\.0\.1"),
    ("127.0.0.1:1", r"cannot reach the Dask scheduler at 127\.0\.0\.1:1: connection refused"),
    ("tcp://no-such-host.invalid:8786", r"cannot reach the Dask scheduler at tcp://no-such-host\.invalid:8786: the"
                                        r" host name 'no-such-host\.invalid' does not resolve \(a typo in --scheduler"),
    ("foo", r"--scheduler 'foo' is not a Dask scheduler address \(missing port number .*\): expected"
            r" tcp://HOST:PORT or tls://HOST:PORT"),
    ("tcp://:x", r"--scheduler 'tcp://:x' is not a Dask scheduler address"),
    ("tls://127.0.0.1:1", r"--scheduler tls://127\.0\.0\.1:1: a TLS address needs --tls-ca-file, --tls-cert and"
                          r" --tls-key"),
])
def test_a_definite_answer_fails_at_once_in_one_line(dataset, tmp_path, capsys, address, says):
    """A refused connection or a name that does not resolve is the answer: distributed retried both for its whole
    connect timeout (30 s); a malformed address was an internal error (exit 1)."""
    err, seconds = _fails_in_one_line(dataset, tmp_path, capsys, "--scheduler", address)
    assert re.search(says, err), err
    assert seconds < 15  # (30 s and more before; a second or two on a loaded machine now)


def test_the_environment_s_address_is_named_as_such(dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "foo")
    err, _ = _fails_in_one_line(dataset, tmp_path, capsys)
    assert "$DASK_SCHEDULER_ADDRESS 'foo' is not a Dask scheduler address" in err, err
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://127.0.0.1:1")
    err, seconds = _fails_in_one_line(dataset, tmp_path, capsys)
    assert "tcp://127.0.0.1:1: connection refused" in err and seconds < 15, err


@pytest.mark.parametrize("options", [[], ["--scheduler-timeout", "1"]])
def test_a_port_that_never_answers_the_handshake_is_not_a_scheduler(dataset, tmp_path, capsys, silent_port,
                                                                     monkeypatch, options):
    """distributed waits forever for the handshake of a port that accepted the connection (a job hung)."""
    from scaleattn.distributed import cluster

    monkeypatch.setattr(cluster, "HANDSHAKE_TIMEOUT_S", 1.0)
    err, seconds = _fails_in_one_line(dataset, tmp_path, capsys, "--scheduler", f"tcp://127.0.0.1:{silent_port}",
                                      *options)
    # with --scheduler-timeout too: the port accepted at once, so the handshake has its own bound alone
    assert re.search(rf"127\.0\.0\.1:{silent_port} \(--scheduler tcp://127\.0\.0\.1:{silent_port}\) accepted the"
                     rf" connection but gave no Dask handshake within 1 s: not a Dask scheduler", err), err
    assert seconds < 15


def test_with_a_scheduler_timeout_a_refused_connection_is_retried_until_it_ends(dataset, tmp_path, capsys):
    err, seconds = _fails_in_one_line(dataset, tmp_path, capsys, "--scheduler", "tcp://127.0.0.1:1",
                                      "--scheduler-timeout", "2")
    assert ("cannot reach the Dask scheduler at tcp://127.0.0.1:1 within 2 s (--scheduler-timeout): connection"
            " refused") in err, err
    assert 1.8 <= seconds < 15


@pytest.mark.slow
def test_the_cli_names_the_worker_timeout_when_no_worker_joins(dataset, tmp_path, capsys):
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as lc:
        err, _ = _fails_in_one_line(dataset, tmp_path, capsys, "--scheduler", lc.scheduler_address,
                                    "--worker-timeout", "1")
    assert re.search(r"no Dask worker joined the scheduler at tcp://127\.0\.0\.1:\d+ within 1 s"
                     r" \(--worker-timeout\)", err), err


def _answering_server(port: int, stop: list, payload: bytes, hold: float = 5.0):
    """Accept every connection on ``port``, send ``payload`` at once (another service's banner or answer) and hold
    the connection ``hold`` s, until ``stop`` is set."""
    import threading

    def serve(conn):
        with conn:
            try:
                conn.sendall(payload)
            except OSError:
                return
            time.sleep(hold)

    _serve(port, stop, lambda conn: threading.Thread(target=serve, args=(conn,), daemon=True).start())


@pytest.mark.slow
@pytest.mark.parametrize("payload", [
    b"SSH-2.0-OpenSSH_9.6\r\n",  # read as a frame length of 3e18 bytes: numpy's MemoryError
    b"\xff" * 16,  # a frame length past 2**63: numpy's ValueError (it read as a closing proxy, and was retried)
    (4).to_bytes(8, "little") + b"abcd",  # a frame table too short: struct.error
    (17).to_bytes(8, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"\x01",  # msgpack 1
    (17).to_bytes(8, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"\xc1",  # not msgpack
], ids=["ssh-banner", "high-bytes", "short-frames", "not-a-dict", "not-msgpack"])
def test_a_port_that_answers_with_other_bytes_is_not_a_dask_scheduler_at_once(payload, caplog):
    """A service that speaks first (an SSH or HTTP banner) had its bytes read as Dask's framing: a raw MemoryError,
    struct.error or TypeError (the client's own handshake on a reply that is not a dict) escaped, or a ValueError
    read as a closing proxy and retried until ``scheduler_timeout``."""
    import threading

    port = free_port()
    stop: list = []
    server = threading.Thread(target=_answering_server, args=(port, stop, payload), daemon=True)
    server.start()
    time.sleep(0.2)
    try:
        for timeout in (None, 30):
            t0 = time.monotonic()
            with pytest.raises(ClusterError, match=rf"^127\.0\.0\.1:{port} \(`scheduler` tcp://127\.0\.0\.1:{port}\)"
                                                   r" answered the connection with .*: not a Dask scheduler") as e:
                with connect(f"tcp://127.0.0.1:{port}", scheduler_timeout=timeout, quiet=True):
                    pass
            assert time.monotonic() - t0 < 5
            assert "\n" not in str(e.value)
        assert not [r for r in caplog.records if r.name.startswith("distributed.protocol")]  # (with a traceback)
    finally:
        stop.append(True)
        server.join()


@pytest.mark.slow
def test_a_client_certificate_the_scheduler_refuses_fails_at_once_every_time():
    """TLS 1.3: the client's side of the handshake completes before the scheduler checks the client's certificate;
    its alert came on the first read, or was lost to the reset the client's handshake bytes caused on the
    connection the scheduler had closed, and then read as a closing proxy (about one try in two)."""
    from distributed import LocalCluster, Security

    sec, other = Security.temporary(), Security.temporary()
    mixed = Security(tls_ca_file=sec.tls_ca_file, tls_client_cert=other.tls_client_cert,
                     tls_client_key=other.tls_client_key, require_encryption=True)
    with LocalCluster(n_workers=0, protocol="tls", security=sec, host="127.0.0.1", dashboard_address=None) as lc:
        for timeout in (None,) * 20 + (60,) * 2:
            t0 = time.monotonic()
            with pytest.raises(ClusterError, match=r"^cannot reach the Dask scheduler at tls://.*UNKNOWN_CA") as e:
                with connect(lc.scheduler_address, security=mixed, scheduler_timeout=timeout, quiet=True):
                    pass
            assert time.monotonic() - t0 < 5
            assert "\n" not in str(e.value)


def test_tls_settings_that_require_encryption_refuse_a_tcp_address():
    """distributed's RuntimeError ("encryption required by Dask configuration") escaped raw."""
    from distributed import Security

    from scaleattn.errors import ParameterError

    with pytest.raises(ParameterError, match=r"tcp://127\.0\.0\.1:1: the TLS settings .* require encryption"):
        with connect("tcp://127.0.0.1:1", security=Security.temporary(), quiet=True):
            pass
