"""A full disk, a quota, a read-only file system or a refused permission on every write path (the checkpoint, as
it is created and as the workers write their partials; the run directory; generate; import; plot; the locks) is
one line naming the path, exit 2, and what was kept: never "internal error (this is a bug)". Injected at the
lowest write each path makes (zarr's file write, ``open``, ``os.open``), and for real on a tiny tmpfs and a
read-only mount in a private mount namespace where the machine allows one (``unshare``)."""
from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from .conftest import FIT, ROOT, dataset, error_line, expect, run_main, same_stats, stats_of

#: what each kind of refusal looks like where it happens: a write() names no path, an open() does
REFUSALS = {errno.ENOSPC: False, errno.EDQUOT: False, errno.EROFS: True, errno.EACCES: True}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A dataset (16 row groups), an npz to import and a finished run to plot."""
    base = tmp_path_factory.mktemp("full-disk")
    dataset(base / "d.zarr")
    rng = np.random.default_rng(0)
    np.savez(base / "a.npz", tokens=rng.standard_normal((8, 4, 2)), targets=rng.standard_normal((8, 2)))
    from scaleattn.cli import main

    assert main(["fit", str(base / "d.zarr"), "--out", str(base / "run0"), "--local", "--quiet",
                 "--no-exact-mse"]) == 0
    return base


@pytest.fixture
def place(inputs, tmp_path):
    """A working directory holding links to the inputs (the outputs go next to them, in ``tmp_path``)."""
    for name in ("d.zarr", "a.npz", "run0"):
        os.symlink(inputs / name, tmp_path / name)
    return tmp_path


def refuse(monkeypatch, where: str, code: int) -> list[str]:
    """Make every write to a path containing ``where`` fail with ``code`` (with the path where the refusal comes
    from an open, without where from a write); returns the paths refused."""
    import zarr.storage._local as local

    hit = []
    named = REFUSALS[code]

    def error(path):
        hit.append(str(path))
        return OSError(code, os.strerror(code), *([str(path)] if named else []))

    real_put, real_open, real_os_open = local._put, builtins.open, os.open

    def put(path, value, exclusive=False):
        if where in str(path):
            raise error(path)
        return real_put(path, value, exclusive)

    def open_(file, mode="r", *args, **kwargs):
        if where in str(file) and any(c in mode for c in "wax+"):
            raise error(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if where in str(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise error(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local, "_put", put)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    return hit


def outputs(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n not in ("d.zarr", "a.npz", "run0"))


#: (command, the write refused, the path the line names, what it says was kept, what is left)
CASES = {
    "checkpoint created": (["fit", "d.zarr", "--out", "r", *FIT], "r.checkpoint.zarr/zarr.json",
                           "the checkpoint {}/r.checkpoint.zarr", "", []),
    "first partial": (["fit", "d.zarr", "--out", "r", *FIT], "checkpoint.zarr/gram_compact/c",
                      "the checkpoint {}/r.checkpoint.zarr", "; no checkpoint was kept", []),
    "a later partial": (["fit", "d.zarr", "--out", "r", *FIT], "checkpoint.zarr/done/c/3/",
                        "the checkpoint {}/r.checkpoint.zarr",
                        r"; the checkpoint \S+ keeps 3 of 16 row groups: repeat the fit with --resume",
                        ["r.checkpoint.zarr"]),
    "run directory": (["fit", "d.zarr", "--out", "r", *FIT], "/report.json", "output {}/r",
                      r"; nothing of it was written .*; the checkpoint \S+ keeps all row groups",
                      ["r.checkpoint.zarr"]),
    "model store": (["fit", "d.zarr", "--out", "r", *FIT], "model.zarr.partial-", "output {}/", "nothing of it",
                    ["r.checkpoint.zarr"]),
    "run lock": (["fit", "d.zarr", "--out", "r", *FIT], ".r.lock", "--out {}/r", "", []),
    "generate": (["generate", "mhla", "g.zarr", "--samples", "8", "--length", "3"], "tokens/c",
                 "output {}/g.zarr", "; nothing of it was written", []),
    "import": (["import", "i.zarr", "--npz", "a.npz"], "targets/zarr.json", "output {}/i.zarr",
               "; nothing of it was written", []),
    "plot": (["plot", "run0", "--out", "pl"], ".png", "the files into {}/pl", "; no file there was replaced", []),
}


@pytest.mark.parametrize("code", list(REFUSALS), ids=errno.errorcode.get)
@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_write_is_one_line_naming_the_path(case, code, place, capsys, monkeypatch):
    if code == errno.EACCES and case == "run directory":
        pytest.skip("a refused permission on report.json is the local file system's access error (its own line)")
    argv, where, names, kept, left = CASES[case]
    hit = refuse(monkeypatch, where, code)
    rc, err = run_main(argv, capsys, cwd=place)
    monkeypatch.undo()
    assert hit, f"nothing wrote to {where!r}"
    assert rc == 2, err
    line = error_line(err)
    assert "internal error" not in line
    expect(line, "cannot write " + names.format(place).replace(".", r"\.") + r".*" + os.strerror(code))
    expect(line, kept)
    assert outputs(place) == left


def test_a_full_disk_while_the_workers_write_the_checkpoint_keeps_it_and_resume_is_bit_identical(
        place, capsys, monkeypatch):
    """The partials are written by the Dask workers (threads of this process here, so the injection reaches
    them): their StorageError reaches the client as itself (it became "Exception: StorageError(...)", a bug, on
    the way through distributed's pickling), the finished groups stay in the checkpoint, and ``--resume`` once
    there is room again gives the statistics of an uninterrupted fit, bit for bit."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None,
                      protocol="tcp") as cluster:
        argv = ["fit", "d.zarr", "--out", "r", "--scheduler", cluster.scheduler_address, "--quiet", "--no-plots",
                "--no-exact-mse"]
        refuse(monkeypatch, "checkpoint.zarr/n_rows/c/5/", errno.ENOSPC)
        rc, err = run_main(argv, capsys, cwd=place)
        monkeypatch.undo()
        assert rc == 2, err
        expect(error_line(err), r"cannot write the checkpoint \S+r\.checkpoint\.zarr: No space left on device; the"
                                r" checkpoint \S+ keeps \d+ of 16 row groups: repeat the fit with --resume")
        rc, err = run_main([*argv, "--resume"], capsys, cwd=place)
        assert rc == 0, err
    same_stats(stats_of(place / "r"), stats_of(place / "run0"))


def test_a_refusal_no_layer_named_is_still_one_line_not_a_bug(tmp_path, capsys, monkeypatch):
    """The command line's last word on the file system: a full disk or a read-only file system anywhere (here a
    removal no layer wraps) is exit 2 and one line; an OSError of another kind (a missing file) stays a bug."""
    from scaleattn.cli import commands

    for e, rc, pattern in [
        (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), 2, r"cannot write: Disk quota exceeded \(the file system"
                                                              r" refused a write\); nothing was written"),
        (OSError(errno.EROFS, os.strerror(errno.EROFS), "/x/y.zarr"), 2, r"cannot write: /x/y\.zarr: Read-only"),
        (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/x/z"), 2, r"cannot write: /x/z: Permission"),
        (PermissionError(errno.EACCES, os.strerror(errno.EACCES)), 1, r"internal error"),  # (no path: whose?)
        (FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/x/w"), 1, r"internal error"),
    ]:
        def fails(args, e=e):
            raise e

        monkeypatch.setitem(commands.COMMANDS, "generate", fails)
        got, err = run_main(["generate", "mhla", str(tmp_path / "g.zarr")], capsys)
        assert got == rc, err
        expect(error_line(err), pattern)


def _private_mounts() -> bool:
    """Whether this machine lets an unprivileged user namespace mount a tmpfs (``unshare -Urm``)."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    p = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return p.returncode == 0


def _in_mount(script: str, cwd) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) in a private mount namespace, with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONWARNINGS": "ignore"}
    return subprocess.run(["unshare", "-Urm", "sh", "-ec", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not _private_mounts(), reason="no private mount namespace (unshare -Urm) on this machine")
def test_a_real_full_disk_and_a_real_read_only_mount(inputs, tmp_path):
    """No injection: the checkpoint on a 96 KiB tmpfs fills up while the embedded cluster's worker processes
    write their partials; a read-only mount refuses generate, import, fit and plot. Each is one line, exit 2."""
    py = f"{sys.executable} -m scaleattn"
    small = tmp_path / "small"
    ro = tmp_path / "ro"
    small.mkdir()
    ro.mkdir()
    script = f"""
mount -t tmpfs -o size=96k tmpfs {small}
mount -t tmpfs -o size=1m tmpfs {ro}
mkdir {ro}/sub
mount -o remount,ro {ro}
set +e
{py} fit {inputs}/d.zarr --out run --checkpoint {small}/ck.zarr --workers 1 --no-plots --quiet; echo "rc=$?"
ls {small}; echo "--"
{py} generate mhla {ro}/g.zarr --samples 8 --length 3; echo "rc=$?"
{py} import {ro}/sub/i.zarr --npz {inputs}/a.npz; echo "rc=$?"
{py} fit {inputs}/d.zarr --out {ro}/run --local --no-plots --quiet; echo "rc=$?"
{py} plot {inputs}/run0 --out {ro}/pl; echo "rc=$?"
"""
    p = _in_mount(script, tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines().count("rc=2") == 5, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("scaleattn ")]
    assert len(lines) == 5 and not any("internal error" in ln or "Traceback" in ln for ln in lines), p.stderr
    expect(lines[0], rf"scaleattn fit: error: cannot write the checkpoint {small}/ck\.zarr: No space left on device;"
                     r" (no checkpoint was kept|the checkpoint \S+ keeps \d+ of 16 row groups: repeat the fit with"
                     r" --resume)")
    for line, what in zip(lines[1:], ["g.zarr", "sub/i.zarr", "run", "pl"]):
        expect(line, rf"cannot write .*{ro}/{what}.*Read-only file system")
    assert not os.path.exists(tmp_path / "run")  # nothing of the fit was written
