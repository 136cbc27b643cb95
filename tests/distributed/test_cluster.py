"""A locked-down cluster: TLS for every Dask connection (CLI options, ``cluster.connect(security=...)`` and the
dask config), and the embedded cluster (scheduler, workers, dashboard) listening on 127.0.0.1 only."""
from __future__ import annotations

import datetime

import numpy as np
import pytest

pytest.importorskip("cryptography")

from scaleattn.distributed.cluster import connect, tls_security  # noqa: E402
from scaleattn.pipeline import fit  # noqa: E402


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A self-signed CA certificate and key (PEM files), usable for every role as distributed does."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    d = tmp_path_factory.mktemp("tls")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "scaleattn-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.DNSName("scaleattn-test")]), critical=False)
            .sign(key, hashes.SHA256()))
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return {"ca": str(d / "cert.pem"), "cert": str(d / "cert.pem"), "key": str(d / "key.pem")}


@pytest.fixture(scope="module")
def data(causal_ds):
    """The shared causal dataset and the coefficients of its in-process fit."""
    return causal_ds.url, fit(causal_ds.url, client=None, exact_mse=False).solution.coef


@pytest.fixture(scope="module")
def tls_scheduler(certs):
    """A running TLS-only cluster (one in-process worker) standing in for a remote one."""
    from distributed import LocalCluster

    sec = tls_security(certs["ca"], certs["cert"], certs["key"])
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, host="127.0.0.1", security=sec,
                      dashboard_address=None) as cluster:
        yield cluster.scheduler_address


def test_tls_security_from_files(certs):
    sec = tls_security(certs["ca"], certs["cert"], certs["key"])
    assert sec.require_encryption and sec.tls_ca_file == certs["ca"] and sec.tls_client_cert == certs["cert"]
    assert tls_security() is None  # nothing given: the dask config applies
    with pytest.raises(ValueError, match=r"\(missing `key`\)$"):
        tls_security(certs["ca"], certs["cert"])


def test_fit_through_connect_to_tls_scheduler(tls_scheduler, certs, data):
    path, coef = data
    assert tls_scheduler.startswith("tls://127.0.0.1:")
    with connect(tls_scheduler, security=tls_security(certs["ca"], certs["cert"], certs["key"]), quiet=True) as c:
        assert c.scheduler.address.startswith("tls://")
        res = fit(path, client=c, exact_mse=False)
    np.testing.assert_allclose(res.solution.coef, coef, rtol=1e-12, atol=1e-14)


def test_tls_from_dask_config(tls_scheduler, certs, data):
    import dask

    path, coef = data
    cfg = {"distributed.comm.tls.ca-file": certs["ca"], "distributed.comm.tls.client.cert": certs["cert"],
           "distributed.comm.tls.client.key": certs["key"], "distributed.comm.require-encryption": True}
    with dask.config.set(cfg), connect(tls_scheduler, quiet=True) as c:
        res = fit(path, client=c, exact_mse=False)
    np.testing.assert_allclose(res.solution.coef, coef, rtol=1e-12, atol=1e-14)


def test_plain_client_is_refused_by_tls_scheduler(tls_scheduler):
    from distributed import Client

    with pytest.raises(OSError):  # the scheduler resets the connection (CommClosedError) or it times out
        Client(tls_scheduler.replace("tls://", "tcp://"), timeout="3s")


@pytest.mark.slow
def test_cli_fit_with_tls_options(tls_scheduler, certs, data, tmp_path, cli_process):
    import json

    path, coef = data
    p = cli_process("fit", path, "--out", tmp_path / "run", "--scheduler", tls_scheduler, "--tls-ca-file", certs["ca"],
                    "--tls-cert", certs["cert"], "--tls-key", certs["key"], "--json", "--no-exact-mse")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["identifiable"] and rep["psi"] == 6
    from scaleattn.model import MHLAModel

    np.testing.assert_allclose(MHLAModel.load(str(tmp_path / "run" / "model.zarr")).coef, coef, rtol=1e-12,
                               atol=1e-14)


def _listening(pids):
    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
        except psutil.Error:
            continue
        out += [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tls", [True, False])
def test_embedded_cluster_binds_localhost(certs, data, tls):
    """The embedded cluster (with TLS: tls://): scheduler, workers, nannies and dashboard listen on 127.0.0.1
    only; a fit through it gives the same coefficients."""
    import os

    import psutil

    path, coef = data
    proto = "tls"  # without TLS files the embedded cluster uses ephemeral TLS credentials (issue 14)
    before = set(_listening([os.getpid()]))
    sec = tls_security(certs["ca"], certs["cert"], certs["key"]) if tls else None
    with connect(workers=1, security=sec, quiet=True) as c:
        assert c.scheduler.address.startswith(f"{proto}://127.0.0.1:")
        assert c.dashboard_link.startswith("http://127.0.0.1:")
        workers = c.scheduler_info()["workers"]
        assert workers and all(a.startswith(f"{proto}://127.0.0.1:") for a in workers)
        pids = [os.getpid(), *(ch.pid for ch in psutil.Process().children(recursive=True))]
        addrs = [a for a in _listening(pids) if a not in before]
        dash_port = int(c.dashboard_link.split(":")[2].split("/")[0])
        assert dash_port in {a.port for a in addrs}
        assert len(addrs) >= 3 and {a.ip for a in addrs} == {"127.0.0.1"}, addrs
        res = fit(path, client=c, exact_mse=False)
    np.testing.assert_allclose(res.solution.coef, coef, rtol=1e-12, atol=1e-14)
