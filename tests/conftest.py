"""Fixtures shared by the whole suite (the functions behind them are in ``tests/helpers.py``).

- ``client``: a real 2-worker LocalCluster (processes, localhost only), one per session.
- ``cli``: ``scaleattn.cli.main`` in this process with captured output: ``cli("fit", ..., rc=0)``.
- ``cli_process``: ``python -m scaleattn.cli`` as a real process, for what needs one (exit codes of a killed
  process, a clean environment, start-up).
- ``rel_err``, ``rel_mse``: relative errors against an independent reference.
- ``noisy_causal_arrays``: in-memory noisy causal MHLA arrays (d = 4, psi = 40) for the statistics, kernel and
  solver tests.
- ``last_token_ds``, ``causal_ds``, ``causal_groups_ds``, ``causal_varlen_ds``: small realizable datasets
  (``helpers.DATASETS``), written once per session; read them, never write into them.
"""
import os
import pathlib
import sys

import pytest

#: the test hooks (tests/inject/scaleattn_hooks.py), installed from outside the package: here, and through its
#: sitecustomize in every Python process the tests start (CLI runs, Dask workers), configured by environment
#: variables (SCALEATTN_TEST_STOP_AFTER_GROUPS, SCALEATTN_TEST_PAUSE)
INJECT = str(pathlib.Path(__file__).resolve().parent / "inject")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (INJECT, os.environ.get("PYTHONPATH")) if p)
sys.path.insert(0, INJECT)
import scaleattn_hooks  # noqa: E402

scaleattn_hooks.install()

from tests import helpers  # noqa: E402


@pytest.fixture(scope="session")
def client():
    """A real 2-worker LocalCluster (processes, localhost only) shared by the tests that need Dask."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        yield c


@pytest.fixture
def cli(capfd):
    """Run ``scaleattn ARGS`` in this process: ``cli(*args, rc=0) -> CliResult`` (``rc=None``: any exit code)."""
    return lambda *args, rc=0: helpers.run_cli(capfd, *args, rc=rc)


@pytest.fixture(scope="session")
def cli_process():
    """Run ``python -m scaleattn.cli ARGS`` as a process: ``cli_process(*args, rc=0, cwd=, env=, extra_env=)``."""
    return helpers.run_cli_process


@pytest.fixture(scope="session")
def rel_err():
    """``rel_err(a, b, ord=None)``: ``||a - b|| / ||b||`` (2-norm, or max-abs with ``ord=np.inf``)."""
    return helpers.rel_err


@pytest.fixture(scope="session")
def rel_mse():
    """``rel_mse(pred, y)``: mean squared error relative to the mean square of ``y``."""
    return helpers.rel_mse


@pytest.fixture(scope="session")
def datasets_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("datasets")


@pytest.fixture(scope="session")
def last_token_ds(datasets_dir):
    """Realizable last-token MHLA data: d = 2, one head, N = 64, T = 12."""
    return helpers.write_small_dataset("last_token", datasets_dir / "last_token.zarr")


@pytest.fixture(scope="session")
def causal_ds(datasets_dir):
    """Realizable causal MHLA data: d = 2, one head, N = 96, T = 10 (960 rows), chunks of 16 samples."""
    return helpers.write_small_dataset("causal", datasets_dir / "causal.zarr")


@pytest.fixture(scope="session")
def causal_groups_ds(datasets_dir):
    """Realizable causal MHLA data in 16 row groups: d = 3, two heads, N = 64, T = 10, chunks of 8 samples."""
    return helpers.write_small_dataset("causal_groups", datasets_dir / "causal_groups.zarr")


@pytest.fixture(scope="session")
def causal_varlen_ds(datasets_dir):
    """Realizable causal MHLA data with variable lengths: d = 3, two heads, d_out = 2, N = 40, T = 8."""
    return helpers.write_small_dataset("causal_varlen", datasets_dir / "causal_varlen.zarr")


@pytest.fixture(scope="session")
def noisy_causal_arrays():
    """Noisy causal MHLA arrays (``generate.make_mhla``): d = 4, two heads, N = 60, T = 12; do not modify."""
    from scaleattn.generate import make_mhla

    return make_mhla(d=4, heads=2, length=12, samples=60, causal=True, noise=0.05, seed=3)


def pytest_collection_modifyitems(config, items):
    """Slow tests first (stable otherwise): under ``pytest -n`` (pytest-xdist) the long ones then start early on
    every worker and the short ones fill the gaps, instead of one worker finishing a 3-minute test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
