"""Ctrl-C and SIGTERM while the embedded Dask cluster starts: one line, exit 130 / 143, no traceback (from the job
or from a worker process still importing), no worker process left running and nothing written."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _live(pgid: int) -> list[str]:
    """The processes of the job's group still running (zombies left to an init that does not reap aside)."""
    ps = ["ps", "-ww", "-o", "pid=,stat=,args=", "-g", str(pgid)]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split()[1][0] != "Z"]


@pytest.mark.slow
@pytest.mark.parametrize("signum, rc, says", [(signal.SIGINT, 130, "interrupted"),
                                              (signal.SIGTERM, 143, "stopped by SIGTERM")])
@pytest.mark.parametrize("when", ["starting", "importing"])
def test_a_signal_to_the_whole_job_while_its_cluster_starts_is_one_line(causal_ds, tmp_path, signum, rc, says,
                                                                         when):
    """As a terminal's Ctrl-C (or a pod's SIGTERM to every process): the worker processes, still importing, took
    it and printed KeyboardInterrupt tracebacks, and the job's own interrupt left a half-started cluster whose
    atexit close failed (``AssertionError: Status.init``)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "scaleattn.cli", "fit", causal_ds.url, "--out", "run", "--workers",
                          "2", "--no-plots"], cwd=tmp_path, env=env, text=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (not inherited ignored)
    try:
        first = p.stderr.readline()
        assert first.startswith("starting a local Dask cluster"), first
        deadline = time.monotonic() + 60
        while when == "importing" and not any("spawn_main" in ln for ln in _live(p.pid)):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        time.sleep(0.3 if when == "importing" else 0)  # a worker process imports distributed (1-2 s)
        os.killpg(p.pid, signum)
        err = first + p.stderr.read()
        assert p.wait(timeout=120) == rc, err
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "Traceback" not in err and "Error" not in err and "KeyboardInterrupt" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"scaleattn fit: {says}"), err
    assert [ln for ln in lines if ln.startswith("scaleattn fit:")] == lines[-1:], err  # that line, once
    time.sleep(0.5)
    assert _live(p.pid) == [], _live(p.pid)  # the workers were stopped with the job
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no output, no checkpoint, no temporary
