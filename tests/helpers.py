"""Shared test machinery: relative errors, the two CLI runners and the small datasets of ``conftest.py``.

Plain functions, so that module-level code (parametrisations, thread pools, module fixtures) can use them too;
``conftest.py`` exposes them as fixtures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys

import numpy as np

__all__ = ["CliResult", "rel_err", "rel_mse", "run_cli", "run_cli_process", "assert_same_stats",
           "solve_arrays", "DATASETS", "write_small_dataset"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (free when this returns)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_err(a, b, ord=None) -> float:
    """``||a - b|| / ||b||`` of the flattened arrays: 2-norm (``ord=None``) or max-abs (``ord=np.inf``)."""
    a, b = np.asarray(a), np.asarray(b)
    if ord is None:
        return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def rel_mse(pred, y) -> float:
    """Mean squared error of ``pred`` relative to the mean square of ``y``."""
    return float(((pred - y) ** 2).mean() / (y ** 2).mean())


@dataclasses.dataclass
class CliResult:
    """What a ``scaleattn`` command returned (the field names of ``subprocess.CompletedProcess``)."""

    argv: list
    returncode: int
    stdout: str
    stderr: str


def _check(r: CliResult, rc) -> CliResult:
    if rc is not None and r.returncode != rc:
        raise AssertionError(f"scaleattn {' '.join(r.argv)}: exit {r.returncode}, expected {rc}\n"
                             f"stdout: {r.stdout}\nstderr: {r.stderr}")
    return r


def run_cli(capture, *args, rc=0) -> CliResult:
    """``scaleattn.cli.main(args)`` in this process; ``capture`` is pytest's ``capfd`` (or ``capsys``).

    Output captured before the call is dropped; ``rc`` is the exit code to assert (``None``: any).
    """
    from scaleattn.cli import main

    argv = [str(a) for a in args]
    capture.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    out, err = capture.readouterr()
    return _check(CliResult(argv, code, out, err), rc)


def run_cli_process(*args, rc=0, cwd=None, env=None, extra_env=None, timeout=300) -> CliResult:
    """``python -m scaleattn.cli args`` as a real process (its own interpreter, signals, exit code).

    ``env`` replaces the environment (default: this process's), ``extra_env`` is added on top.
    """
    argv = [str(a) for a in args]
    p = subprocess.run([sys.executable, "-m", "scaleattn.cli", *argv], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env={**(os.environ if env is None else env), **(extra_env or {})})
    return _check(CliResult(argv, p.returncode, p.stdout, p.stderr), rc)


def assert_same_stats(a, b) -> None:
    """Two ``Statistics`` are equal bit for bit."""
    np.testing.assert_array_equal(a.gram_compact, b.gram_compact)
    np.testing.assert_array_equal(a.moments, b.moments)
    assert a.yy == b.yy and a.n_rows == b.n_rows


def solve_arrays(D):
    """``(statistics, solution)`` of the arrays of a ``generate.make_*`` dict, in process."""
    from scaleattn.linalg._solver import solve
    from scaleattn.statistics._container import statistics_from_arrays

    st = statistics_from_arrays(D["tokens"], D["targets"])
    return st, solve(st)


#: the small datasets shared by the suite: name -> arguments of ``generate.generate_mhla``
DATASETS = {
    # realizable, last token only: psi = 6, 4 row groups
    "last_token": dict(d=2, heads=1, length=12, samples=64, chunk_samples=16, seed=2),
    # realizable, causal (every prefix a row): psi = 6, 960 rows in 6 row groups
    "causal": dict(d=2, heads=1, length=10, samples=96, causal=True, chunk_samples=16, seed=0),
    # realizable, causal, 8 chunks of 8 samples, 16 row groups of 4 (for interrupting and resuming): psi = 18, 640 rows
    "causal_groups": dict(d=3, heads=2, length=10, samples=64, causal=True, chunk_samples=8, seed=1),
    # realizable, causal, variable lengths, d_out != d: psi = 18
    "causal_varlen": dict(d=3, heads=2, length=8, samples=40, d_out=2, causal=True, variable_lengths=True,
                          chunk_samples=16, seed=1),
}


def write_small_dataset(name: str, path):
    """Write the dataset ``DATASETS[name]`` to ``path``; return it opened."""
    from scaleattn.generate import generate_mhla

    return generate_mhla(str(path), **DATASETS[name])


#: dummy credentials: moto accepts any key while its IAM auth is off
S3_KEY, S3_SECRET = "testing-key", "testing-secret"


def s3_env(**extra) -> dict:
    """The environment of a CLI process against a moto server: dummy credentials, no AWS config of this machine,
    no proxy; ``extra`` (``AWS_ENDPOINT_URL=...``, say) on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k.lower() not in (
        "http_proxy", "https_proxy", "all_proxy")}
    env.update(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, NO_PROXY="127.0.0.1,localhost")
    env.update(extra)
    return env


@contextlib.contextmanager
def moto_s3(bucket: str):
    """A real S3 server (moto) on 127.0.0.1 with one empty ``bucket``: yields ``(endpoint, storage_options, fs)``.
    The options make fresh s3fs instances without a listing cache (other processes write the bucket)."""
    import pytest

    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
        opts = {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": endpoint},
                "skip_instance_cache": True, "use_listings_cache": False}
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir(bucket)
        yield endpoint, opts, fs
    finally:
        server.stop()
