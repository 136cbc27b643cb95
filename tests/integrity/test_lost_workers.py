"""A cluster that loses its workers never makes a fit wait for ever: workers killed under their tasks (the kernel's
OOM killer's SIGKILL, the nanny ending a worker past its Dask memory limit), a remote scheduler whose workers all
leave. Each ends with exit 2 and one line that says what happened (the memory limit, what a task holds, what to
change), the checkpoint kept for ``--resume``, which then gives the statistics of an uninterrupted fit."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from scaleattn.distributed import reduction
from scaleattn.errors import ClusterError

from .conftest import ROOT, dataset, error_line, expect, same_stats, stats_of

GIB = 2.0**30


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PYTHONWARNINGS": "ignore", **extra}


def _fit(cwd, *args, timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scaleattn", "fit", "d.zarr", "--out", "run", "--no-plots",
                           "--no-exact-mse", *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 12], ids=["every-group", "from-group-12"])
def test_workers_killed_under_their_tasks_end_the_fit_with_one_line(tmp_path, first):
    """As the kernel's OOM killer: every task (from row group 12 on) SIGKILLs its worker. The nanny restarts it,
    distributed counts the deaths (``allowed-failures``) and fails the task; placed on a worker that died, a task
    waited for ever (``no-worker``). Groups finished before stay in the checkpoint and ``--resume`` completes the
    fit with the statistics of a fit that never failed."""
    dataset(tmp_path / "d.zarr")
    t0 = time.monotonic()
    p = _fit(tmp_path, "--workers", "2", SCALEATTN_TEST_TASK_KILL=f"KILL@{first}")
    assert p.returncode == 2, p.stderr
    assert time.monotonic() - t0 < 200
    line = error_line(p.stderr)
    allowed = 3  # distributed's default allowed-failures: a task fails on the 4th death of its workers
    deaths = int(re.search(r"died under it (\d+) times", line).group(1))
    assert deaths >= allowed + 1 or line.startswith("scaleattn fit: error: the Dask cluster has had no live worker")
    expect(line, r"the Dask workers running a statistics task died under it \d+ times \(as a worker past"
                 r" its memory limit of [\d.]+ GiB \(its nanny ends it at 95% of it: [\d.]+ GiB\) is ended, or by the"
                 r" kernel's OOM killer\); a statistics task holds about [\d.]+ GiB: give each worker more memory"
                 r" \(fewer --workers on this machine")
    if first == 0:
        expect(line, r"; no checkpoint was kept$")
        assert sorted(os.listdir(tmp_path)) == ["d.zarr"]
        return
    kept = int(re.search(r"keeps (\d+) of 16 row groups: repeat the fit with --resume", line).group(1))
    assert 1 <= kept <= first  # (groups 12-15 never finish; of the others, those done before the failure)
    p = _fit(tmp_path, "--workers", "2", "--resume")
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "scaleattn", "fit", "d.zarr", "--out", "fresh", "--local", "--quiet",
                        "--no-plots", "--no-exact-mse"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "fresh"))


@pytest.mark.slow
def test_a_worker_past_its_dask_memory_limit_is_named_with_the_limit(tmp_path):
    """The nanny ends a worker whose memory passes ``terminate`` x its limit (2% here, of a LocalCluster's share
    of the machine: about 0.24 GiB on a 24 GiB machine with 2 workers), and every task allocates 400 MB: the line
    gives the limit and the nanny's threshold, as distributed computes them for 2 workers."""
    from distributed.system import MEMORY_LIMIT

    dataset(tmp_path / "d.zarr")
    p = _fit(tmp_path, "--workers", "2", DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE="0.02",
             SCALEATTN_TEST_TASK_MEMORY="4e8")
    assert p.returncode == 2, p.stderr
    line = error_line(p.stderr)
    limit = MEMORY_LIMIT / 2  # distributed's "auto": the machine's memory (or cgroup limit) over the workers
    expect(line, rf"memory limit of {limit / GIB:.2f} GiB \(its nanny ends it at 2% of it: {0.02 * limit / GIB:.2f}"
                 r" GiB\)")


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["config", "option"])
def test_a_remote_cluster_whose_workers_all_leave_ends_the_fit(tmp_path, monkeypatch, bound):
    """A scheduler of the user's (no ``no-workers-timeout`` of its own): once its last worker leaves, the fit
    waits ``distributed.scheduler.no-workers-timeout`` (3 s, from the environment) or ``--worker-timeout`` (4 s),
    then says so; the groups finished are kept and ``--resume`` on a cluster with workers again completes the
    fit, bit for bit."""
    import dask
    from distributed import LocalCluster

    dataset(tmp_path / "d.zarr")
    monkeypatch.setenv("SCALEATTN_TEST_TASK_DELAY", "1")  # (the worker is a thread of this process)
    with dask.config.set({"distributed.scheduler.no-workers-timeout": None}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None,
                         protocol="tcp") as cluster:
        p = subprocess.Popen([sys.executable, "-m", "scaleattn", "fit", "d.zarr", "--out", "run", "--no-plots",
                              "--no-exact-mse", "--scheduler", cluster.scheduler_address,
                              *(["--worker-timeout", "4"] if bound == "option" else [])], cwd=tmp_path,
                             env=_env(**({"DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT": "3s"}
                                         if bound == "config" else {})), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            ckpt = tmp_path / "run.checkpoint.zarr"
            while not (ckpt / "done" / "c" / "2" / "0").exists():  # three groups done
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()
                time.sleep(0.05)
            cluster.scale(0)
            t0 = time.monotonic()
            out, err = p.communicate(timeout=120)
            waited = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 2, err
        bounded = 3 if bound == "config" else 4
        assert bounded <= waited < 60, waited
        line = error_line(err)
        expect(line, rf"scaleattn fit: error: the Dask cluster has had no live worker for {bounded} s"
                     r" \(--worker-timeout, or `distributed.scheduler.no-workers-timeout` in the dask config, sets"
                     r" how long to wait\)")
        kept = int(re.search(r"keeps (\d+) of 16 row groups: repeat the fit with --resume", line).group(1))
        assert kept >= 3
        cluster.scale(1)
        monkeypatch.delenv("SCALEATTN_TEST_TASK_DELAY")
        p = subprocess.run([sys.executable, "-m", "scaleattn", "fit", "d.zarr", "--out", "run", "--no-plots",
                            "--no-exact-mse", "--scheduler", cluster.scheduler_address, "--resume"], cwd=tmp_path,
                           env=_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "scaleattn", "fit", "d.zarr", "--out", "fresh", "--local", "--quiet",
                        "--no-plots", "--no-exact-mse"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "fresh"))


class _Scheduler:
    """A client whose scheduler reports ``workers`` live workers and nothing else."""

    def __init__(self, workers):
        self.workers = workers

    def run_on_scheduler(self, fn, keys):
        return {"workers": self.workers, "limits": [2 * GIB], "deaths": 0, "stuck": 0}


@pytest.mark.slow
def test_the_wait_without_workers_is_bounded_by_dask_s_own_setting():
    """No live worker for ``no-workers-timeout`` seconds (dask's config; 60 s without one) is a ClusterError that
    says how long it waited and where that is set; a worker that comes back meanwhile resets the clock."""
    import dask

    with dask.config.set({"distributed.scheduler.no-workers-timeout": None}):
        assert reduction.no_worker_timeout() == reduction.NO_WORKER_S == 60.0
    with dask.config.set({"distributed.scheduler.no-workers-timeout": "1500ms"}):
        client = _Scheduler(0)
        watch = reduction._Watch(client, ["k"])
        t0 = time.monotonic()
        with pytest.raises(reduction._NoWorker) as info:
            while True:
                client.workers = 1 if time.monotonic() - t0 < 1.2 else 0  # back for a while, then gone
                watch.check()
                time.sleep(0.05)
        assert 1.2 + 1.5 <= time.monotonic() - t0 < 6
        e = watch.lost(info.value, "a statistics task", 0.5 * GIB)
    assert isinstance(e, ClusterError)
    assert str(e).startswith("the Dask cluster has had no live worker for 1.5 s (`worker_timeout`, or `distributed."
                             "scheduler.no-workers-timeout` in the dask config, sets how long to wait); a statistics"
                             " task holds about 0.50 GiB: give each worker more memory")
    assert watch.lost(RuntimeError("a bug"), "a task", None) is None

