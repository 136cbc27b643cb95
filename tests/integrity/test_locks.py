"""Class 5 of issue 14: two runs never share an output. A fit holds an exclusive lock on its run directory and
its checkpoint (owner host, pid, start time) from before its cluster starts to its end; a second run is
refused naming the first; the lock of a dead process is taken over."""
from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

from scaleattn.errors import OutputInUseError
from scaleattn.store._location import Location
from scaleattn.store._outputs import hold, lock_location

from .conftest import (
    FIT,
    ROOT,
    Inputs,
    dataset,
    error_line,
    expect,
    popen_cli,
    run_cli,
    run_main,
    same_stats,
    stats_of,
    tree_hash,
)

HOLDER = ("import sys, time; from scaleattn.store._outputs import hold; from scaleattn.store._location import resolve\n"
          "with hold(resolve(sys.argv[1]), '--out'):\n    print('held', flush=True); time.sleep(60)\n")


@pytest.fixture
def holder(tmp_path):
    """Start a process holding the lock of a path; yields a function path -> its pid."""
    import subprocess

    procs = []

    def start(path):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout.readline().strip() == "held"
        procs.append(p)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("target", ["out", "checkpoint"])
@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_first(tmp_path, holder, capsys, target):
    dataset(tmp_path / "d.zarr")
    inputs = Inputs(tmp_path / "d.zarr")
    pid = holder(tmp_path / ("run" if target == "out" else "shared.ckpt"))
    extra = ["--checkpoint", "shared.ckpt"] if target == "checkpoint" else []
    rc, err = run_main(["fit", "d.zarr", "--out", "run", "--overwrite", *extra, *FIT], capsys, cwd=tmp_path)
    assert rc == 2
    role = "--out" if target == "out" else "--checkpoint"
    expect(error_line(err), rf"{role} \S+ is in use by the scaleattn run of pid {pid} on host {socket.gethostname()}"
                            r" \(since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\): two runs never share an output")
    assert not (tmp_path / "run").exists() and not (tmp_path / "shared.ckpt").exists()
    inputs.unchanged()


@pytest.mark.parametrize("existing, flags", [("run", []), ("run", ["--resume"]), ("ckpt", []),
                                            ("ckpt", ["--resume"])])
def test_an_existing_output_a_live_run_holds_is_in_use_first(tmp_path, holder, capsys, existing, flags):
    """An existing output (or checkpoint) that a live run holds: "in use by pid", not "already exists (pass
    --overwrite)" or "pass --resume", whose advice would only meet the lock next."""
    dataset(tmp_path / "d.zarr")
    if existing == "run":
        rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
        assert rc == 0, err
    else:
        (tmp_path / "run.checkpoint.zarr").mkdir()
    held = "run" if existing == "run" else "run.checkpoint.zarr"
    before = tree_hash(tmp_path / held)
    pid = holder(tmp_path / held)
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *flags, *FIT], capsys, cwd=tmp_path)
    assert rc == 2
    role = "--out" if existing == "run" else "--checkpoint"
    expect(error_line(err), rf"{role} \S+ is in use by the scaleattn run of pid {pid}")
    assert tree_hash(tmp_path / held) == before


def test_generate_and_import_take_the_lock_too(tmp_path, holder, capsys):
    holder(tmp_path / "d.zarr")
    rc, err = run_main(["generate", "mhla", "d.zarr", "--samples", "4", "--length", "3"], capsys, cwd=tmp_path)
    assert rc == 2 and "is in use by the scaleattn run of pid" in error_line(err)


@pytest.mark.parametrize("held", ["run", "plots"])
def test_plot_is_refused_while_a_fit_holds_the_run_or_the_output(tmp_path, holder, capsys, held):
    """``plot`` reads the run and writes PNGs: never while a fit replaces the run (its PNGs were written into it,
    then lost when the fit's new run took its place) or writes the chosen --out."""
    dataset(tmp_path / "d.zarr")
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    before = tree_hash(tmp_path / "run")
    pid = holder(tmp_path / held)
    rc, err = run_main(["plot", "run", *(["--out", "plots"] if held == "plots" else [])], capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), rf"run \S+ is being written by the scaleattn run of pid {pid}" if held == "run" else
                            rf"--out \S+ is in use by the scaleattn run of pid {pid}")
    assert tree_hash(tmp_path / "run") == before and not (tmp_path / "plots").exists()


FOREIGN_HOLDER = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
                  "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n")


@pytest.mark.parametrize("content, who", [
    ("[1]", "another scaleattn run"),
    ('{"pid": 7, "locked_at": "yesterday"}', "the scaleattn run of pid 7 on host ?"),
    ('{"pid": 7, "host": "a\\nb", "locked_at": 1e300}', "the scaleattn run of pid 7 on host ?"),
    ('{"pid": "7; rm -rf /", "host": "h", "locked_at": NaN}', "the scaleattn run of pid ? on host h"),
    ("[" * 4000, "another scaleattn run"),
], ids=["list", "time-text", "time-huge", "pid-text", "nested"])
def test_a_lock_held_with_any_content_is_one_line_naming_what_it_can(tmp_path, content, who):
    """The lock file is another process's: its JSON was read unchecked, and a list, a text time, a time beyond
    time_t or a document nested too deep were internal errors (AttributeError, TypeError, OverflowError,
    RecursionError) instead of "in use"."""
    import subprocess

    out = Location(str(tmp_path / "run"))
    lock = lock_location(out).url
    with open(lock, "w") as f:
        f.write(content)
    p = subprocess.Popen([sys.executable, "-c", FOREIGN_HOLDER, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(OutputInUseError) as e:
            with hold(out, "--out"):
                pass
    finally:
        p.kill()
        p.wait()
    assert str(e.value) == (f"--out {out.url} is in use by {who}: two runs never share an output; wait for it to"
                            " finish or choose another path")


def test_a_dead_run_s_lock_is_taken_over(tmp_path, capsys):
    dataset(tmp_path / "d.zarr")
    lock = tmp_path / ".run.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 17, "started": 1.0, "locked_at": 1.0}))
    rc, err = run_main(["fit", "d.zarr", "--out", "run", *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err
    assert not lock.exists()  # released at the end


@pytest.mark.slow
def test_two_overwriting_fits_to_one_output_never_mix(tmp_path):
    """The abuse case of the issue: two --overwrite fits of different datasets to one --out at once. The second
    is refused while the first runs; the first's statistics are its own dataset's, bit for bit."""
    dataset(tmp_path / "a.zarr", seed=1)
    dataset(tmp_path / "b.zarr", seed=2)
    assert run_cli(["fit", "a.zarr", "--out", "ref", *FIT], cwd=tmp_path).returncode == 0
    first = popen_cli(["fit", "a.zarr", "--out", "run", "--overwrite", *FIT], cwd=tmp_path,
                      env={"SCALEATTN_TEST_TASK_DELAY": "1"})
    deadline = time.monotonic() + 60
    while not (tmp_path / "run.checkpoint.zarr").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    second = run_cli(["fit", "b.zarr", "--out", "run", "--overwrite", *FIT], cwd=tmp_path)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 2
    expect(error_line(second.stderr), rf"--out \S*run is in use by the scaleattn run of pid {first.pid} on host")
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "ref"))


def test_object_store_locks_are_exclusive_and_stale_ones_taken_over():
    """The same rules on an fsspec store without flock (exclusive create; a dead pid of this host is stale)."""
    import fsspec

    loc = Location("memory://locks/run")
    with hold(loc):
        fs = fsspec.filesystem("memory")
        owner = json.loads(fs.cat(lock_location(loc).url.replace("memory://", "/")))
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert not fs.exists("/locks/.run.lock")
    fs.pipe("/locks/.run.lock", json.dumps({"host": "elsewhere", "pid": 1, "started": 0, "locked_at": 0}).encode())
    with pytest.raises(OutputInUseError, match="pid 1 on host elsewhere.*if that run is gone, remove"):
        with hold(loc):
            pass
    fs.pipe("/locks/.run.lock", json.dumps({"host": socket.gethostname(), "pid": 2**22 + 17, "started": 0,
                                            "locked_at": 0}).encode())
    with hold(loc):  # a process of this host that is gone: its lock is stale
        pass
