"""No store is replaced or deleted while another scaleattn run reads it. A run reading an input (fit, certify,
evaluate) keeps a marker *next to* it (``.NAME.read-*.lock``: host, pid, start; never inside the store), and
every writer that would replace or delete a store (each ``--overwrite``: generate, import, fit's run and
checkpoint, ``save``) refuses while a live reader's marker is there, naming the store and the reader. Markers of
dead readers are ignored (and removed); where no marker can be written (a read-only place) the reader still
runs. A reader that starts while a writer holds the store's lock is refused, naming the writer."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from scaleattn.errors import OutputInUseError
from scaleattn.store._location import Location
from scaleattn.store._outputs import check_unread, reading

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

READER = ("import sys, time; from scaleattn.store import reading, resolve\n"
          "with reading(resolve(sys.argv[1]), 'dataset'):\n    print('reading', flush=True); time.sleep(60)\n")
HOLDER = ("import sys, time; from scaleattn.store import hold, resolve\n"
          "with hold(resolve(sys.argv[1]), 'output'):\n    print('held', flush=True); time.sleep(60)\n")
HOST = re.escape(socket.gethostname())


@pytest.fixture
def start():
    """Start a process reading (``"reading"``) or holding (``"held"``) a path; yields ``start(path, what)`` ->
    the process (killed at the end)."""
    procs = []

    def run(path, what="reading"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.Popen([sys.executable, "-c", READER if what == "reading" else HOLDER, str(path)],
                             stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout.readline().strip() == what
        procs.append(p)
        return p

    yield run
    for p in procs:
        p.kill()
        p.wait()


def _markers(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".read-" in n)


def _hash(root) -> dict:
    """:func:`tree_hash` without readers' markers (a reader of RUN/model.zarr keeps its marker in RUN)."""
    return {k: v for k, v in tree_hash(root).items() if ".read-" not in k}


def _npz(path, seed=0):
    tok = np.random.default_rng(seed).standard_normal((8, 6, 2))
    np.savez(path, tokens=tok, targets=tok[:, :, :2])


def _fit(tmp_path, capsys, data="d.zarr", out="run"):
    rc, err = run_main(["fit", data, "--out", out, *FIT], capsys, cwd=tmp_path)
    assert rc == 0, err


# (id, what is read, the replacing command, the name the refusal gives the store)
WRITERS = [
    ("generate", "d.zarr", ["generate", "mhla", "d.zarr", "--samples", "4", "--length", "3", "--overwrite"], "output"),
    ("generate-assoc", "d.zarr", ["generate", "assoc", "d.zarr", "--samples", "4", "--overwrite"], "output"),
    ("import-npz", "d.zarr", ["import", "d.zarr", "--npz", "a.npz", "--overwrite"], "output"),
    ("fit-out", "run", ["fit", "e.zarr", "--out", "run", "--overwrite", *FIT], "--out"),
    ("fit-out-model", "run/model.zarr", ["fit", "e.zarr", "--out", "run", "--overwrite", *FIT], "--out"),
    ("fit-out-stats", "run/stats.zarr", ["fit", "e.zarr", "--out", "run", "--overwrite", *FIT], "--out"),
]


@pytest.mark.slow
@pytest.mark.parametrize("read,argv,role", [w[1:] for w in WRITERS], ids=[w[0] for w in WRITERS])
def test_overwrite_is_refused_while_another_run_reads_the_store(tmp_path, capsys, start, read, argv, role):
    dataset(tmp_path / "d.zarr")
    dataset(tmp_path / "e.zarr", seed=2)
    _npz(tmp_path / "a.npz")
    _fit(tmp_path, capsys)
    target = tmp_path / argv[argv.index("--out") + 1] if "--out" in argv else tmp_path / "d.zarr"
    before = _hash(target)
    reader = start(tmp_path / read)
    rc, err = run_main(argv, capsys, cwd=tmp_path)
    assert rc == 2, err
    expect(error_line(err), rf"{re.escape(role)} \S*{re.escape(target.name)} .*is being read by the scaleattn run of"
                            rf" pid {reader.pid} on host {HOST} \(since [^)]+\)")
    expect(error_line(err), re.escape(str(tmp_path / read)) if read != target.name else "never replaced")
    assert _hash(target) == before
    reader.kill()
    reader.wait()  # a dead reader's marker no longer counts: the same command now goes through
    rc, err = run_main(argv, capsys, cwd=tmp_path)
    assert rc == 0, err
    assert not _markers(tmp_path) and not _markers(tmp_path / "run")


@pytest.mark.slow
def test_save_and_fit_checkpoint_overwrite_are_refused_too(tmp_path, capsys, start):
    """The library writers (``MHLAModel.save``, ``Statistics.save``) and a fit's ``--checkpoint --overwrite``."""
    from scaleattn.model import MHLAModel
    from scaleattn.statistics._container import Statistics

    dataset(tmp_path / "d.zarr")
    _fit(tmp_path, capsys)
    model, stats = MHLAModel.load(tmp_path / "run/model.zarr"), Statistics.load(tmp_path / "run/stats.zarr")
    model.save(tmp_path / "m.zarr")
    stats.save(tmp_path / "s.zarr")
    for name, save in (("m.zarr", lambda: model.save(tmp_path / "m.zarr", overwrite=True)),
                       ("s.zarr", lambda: stats.save(tmp_path / "s.zarr", overwrite=True))):
        before = tree_hash(tmp_path / name)
        reader = start(tmp_path / name)
        with pytest.raises(OutputInUseError, match=rf"{name} is being read by the scaleattn run of pid {reader.pid}"):
            save()
        assert tree_hash(tmp_path / name) == before
    rc, err = run_main(["fit", "d.zarr", "--out", "run2", "--checkpoint", "ck.zarr", "--keep-checkpoint", *FIT],
                       capsys, cwd=tmp_path)
    assert rc == 0, err
    reader = start(tmp_path / "ck.zarr")
    before = tree_hash(tmp_path / "ck.zarr")
    rc, err = run_main(["fit", "d.zarr", "--out", "run3", "--checkpoint", "ck.zarr", "--overwrite", *FIT], capsys,
                       cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), rf"--checkpoint \S*ck\.zarr is being read by the scaleattn run of pid {reader.pid}")
    assert tree_hash(tmp_path / "ck.zarr") == before and not (tmp_path / "run3").exists()


def test_a_reader_marks_beside_its_input_never_inside(tmp_path, start):
    dataset(tmp_path / "d.zarr")
    inputs = Inputs(tmp_path / "d.zarr")
    reader = start(tmp_path / "d.zarr")
    (marker,) = _markers(tmp_path)
    assert marker.startswith(".d.zarr.read-") and marker.endswith(".lock")
    owner = json.loads((tmp_path / marker).read_text())
    assert owner["pid"] == reader.pid and owner["host"] == socket.gethostname()
    inputs.unchanged()
    reader.terminate()
    reader.wait()
    inputs.unchanged()


def test_the_commands_that_read_keep_their_marker_while_they_run(tmp_path, capsys, monkeypatch):
    """evaluate and fit hold the marker of their dataset while they pass over it, and leave none behind."""
    from scaleattn.distributed import evaluate as ev

    dataset(tmp_path / "d.zarr")
    _fit(tmp_path, capsys)
    seen = []
    real_group_errors = ev.group_errors

    def group_errors(dataset, *a, **k):  # in the middle of the pass over the data
        seen.append(_markers(tmp_path))
        return real_group_errors(dataset, *a, **k)

    monkeypatch.setattr(ev, "group_errors", group_errors)
    for argv in (["evaluate", "run/model.zarr", "d.zarr", "--local", "--quiet"],
                 ["fit", "d.zarr", "--out", "run2", "--local", "--quiet", "--no-plots"]):
        seen.clear()
        rc, err = run_main(argv, capsys, cwd=tmp_path)
        assert rc == 0, err
        assert seen and all(len(m) == 1 and m[0].startswith(".d.zarr.read-") for m in seen), seen
        assert not _markers(tmp_path)


def test_a_read_only_place_needs_no_marker(tmp_path, capsys, monkeypatch):
    """Where nothing can be written next to the input (a read-only mount, bucket or snapshot), the reader runs
    without a marker and says nothing about it."""
    dataset(tmp_path / "d.zarr")
    real_open = os.open

    def read_only(path, flags, *a, **k):
        if ".read-" in os.fspath(path) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    rc, err = run_main(["certify", "d.zarr", "--local", "--quiet"], capsys, cwd=tmp_path)
    assert rc == 0 and not err, err
    _fit(tmp_path, capsys)
    assert not _markers(tmp_path)


@pytest.mark.parametrize("argv", [["generate", "mhla", "d.zarr", "--samples", "4", "--length", "3", "--overwrite"],
                                  ["certify", "d.zarr", "--local", "--quiet"]], ids=["writer", "next-reader"])
def test_a_dead_reader_s_marker_is_ignored_and_removed(tmp_path, capsys, start, argv):
    """By the next writer (which goes ahead) and by the next reader of the store alike."""
    dataset(tmp_path / "d.zarr")
    reader = start(tmp_path / "d.zarr")
    reader.send_signal(signal.SIGKILL)  # no clean-up: its marker stays behind
    reader.wait()
    assert len(_markers(tmp_path)) == 1
    rc, err = run_main(argv, capsys, cwd=tmp_path)
    assert rc == 0, err
    assert not _markers(tmp_path)


@pytest.mark.parametrize("argv", [["generate", "mhla", "d.zarr", "--samples", "4", "--length", "3", "--overwrite"],
                                  ["certify", "d.zarr", "--local", "--quiet"]], ids=["writer", "next-reader"])
def test_a_half_made_marker_of_a_killed_reader_is_removed(tmp_path, capsys, argv):
    """A reader killed between creating its marker (``.partial-lock``) and locking and renaming it leaves the
    half-made marker: once older than ``PARTIAL_S`` and unlocked it goes as a dead reader's marker does; a young
    one is left alone (a live reader locks it microseconds after creating it) and blocks nothing; one that is
    locked is a live reader's."""
    import fcntl

    from scaleattn.store._locks import PARTIAL_S

    dataset(tmp_path / "d.zarr")
    old, young, held = (tmp_path / f".d.zarr.read-{t}.partial-lock" for t in ("0" * 12, "1" * 12, "2" * 12))
    for p in (old, young, held):
        p.write_bytes(b"")
    os.utime(old, (time.time() - 2 * PARTIAL_S,) * 2)
    rc, err = run_main(argv, capsys, cwd=tmp_path)
    assert rc == 0, err
    assert not old.exists() and young.exists() and held.exists()
    fd = os.open(held, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(OutputInUseError, match=r"d\.zarr is being read by"):
            check_unread(Location(str(tmp_path / "d.zarr")))
    finally:
        os.close(fd)


@pytest.mark.parametrize("argv", [["certify", "d.zarr", "--local", "--quiet"], ["fit", "d.zarr", "--out", "run", *FIT],
                                  ["evaluate", "m.zarr", "d.zarr", "--local", "--quiet"]],
                         ids=["certify", "fit", "evaluate"])
def test_a_reader_is_refused_while_a_writer_replaces_its_input(tmp_path, capsys, start, argv):
    dataset(tmp_path / "d.zarr")
    from scaleattn.model import MHLAModel

    MHLAModel(np.zeros((6, 2)), np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), 2, causal=True).save(tmp_path / "m.zarr")
    holder = start(tmp_path / "d.zarr", "held")
    rc, err = run_main(argv, capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), rf"dataset \S*d\.zarr is being written by the scaleattn run of pid {holder.pid} on host"
                            rf" {HOST}")
    assert not _markers(tmp_path) and not (tmp_path / "run").exists()


def test_object_store_markers(tmp_path):
    """The same rules where there is no flock (an fsspec store): a live reader of another host is refused with the
    marker to remove once it is gone; a dead pid of this host is stale."""
    import fsspec

    fs = fsspec.filesystem("memory")
    loc = Location("memory://readers/d.zarr")
    fs.pipe("/readers/d.zarr/zarr.json", b"{}")
    try:
        with reading(loc, "dataset"):
            (marker,) = [p for p in fs.ls("/readers", detail=False) if ".read-" in p]
            assert json.loads(fs.cat(marker))["pid"] == os.getpid()
            # (this process's own marker: another process's check would refuse; this one names the reader too)
            with pytest.raises(OutputInUseError, match=rf"is being read by the scaleattn run of pid {os.getpid()}"):
                check_unread(loc)
        assert not [p for p in fs.ls("/readers", detail=False) if ".read-" in p]
        fs.pipe("/readers/.d.zarr.read-0123456789ab.lock",
                json.dumps({"host": "elsewhere", "pid": 1, "started": 0, "locked_at": 0}).encode())
        with pytest.raises(OutputInUseError, match=r"pid 1 on host elsewhere.*if that run is gone, remove"
                                                   r" memory://readers/\.d\.zarr\.read-0123456789ab\.lock"):
            check_unread(loc, "output")
        fs.pipe("/readers/.d.zarr.read-0123456789ab.lock",
                json.dumps({"host": socket.gethostname(), "pid": 2**22 + 17, "started": 0, "locked_at": 0}).encode())
        check_unread(loc, "output")  # a process of this host that is gone: stale, and removed
        assert not fs.exists("/readers/.d.zarr.read-0123456789ab.lock")
    finally:
        fs.rm("/readers", recursive=True)


@pytest.mark.slow
def test_generate_overwrite_never_replaces_the_dataset_a_fit_reads(tmp_path):
    """The abuse case: ``generate --overwrite`` of the dataset a running fit reads is refused naming the fit; the
    fit's statistics are those of the data it started on, bit for bit."""
    dataset(tmp_path / "d.zarr")
    assert run_cli(["fit", "d.zarr", "--out", "ref", *FIT], cwd=tmp_path).returncode == 0
    before = tree_hash(tmp_path / "d.zarr")
    fit = popen_cli(["fit", "d.zarr", "--out", "run", *FIT], cwd=tmp_path, env={"SCALEATTN_TEST_TASK_DELAY": "1"})
    deadline = time.monotonic() + 60
    while not (tmp_path / "run.checkpoint.zarr").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    gen = run_cli(["generate", "mhla", "d.zarr", "--samples", "4", "--length", "3", "--overwrite"], cwd=tmp_path)
    out, err = fit.communicate(timeout=120)
    assert fit.returncode == 0, err
    assert gen.returncode == 2, gen.stderr
    expect(error_line(gen.stderr), rf"output \S*d\.zarr is being read by the scaleattn run of pid {fit.pid} on host"
                                   rf" {HOST}")
    assert tree_hash(tmp_path / "d.zarr") == before
    same_stats(stats_of(tmp_path / "run"), stats_of(tmp_path / "ref"))
    assert not _markers(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["link", "local-url", "partial-name"])
def test_every_name_of_the_store_is_protected(tmp_path, capsys, start, spelling):
    """The store a reader reads is protected whatever name reaches it, and a writer through any name is seen by
    a reader: a symbolic link to the dataset, fsspec's ``local://`` spelling of its path (it went through the
    object-store branch: no flock, and a replaced output was deleted before the new one failed to write), a
    store whose own name contains ``.partial-`` (its markers were taken for temporaries and never counted)."""
    name = "my.partial-results.zarr" if spelling == "partial-name" else "d.zarr"
    dataset(tmp_path / name)
    if spelling == "link":
        os.symlink(tmp_path / name, tmp_path / "link.zarr")
    read = {"link": str(tmp_path / "link.zarr"), "local-url": f"local://{tmp_path / name}",
            "partial-name": str(tmp_path / name)}[spelling]
    before = _hash(tmp_path / name)
    reader = start(read)
    gen = ["generate", "mhla", str(tmp_path / name), "--d", "2", "--heads", "1", "--length", "6", "--samples", "32",
           "--causal", "--seed", "7", "--overwrite"]
    rc, err = run_main(gen, capsys, cwd=tmp_path)
    assert rc == 2, err
    expect(error_line(err), rf"is being read by the scaleattn run of pid {reader.pid} on host {HOST}")
    assert _hash(tmp_path / name) == before
    reader.kill()
    reader.wait()
    writer = start(tmp_path / name, "held")  # and a reader through that name waits for no writer: refused
    rc, err = run_main(["certify", read], capsys, cwd=tmp_path)
    assert rc == 2, err
    expect(error_line(err), rf"is being written by the scaleattn run of pid {writer.pid} on host {HOST}")
    writer.kill()
    writer.wait()
    rc, err = run_main([*gen[:2], f"local://{tmp_path / name}", *gen[3:]], capsys, cwd=tmp_path)
    assert rc == 0, err  # local:// is a local path: replaced in place of the old one, never lost
    assert _hash(tmp_path / name) != before and (tmp_path / name / "zarr.json").exists()


def test_a_store_directly_under_the_root_has_a_place_for_its_markers():
    """``/data.zarr`` (common in containers) has ``/`` next to it; only ``/`` itself has no parent."""
    from scaleattn.store._location import Location
    from scaleattn.store._locks import _parent

    assert _parent(Location("/data.zarr")) == Location("/")
    assert _parent(Location("/")) is None


@pytest.mark.slow
def test_a_dataset_inside_another_store_is_read_without_writing_into_that_store(tmp_path, capsys):
    """A dataset that is a subgroup of another Zarr store (``outer.zarr/ds``): the place next to it is inside
    that store, so the reader leaves no marker there (it wrote ``outer.zarr/.ds.read-*.lock``)."""
    import shutil

    dataset(tmp_path / "d.zarr")
    outer = zarr.open_group(str(tmp_path / "outer.zarr"), mode="w", zarr_format=3)
    outer.attrs["what"] = "another tool's store"
    shutil.copytree(tmp_path / "d.zarr", tmp_path / "outer.zarr" / "ds")
    before = tree_hash(tmp_path / "outer.zarr")
    from scaleattn.store._location import resolve
    from scaleattn.store._locks import reading

    with reading(resolve(tmp_path / "outer.zarr" / "ds"), "dataset"):
        assert tree_hash(tmp_path / "outer.zarr") == before
    rc, err = run_main(["certify", str(tmp_path / "outer.zarr" / "ds")], capsys)
    assert rc == 0, err
    assert tree_hash(tmp_path / "outer.zarr") == before


def test_a_store_whose_name_extends_another_s_is_not_taken_for_it(tmp_path, capsys, start):
    """A live reader of ``x.zarr.read-old.zarr`` (its marker ``.x.zarr.read-old.zarr.read-TOKEN.lock``) is not a
    reader of ``x.zarr``: replacing ``x.zarr`` goes through, and the other store stays protected."""
    dataset(tmp_path / "x.zarr")
    dataset(tmp_path / "x.zarr.read-old.zarr", seed=2)
    reader = start(tmp_path / "x.zarr.read-old.zarr")
    gen = ["generate", "mhla", "--d", "2", "--heads", "1", "--length", "6", "--samples", "32", "--causal",
           "--overwrite"]
    rc, err = run_main([*gen[:2], str(tmp_path / "x.zarr"), *gen[2:]], capsys)
    assert rc == 0, err
    rc, err = run_main([*gen[:2], str(tmp_path / "x.zarr.read-old.zarr"), *gen[2:]], capsys)
    assert rc == 2, err
    expect(error_line(err), rf"x\.zarr\.read-old\.zarr is being read by the scaleattn run of pid {reader.pid}")


@pytest.mark.slow
def test_plot_marks_the_dataset_it_reads_for_its_predictions(tmp_path, capsys, monkeypatch, start):
    """plot read the report's dataset (or --dataset) for the predictions without a marker: the dataset could be
    replaced under it. It keeps one while it reads, as fit and evaluate do, and is refused while a run writes it."""
    from scaleattn import plot

    dataset(tmp_path / "d.zarr")
    _fit(tmp_path, capsys)
    seen = []
    real = plot.sample_predictions

    def sample_predictions(*a, **k):
        seen.append(_markers(tmp_path))
        return real(*a, **k)

    monkeypatch.setattr(plot, "sample_predictions", sample_predictions)
    for argv in (["plot", "run", "--out", "figs"], ["plot", "run", "--out", "figs2", "--dataset", "d.zarr"]):
        seen.clear()
        rc, err = run_main(argv, capsys, cwd=tmp_path)
        assert rc == 0, err
        assert seen and all(any(m.startswith(".d.zarr.read-") for m in ms) for ms in seen), seen
        assert not [m for m in _markers(tmp_path) if m.startswith(".d.zarr")]
    start(tmp_path / "d.zarr", "held")
    rc, err = run_main(["plot", "run", "--out", "figs3"], capsys, cwd=tmp_path)
    assert rc == 2
    expect(error_line(err), r"d\.zarr")
    assert not (tmp_path / "figs3").exists()
