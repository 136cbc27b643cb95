"""Progress of long steps: rich bars on stderr in a captured CLI run with a real LocalCluster, and the Dask
progress widget in notebooks, both driven by the job's own client and futures, never default_client()."""
import json
import time

import pytest
from distributed import Client, LocalCluster, default_client

import scaleattn.cluster as cluster
from scaleattn import generate
from scaleattn.cli import main
from scaleattn.statistics import compute_statistics, row_groups


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return generate.generate_mhla(str(tmp_path_factory.mktemp("prog") / "d.zarr"), d=2, heads=1, length=10,
                                  samples=96, causal=True, chunk_samples=16, seed=0)


def test_cli_fit_shows_dashboard_and_bars(ds, tmp_path, capfd):
    n = len(row_groups(ds))
    assert n > 1
    assert main(["fit", ds.url, "--out", str(tmp_path / "run"), "--workers", "1", "--no-plots"]) == 0
    out, err = capfd.readouterr()
    assert "dashboard http://127.0.0.1:" in err  # the link is printed when the cluster starts
    lines = err.splitlines()
    assert any(ln.startswith("statistics") and f"{n}/{n}" in ln for ln in lines), err
    assert any(ln.startswith("evaluate") and f"{n}/{n}" in ln for ln in lines), err
    assert any(ln.startswith("solve (psi 6) and heads (svd): done in") for ln in lines), err
    assert "statistics" not in out and "certificate: IDENTIFIABLE" in out  # bars on stderr, summary on stdout


def test_cli_json_and_quiet_are_clean(ds, tmp_path, capfd):
    assert main(["fit", ds.url, "--out", str(tmp_path / "a"), "--local", "--json", "--no-plots"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["n_rows"] == 960 and "statistics" not in err
    assert main(["fit", ds.url, "--out", str(tmp_path / "b"), "--local", "--quiet", "--no-plots"]) == 0
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.fixture(scope="module")
def two_clients():
    """The job's client (a real process LocalCluster via connect) and, created after it, another client that
    is the default one."""
    with cluster.connect(workers=1, quiet=True) as job:
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as lc, Client(lc) as other:
            assert default_client() is other and default_client() is not job
            yield job, other


def _n_prefixes(client):
    return client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.task_prefixes))


def test_progress_uses_the_job_client_not_the_default(ds, two_clients, capfd):
    job, other = two_clients
    before = _n_prefixes(other)
    st = compute_statistics(ds, job, progress=True)
    assert st.n_rows == 960
    err = capfd.readouterr().err
    n = len(row_groups(ds))
    assert f"{n}/{n}" in err and "statistics" in err
    assert _n_prefixes(job) > 0 and _n_prefixes(other) == before  # nothing ran on the default client


def test_notebook_widget_bound_to_job_client(two_clients, monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    job, other = two_clients
    seen = []
    real = cluster.notebook_progress

    def spy(futures, description=""):
        w = real(futures, description)
        seen.append(w)
        return w

    monkeypatch.setattr(cluster, "_in_notebook", lambda: True)
    monkeypatch.setattr(cluster, "notebook_progress", spy)
    futs = [job.submit(time.sleep, 0.05, key=f"nap-{i}", pure=False) for i in range(6)]
    cluster.wait_with_progress(futs, "statistics")
    (w,) = seen
    assert w.scheduler == job.scheduler.address != other.scheduler.address
    assert w.status == "finished" and w.bar.value == 1.0 and "6 / 6" in w.bar_text.value
    assert "statistics: 6/6 tasks" in capsys.readouterr().out


def test_wait_with_progress_reraises_task_error(two_clients):
    job, _ = two_clients

    def boom():
        raise ValueError("tokens: sample 7 contains NaN or Inf")

    with pytest.raises(ValueError, match="sample 7"):
        cluster.wait_with_progress([job.submit(boom, pure=False)], "statistics", enabled=True)
