"""Classes 6 and 7 of issue 14 (and the cluster side of 8): a remote cluster reads the file the client checked,
and the embedded cluster is not open to other local users.

Remote workers are real ``dask worker`` processes started in their own mount namespace (``unshare -m``), so
that the same absolute path can show them another store, as on another machine."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from scaleattn.data._dataset import open_dataset
from scaleattn.distributed.build import compute_statistics
from scaleattn.errors import IntegrityError

from .conftest import (
    FIT,
    ROOT,
    Inputs,
    dataset,
    error_line,
    expect,
    foreign,
    rows,
    run_cli,
    same_stats,
    stats_of,
    swap_chunk,
)

pytestmark = pytest.mark.slow


# ---- class 7: the embedded cluster ------------------------------------------------------------------------
def test_embedded_cluster_speaks_tls_with_ephemeral_credentials(tmp_path):
    from distributed import Client, Security

    from scaleattn.distributed.cluster import connect
    from scaleattn.pipeline import fit

    ds = dataset(tmp_path / "d.zarr")
    with connect(workers=1, quiet=True) as c:
        assert c.scheduler.address.startswith("tls://127.0.0.1:")
        assert c.dashboard_link.startswith("http://127.0.0.1:")
        assert all(w.startswith("tls://127.0.0.1:") for w in c.scheduler_info()["workers"])
        plain = c.scheduler.address.replace("tls://", "tcp://")
        with pytest.raises((OSError, TimeoutError)):  # another local user without the job's credentials
            Client(plain, timeout="3s")
        with pytest.raises((OSError, TimeoutError)):  # ... or with credentials of their own
            Client(c.scheduler.address, security=Security.temporary(), timeout="3s")
        res = fit(ds, client=c, exact_mse=False)
    ref = fit(ds, exact_mse=False)
    same_stats(res.statistics, ref.statistics)


def test_worker_errors_are_one_line_and_tracebacks_stay_in_worker_logs(tmp_path):
    tok, y = rows()
    tok[21, 2, 1] = np.nan
    foreign(tmp_path / "d.zarr", tok, y)
    inputs = Inputs(tmp_path / "d.zarr")
    r = run_cli(["fit", "d.zarr", "--out", "run", "--workers", "1", "--quiet", "--no-plots"], cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [error_line(r.stderr)], r.stderr  # nothing else at all
    expect(error_line(r.stderr), r"tokens: sample 21 contains NaN or Inf; no checkpoint was kept")
    assert sorted(os.listdir(tmp_path)) == ["d.zarr"]
    inputs.unchanged()


def test_transient_read_errors_are_retried_on_the_workers(tmp_path):
    dataset(tmp_path / "d.zarr")
    assert run_cli(["fit", "d.zarr", "--out", "ref", *FIT], cwd=tmp_path).returncode == 0
    r = run_cli(["fit", "d.zarr", "--out", "run", "--workers", "2", "--quiet", "--no-plots", "--no-exact-mse"],
                cwd=tmp_path, env={"SCALEATTN_TEST_READ_FAILURES": "1"})  # every worker's first read fails
    assert r.returncode == 0, r.stderr
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "ref"))


# ---- class 6: remote workers ------------------------------------------------------------------------------
def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def remote(tmp_path):
    """A scheduler and a function starting one worker in cwd ``where``, optionally with ``bind = (src, dst)``
    mounted in its own namespace. Yields (address, start)."""
    if not _can_unshare():
        pytest.skip("needs unshare -m (root or user namespaces) to give a worker its own view of the files")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sf = tmp_path / "scheduler.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", "0", "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(sf)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    deadline, address = time.monotonic() + 60, None
    while address is None and time.monotonic() < deadline:  # the scheduler creates the file, then writes it
        try:
            address = json.loads(sf.read_text())["address"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    assert address, f"the scheduler wrote no address into {sf} within 60 s"

    def start(where, bind=None):
        cmd = (f"exec {sys.executable} -m distributed.cli.dask_worker {address} --nthreads 1 --no-nanny"
               " --no-dashboard --host 127.0.0.1")
        if bind is not None:
            cmd = f"mount --bind {bind[0]} {bind[1]} && {cmd}"
        procs.append(subprocess.Popen(["unshare", "-m", "sh", "-c", cmd], cwd=where, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client

        with Client(address, timeout="30s") as c:
            c.wait_for_workers(1, timeout=60)

    yield address, start
    for p in procs[::-1]:
        p.kill()
        p.wait()


def test_relative_paths_reach_remote_workers_as_the_client_s_files(tmp_path, remote):
    """The issue's case: a relative path, a worker whose directory holds a same-shaped file of its own."""
    address, start = remote
    client_dir, worker_dir = tmp_path / "client", tmp_path / "worker"
    client_dir.mkdir(), worker_dir.mkdir()
    dataset(client_dir / "d.zarr", seed=1)
    dataset(worker_dir / "d.zarr", seed=2)  # same shape, other numbers
    start(worker_dir)
    assert run_cli(["fit", "d.zarr", "--out", "ref", *FIT], cwd=client_dir).returncode == 0
    r = run_cli(["fit", "d.zarr", "--out", "run", "--scheduler", address, "--quiet", "--no-plots"], cwd=client_dir)
    assert r.returncode == 0, r.stderr
    same_stats(stats_of(client_dir / "run"), stats_of(client_dir / "ref"))


@pytest.mark.parametrize("kind", ["scaleattn", "foreign"])
def test_a_worker_that_sees_another_store_at_the_path_is_refused(tmp_path, remote, kind):
    address, start = remote
    mine, theirs = tmp_path / "d.zarr", tmp_path / "other.zarr"
    if kind == "scaleattn":
        dataset(mine, seed=1), dataset(theirs, seed=2)
    else:
        foreign(mine, *rows(seed=1)), foreign(theirs, *rows(seed=2))
    start(tmp_path, bind=(theirs, mine))  # the worker's machine has another file at the same path
    inputs = Inputs(mine, theirs)
    r = run_cli(["fit", str(mine), "--out", "run", "--scheduler", address, "--quiet", "--no-plots"], cwd=tmp_path)
    assert r.returncode == 2
    expect(error_line(r.stderr), rf"worker tcp://127\.0\.0\.1:\d+ \(host \S+\): {mine} is not the dataset the client"
                                 r" checked \(fingerprint .* here, .* on the client\)")
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.checkpoint.zarr").exists()
    inputs.unchanged()


def test_a_worker_whose_copy_differs_only_inside_is_refused(tmp_path, remote):
    """A store of another tool (no checksums) of raw chunks, and a worker whose copy at the same path differs in
    one middle chunk only: same metadata, keys and sizes, same first and last chunks, so the same fingerprint.
    Its reads are bound to the objects the client listed (size and modification time): one line naming the
    worker, the array and the samples, nothing written. An exact copy (cp -p: the same objects) is read."""
    address, start = remote
    mine, theirs, exact = tmp_path / "d.zarr", tmp_path / "other.zarr", tmp_path / "exact.zarr"
    foreign(mine, *rows(seed=1), compressors=None)
    foreign(tmp_path / "e.zarr", *rows(seed=2), compressors=None)
    shutil.copytree(mine, theirs)
    swap_chunk(tmp_path / "e.zarr", theirs)
    shutil.copytree(mine, exact, copy_function=shutil.copy2)  # sizes and modification times kept
    assert open_dataset(str(theirs)).fingerprint == open_dataset(str(mine)).fingerprint
    start(tmp_path, bind=(theirs, mine))
    inputs = Inputs(mine)
    r = run_cli(["fit", str(mine), "--out", "run", "--scheduler", address, "--quiet", "--no-plots"], cwd=tmp_path)
    assert r.returncode == 2
    expect(error_line(r.stderr), rf"worker tcp://127\.0\.0\.1:\d+ \(host \S+\): tokens: the stored chunks of samples"
                                 rf" \[8, 16\) of {mine} differ from those checked when the job opened it")
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.checkpoint.zarr").exists()
    inputs.unchanged()
    from distributed import Client

    with Client(address, timeout="30s") as c:  # that worker goes; one that sees the exact copy comes
        c.retire_workers(list(c.scheduler_info()["workers"]), close_workers=True)
    start(tmp_path, bind=(exact, mine))
    assert run_cli(["fit", str(mine), "--out", "ref", *FIT], cwd=tmp_path).returncode == 0
    r = run_cli(["fit", str(mine), "--out", "run", "--scheduler", address, "--quiet", "--no-plots"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "ref"))


def test_a_worker_that_cannot_see_the_store_is_named(tmp_path, remote):
    address, start = remote
    dataset(tmp_path / "d.zarr")
    (tmp_path / "empty").mkdir()
    start(tmp_path, bind=(tmp_path / "empty", tmp_path))  # the worker sees nothing at the client's paths
    r = run_cli(["fit", "d.zarr", "--out", "run", "--scheduler", address, "--quiet", "--no-plots"], cwd=tmp_path)
    assert r.returncode == 2
    expect(error_line(r.stderr), rf"worker tcp://127\.0\.0\.1:\d+ \(host \S+\): cannot open the dataset"
                                 rf" {tmp_path}/d\.zarr .*the workers must see the same store as the client")


def test_a_store_replaced_after_the_client_checked_it_is_refused_by_the_workers(tmp_path, client):
    ds = open_dataset(str(dataset(tmp_path / "d.zarr", seed=1).url))
    shutil.rmtree(tmp_path / "d.zarr")
    dataset(tmp_path / "d.zarr", seed=2)
    with pytest.raises(IntegrityError, match=r"worker tcp://\S+ \(host \S+\): \S+d\.zarr is not the dataset the"
                                             r" client checked"):
        compute_statistics(ds, client)
