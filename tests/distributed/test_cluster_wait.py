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


@pytest.mark.slow
def test_unreachable_scheduler_fails_after_the_scheduler_timeout():
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"could not reach the Dask scheduler at tcp://127.0.0.1:9 within 2 s"
                                           r" \(--scheduler-timeout\)") as info:
        with connect("tcp://127.0.0.1:9", scheduler_timeout=2, quiet=True):
            pass
    assert 1.5 <= time.monotonic() - t0 < 20
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_no_worker_fails_after_the_worker_timeout():
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as lc:
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=r"no Dask worker joined the scheduler at tcp://127\.0\.0\.1:\d+ within"
                                               r" 1\.5 s \(--worker-timeout\)") as info:
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
    assert re.fullmatch(r"scaleattn fit: error: could not reach the Dask scheduler at tcp://127\.0\.0\.1:9 within 1 s"
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
