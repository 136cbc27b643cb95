import pytest


@pytest.fixture(scope="session")
def client():
    """A real 2-worker LocalCluster (processes, localhost only) shared by the tests that need Dask."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        yield c
